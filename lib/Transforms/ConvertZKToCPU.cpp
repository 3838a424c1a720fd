//===- ConvertZKToCPU.cpp - zk kernels into vectorized CPU functions ------===//
//
// Every zk.kernel becomes one function per ISA variant:
//
//   void name_<isa>(void *const *states, int64_t n, const float *coeffs)
//   double name_<isa>(...)                        (sumsq kernels)
//
// with a loop over full vectors of W lanes (W = 16 for AVX-512, 8 for AVX2)
// and a scalar loop over the tail; the body is the kernel body cloned at
// vector type. bf16 values are carried as the f32 they exactly widen to.
//
//===----------------------------------------------------------------------===//
#include "zopt/Transforms/Passes.h"
#include "zopt/abi.h"

#include "mlir/IR/IRMapping.h"

#include <cstring>

namespace mlir::zopt {
#define GEN_PASS_DEF_CONVERTZKTOCPU
#include "zopt/Transforms/Passes.h.inc"
} // namespace mlir::zopt

using namespace mlir;
using namespace mlir::zopt;

namespace {

struct IsaInfo {
  const char *name;
  int lanes;
  zopt_isa code;
};

static std::optional<IsaInfo> lookupIsa(StringRef name) {
  if (name == "avx512")
    return IsaInfo{"avx512", 16, ZOPT_ISA_AVX512};
  if (name == "avx2")
    return IsaInfo{"avx2", 8, ZOPT_ISA_AVX2};
  return std::nullopt;
}

/// Builds code for one kernel body at one width.
struct BodyEmitter {
  OpBuilder &b;
  Location loc;
  int lanes; // 1: scalar
  ArrayRef<Value> statePtrs;  // indexed by slot (null when unused)
  ArrayRef<Value> coeffScalars;
  SmallVector<Value> coeffVecs;

  Type vec(Type t) {
    if (lanes == 1)
      return t;
    return VectorType::get({lanes}, t);
  }
  Value splatConst(arith::ConstantOp c) {
    if (lanes == 1)
      return b.clone(*c)->getResult(0);
    auto attr = cast<TypedAttr>(c.getValue());
    return arith::ConstantOp::create(
        b, loc, DenseElementsAttr::get(cast<ShapedType>(vec(attr.getType())),
                                       attr));
  }
  Value intCst(Type elem, int64_t v) {
    Type t = vec(elem);
    if (lanes == 1)
      return arith::ConstantOp::create(b, loc, t, b.getIntegerAttr(elem, v));
    return arith::ConstantOp::create(
        b, loc, DenseElementsAttr::get(cast<ShapedType>(t),
                                       b.getIntegerAttr(elem, v)));
  }
  Value elemPtr(int64_t slot, Type memElem, Value i) {
    auto ptrTy = LLVM::LLVMPointerType::get(b.getContext());
    return LLVM::GEPOp::create(b, loc, ptrTy, memElem, statePtrs[slot],
                               ValueRange{i});
  }
  /// bf16 bits -> f32 (exact).
  Value bf16BitsToF32(Value bits16) {
    Value w = arith::ExtUIOp::create(b, loc, vec(b.getI32Type()), bits16);
    w = arith::ShLIOp::create(b, loc, w, intCst(b.getI32Type(), 16));
    return arith::BitcastOp::create(b, loc, vec(b.getF32Type()), w);
  }
  /// f32 -> bf16 bits, round to nearest even; NaN stays a (quiet) NaN.
  Value f32ToBf16Bits(Value x) {
    Type i32 = b.getI32Type();
    Value bits = arith::BitcastOp::create(b, loc, vec(i32), x);
    Value lsb = arith::AndIOp::create(
        b, loc, arith::ShRUIOp::create(b, loc, bits, intCst(i32, 16)),
        intCst(i32, 1));
    Value rounded = arith::AddIOp::create(
        b, loc, bits, arith::AddIOp::create(b, loc, lsb, intCst(i32, 0x7FFF)));
    Value hi = arith::ShRUIOp::create(b, loc, rounded, intCst(i32, 16));
    Value nanBits = arith::OrIOp::create(
        b, loc, arith::ShRUIOp::create(b, loc, bits, intCst(i32, 16)),
        intCst(i32, 0x40));
    Value isNan =
        arith::CmpFOp::create(b, loc, arith::CmpFPredicate::UNO, x, x);
    Value sel = arith::SelectOp::create(b, loc, isNan, nanBits, hi);
    return arith::TruncIOp::create(b, loc, vec(b.getI16Type()), sel);
  }

  /// Emits the body for the element(s) at index `i`; returns the value to
  /// accumulate (sumsq kernels) or null.
  Value emit(Block &body, Value i) {
    IRMapping map;
    Value acc;
    auto get = [&](Value v) { return map.lookup(v); };
    for (Operation &op : body) {
      if (auto l = dyn_cast<zk::LoadOp>(op)) {
        Type t = l.getType();
        Value r;
        if (t.isBF16()) {
          Value p = elemPtr(l.getSlot(), b.getI16Type(), i);
          r = bf16BitsToF32(
              LLVM::LoadOp::create(b, loc, vec(b.getI16Type()), p, 2));
        } else {
          Value p = elemPtr(l.getSlot(), t, i);
          r = LLVM::LoadOp::create(b, loc, vec(t), p, t.isF32() ? 4 : 2);
        }
        map.map(l.getResult(), r);
      } else if (auto c = dyn_cast<zk::CoeffOp>(op)) {
        map.map(c.getResult(), lanes == 1 ? coeffScalars[c.getIndex()]
                                          : coeffVecs[c.getIndex()]);
      } else if (auto c = dyn_cast<arith::ConstantOp>(op)) {
        map.map(c.getResult(), splatConst(c));
      } else if (auto e = dyn_cast<arith::ExtFOp>(op);
                 e && e.getIn().getType().isBF16()) {
        map.map(e.getResult(), get(e.getIn())); // already f32
      } else if (auto t = dyn_cast<arith::TruncFOp>(op);
                 t && t.getType().isBF16()) {
        map.map(t.getResult(), bf16BitsToF32(f32ToBf16Bits(get(t.getIn()))));
      } else if (auto s = dyn_cast<zk::StoreOp>(op)) {
        Type st = s.getStorage();
        Value v = get(s.getValue());
        Type vt = s.getValue().getType();
        if (vt.isBF16())
          vt = b.getF32Type(); // carried as f32
        if (vt.isF16() && !st.isF16())
          v = arith::ExtFOp::create(b, loc, vec(b.getF32Type()), v);
        Value toStore;
        int align = 4;
        Type memElem = st;
        if (st.isF32()) {
          toStore = v;
        } else if (st.isBF16()) {
          toStore = f32ToBf16Bits(v);
          memElem = b.getI16Type();
          align = 2;
        } else { // f16
          toStore = vt.isF16() ? v
                               : arith::TruncFOp::create(
                                     b, loc, vec(b.getF16Type()), v)
                                     .getResult();
          align = 2;
        }
        LLVM::StoreOp::create(b, loc, toStore, elemPtr(s.getSlot(), memElem, i),
                              align);
      } else if (auto a = dyn_cast<zk::AccumulateOp>(op)) {
        Value x = get(a.getValue());
        Type f64 = vec(b.getF64Type());
        if (!a.getValue().getType().isF64())
          x = arith::ExtFOp::create(b, loc, f64, x);
        acc = arith::MulFOp::create(b, loc, x, x);
      } else {
        // Elementwise arith/math: same op at vector type.
        OperationState st(loc, op.getName());
        for (Value v : op.getOperands())
          st.addOperands(get(v));
        for (Type t : op.getResultTypes())
          st.addTypes(vec(t.isBF16() ? b.getF32Type() : t));
        st.addAttributes(op.getAttrs());
        // Let LLVM fuse a*b+c into FMA: fp32 math with one rounding fewer,
        // never less accurate than the unfused form.
        if (isa<arith::MulFOp, arith::AddFOp, arith::SubFOp>(op))
          st.attributes.set("fastmath", arith::FastMathFlagsAttr::get(
                                          b.getContext(),
                                          arith::FastMathFlags::contract));
        Operation *n = b.create(st);
        for (auto [o, r] : llvm::zip(op.getResults(), n->getResults()))
          map.map(o, r);
      }
    }
    return acc;
  }
};

static Value loadPtrAt(OpBuilder &b, Location loc, Value base, int64_t idx,
                       Type elem, Type result) {
  auto ptrTy = LLVM::LLVMPointerType::get(b.getContext());
  Value p = LLVM::GEPOp::create(b, loc, ptrTy, elem, base,
                                ArrayRef<LLVM::GEPArg>{int32_t(idx)});
  return LLVM::LoadOp::create(b, loc, result, p);
}

static func::FuncOp lowerKernel(OpBuilder &mb, zk::KernelOp k,
                                const IsaInfo &isa, int64_t numStates) {
  MLIRContext *ctx = k.getContext();
  Location loc = k.getLoc();
  auto ptrTy = LLVM::LLVMPointerType::get(ctx);
  Type i64 = IntegerType::get(ctx, 64), f64 = Float64Type::get(ctx),
       f32 = Float32Type::get(ctx);
  bool isSum = k.getRole() == zk::KernelRole::sumsq;
  auto fnTy = FunctionType::get(ctx, {ptrTy, i64, ptrTy},
                                isSum ? TypeRange{f64} : TypeRange{});
  auto fn = func::FuncOp::create(mb, loc,
                                 (k.getSymName() + "_" + isa.name).str(), fnTy);
  fn->setAttr("zopt.isa", StringAttr::get(ctx, isa.name));
  fn->setAttr("llvm.linkage",
              LLVM::LinkageAttr::get(ctx, LLVM::Linkage::External));
  Block *entry = fn.addEntryBlock();
  OpBuilder b = OpBuilder::atBlockEnd(entry);
  Value states = entry->getArgument(0), n = entry->getArgument(1),
        coeffs = entry->getArgument(2);
  Block &body = k.getBody().front();

  SmallVector<Value> ptrs(numStates);
  int64_t maxCoeff = -1;
  for (Operation &op : body) {
    int64_t slot = -1;
    if (auto l = dyn_cast<zk::LoadOp>(op))
      slot = l.getSlot();
    if (auto s = dyn_cast<zk::StoreOp>(op))
      slot = s.getSlot();
    if (slot >= 0 && !ptrs[slot])
      ptrs[slot] = loadPtrAt(b, loc, states, slot, ptrTy, ptrTy);
    if (auto c = dyn_cast<zk::CoeffOp>(op))
      maxCoeff = std::max<int64_t>(maxCoeff, c.getIndex());
  }
  SmallVector<Value> cs, cv;
  for (int64_t c = 0; c <= maxCoeff; ++c) {
    cs.push_back(loadPtrAt(b, loc, coeffs, c, f32, f32));
    cv.push_back(vector::BroadcastOp::create(
        b, loc, VectorType::get({isa.lanes}, f32), cs.back()));
  }

  Value W = arith::ConstantOp::create(b, loc, b.getI64IntegerAttr(isa.lanes));
  Value zero = arith::ConstantOp::create(b, loc, b.getI64IntegerAttr(0));
  Value one = arith::ConstantOp::create(b, loc, b.getI64IntegerAttr(1));

  BodyEmitter vecE{b, loc, isa.lanes, ptrs, cs, cv};
  BodyEmitter sclE{b, loc, 1, ptrs, cs, {}};
  if (!isSum) {
    // Two vectors per iteration (independent work for the divide/sqrt unit
    // while loads are in flight), then the scalar tail.
    Value W2 = arith::ConstantOp::create(b, loc,
                                         b.getI64IntegerAttr(2 * isa.lanes));
    Value nVec2 = arith::SubIOp::create(b, loc, n,
                                        arith::RemSIOp::create(b, loc, n, W2));
    auto l1 = scf::ForOp::create(b, loc, zero, nVec2, W2);
    {
      OpBuilder::InsertionGuard g(b);
      b.setInsertionPoint(l1.getBody()->getTerminator());
      Value i0 = l1.getInductionVar();
      vecE.emit(body, i0);
      vecE.emit(body, arith::AddIOp::create(b, loc, i0, W));
    }
    auto l2 = scf::ForOp::create(b, loc, nVec2, n, one);
    {
      OpBuilder::InsertionGuard g(b);
      b.setInsertionPoint(l2.getBody()->getTerminator());
      sclE.emit(body, l2.getInductionVar());
    }
    func::ReturnOp::create(b, loc);
    return fn;
  }
  Value nVec =
      arith::SubIOp::create(b, loc, n, arith::RemSIOp::create(b, loc, n, W));
  auto accTy = VectorType::get({isa.lanes}, f64);
  Value accInit = arith::ConstantOp::create(
      b, loc, DenseElementsAttr::get(accTy, b.getF64FloatAttr(0.0)));
  auto l1 = scf::ForOp::create(
      b, loc, zero, nVec, W, ValueRange{accInit},
      [&](OpBuilder &lb, Location l, Value iv, ValueRange iter) {
        BodyEmitter e{lb, l, isa.lanes, ptrs, cs, cv};
        Value sq = e.emit(body, iv);
        scf::YieldOp::create(lb, l,
                             ValueRange{arith::AddFOp::create(lb, l, iter[0], sq)});
      });
  Value partial = vector::ReductionOp::create(b, loc, vector::CombiningKind::ADD,
                                              l1.getResult(0));
  auto l2 = scf::ForOp::create(
      b, loc, nVec, n, one, ValueRange{partial},
      [&](OpBuilder &lb, Location l, Value iv, ValueRange iter) {
        BodyEmitter e{lb, l, 1, ptrs, cs, {}};
        Value sq = e.emit(body, iv);
        scf::YieldOp::create(lb, l,
                             ValueRange{arith::AddFOp::create(lb, l, iter[0], sq)});
      });
  func::ReturnOp::create(b, loc, l2.getResult(0));
  return fn;
}

static func::FuncOp lowerPrepare(OpBuilder &mb, zk::PrepareOp p) {
  MLIRContext *ctx = p.getContext();
  Location loc = p.getLoc();
  auto ptrTy = LLVM::LLVMPointerType::get(ctx);
  auto fn = func::FuncOp::create(mb, loc, p.getSymName(),
                                 FunctionType::get(ctx, {ptrTy, ptrTy, ptrTy}, {}));
  fn->setAttr("zopt.isa", StringAttr::get(ctx, "none"));
  Block *entry = fn.addEntryBlock();
  OpBuilder b = OpBuilder::atBlockEnd(entry);
  Type f64 = b.getF64Type(), f32 = b.getF32Type();
  IRMapping map;
  for (Operation &op : p.getBody().front()) {
    if (auto h = dyn_cast<zk::HyperOp>(op)) {
      map.map(h.getResult(), loadPtrAt(b, loc, entry->getArgument(0),
                                       h.getIndex(), f64, f64));
    } else if (auto g = dyn_cast<zk::GlobalOp>(op)) {
      map.map(g.getResult(), loadPtrAt(b, loc, entry->getArgument(1),
                                       g.getIndex(), f64, f64));
    } else if (auto s = dyn_cast<zk::SetCoeffOp>(op)) {
      Value v = map.lookup(s.getValue());
      if (!v.getType().isF32())
        v = arith::TruncFOp::create(b, loc, f32, v);
      Value ptr = LLVM::GEPOp::create(
          b, loc, ptrTy, f32, entry->getArgument(2),
          ArrayRef<LLVM::GEPArg>{int32_t(s.getIndex())});
      LLVM::StoreOp::create(b, loc, v, ptr);
    } else {
      b.clone(op, map);
    }
  }
  func::ReturnOp::create(b, loc);
  return fn;
}

static void copyName(char *dst, StringRef s) {
  std::memset(dst, 0, ZOPT_NAME_LEN);
  std::memcpy(dst, s.data(), std::min<size_t>(s.size(), ZOPT_NAME_LEN - 1));
}

struct ConvertZKToCPU
    : public mlir::zopt::impl::ConvertZKToCPUBase<ConvertZKToCPU> {
  using Base::Base;
  void runOnOperation() override {
    ModuleOp m = getOperation();
    SmallVector<IsaInfo> variants;
    SmallVector<std::string> names(isas.begin(), isas.end());
    if (names.empty())
      names = {"avx512", "avx2"};
    for (const std::string &n : names) {
      auto info = lookupIsa(n);
      if (!info) {
        m.emitError("unknown ISA variant '") << n << "'; expected avx512 or avx2";
        return signalPassFailure();
      }
      variants.push_back(*info);
    }
    auto descs = llvm::to_vector(m.getOps<zk::DescriptorOp>());
    if (descs.size() != 1) {
      m.emitError("expected exactly one zk.descriptor");
      return signalPassFailure();
    }
    zk::DescriptorOp d = descs.front();

    zopt_step_descriptor desc;
    std::memset(&desc, 0, sizeof(desc));
    std::memcpy(desc.magic, ZOPT_DESC_MAGIC, 8);
    desc.abi_version = ZOPT_ABI_VERSION;
    desc.size = sizeof(desc);
    copyName(desc.name, d.getName());
    desc.zero_stage = d.getZeroStage();
    desc.align = d.getAlign();
    desc.flags = d.getFlags();
    desc.max_norm = d.getMaxNorm().convertToDouble();
    desc.num_states = d.getStateKinds().size();
    desc.num_hypers = d.getHyperKinds().size();
    desc.num_coeffs = d.getNumCoeffs();
    for (unsigned i = 0; i < desc.num_states; ++i)
      desc.states[i] = {uint32_t(d.getStateKinds()[i]),
                        uint32_t(d.getStateDtypes()[i]),
                        uint32_t(d.getStatePlacements()[i]),
                        uint32_t(d.getStateRoundings()[i]),
                        uint32_t(d.getStateInits()[i]),
                        uint32_t(d.getStateAccess()[i])};
    for (unsigned i = 0; i < desc.num_hypers; ++i) {
      zopt_hyper_desc &h = desc.hypers[i];
      h.kind = d.getHyperKinds()[i];
      h.default_value = d.getHyperDefaults()[i];
      h.min_value = d.getHyperMins()[i];
      h.max_value = d.getHyperMaxs()[i];
      h.max_exclusive = d.getHyperMaxExclusive()[i];
    }
    auto addKernel = [&](zopt_kernel_role role, zopt_isa isa, StringRef sym) {
      zopt_kernel_desc &kd = desc.kernels[desc.num_kernels++];
      kd.role = role;
      kd.isa = isa;
      kd.device = ZOPT_PLACE_CPU;
      copyName(kd.symbol, sym);
    };

    OpBuilder mb = OpBuilder::atBlockEnd(m.getBody());
    for (auto p : llvm::make_early_inc_range(m.getOps<zk::PrepareOp>())) {
      func::FuncOp f = lowerPrepare(mb, p);
      addKernel(ZOPT_KERNEL_PREPARE, ZOPT_ISA_NONE, f.getSymName());
      p.erase();
    }
    for (auto k : llvm::make_early_inc_range(m.getOps<zk::KernelOp>())) {
      for (const IsaInfo &isa : variants) {
        if (desc.num_kernels >= ZOPT_MAX_KERNELS) {
          k.emitError("too many kernels for the descriptor");
          return signalPassFailure();
        }
        func::FuncOp f = lowerKernel(mb, k, isa, desc.num_states);
        addKernel(k.getRole() == zk::KernelRole::update ? ZOPT_KERNEL_UPDATE
                                                        : ZOPT_KERNEL_SUMSQ,
                  isa.code, f.getSymName());
      }
      k.erase();
    }
    desc.checksum = zopt_desc_checksum(&desc);

    auto arrTy = LLVM::LLVMArrayType::get(IntegerType::get(&getContext(), 8),
                                          sizeof(desc));
    auto g = LLVM::GlobalOp::create(
        mb, d.getLoc(), arrTy, /*isConstant=*/true, LLVM::Linkage::External,
        ZOPT_DESC_SYMBOL,
        mb.getStringAttr(StringRef(reinterpret_cast<const char *>(&desc),
                                   sizeof(desc))),
        /*alignment=*/8);
    (void)g;
    d.erase();
  }
};

} // namespace
