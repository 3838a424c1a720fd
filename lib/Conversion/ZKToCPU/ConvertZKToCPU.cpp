//===- ConvertZKToCPU.cpp - zk kernels into vectorized CPU functions ------===//
//
// Every zk.kernel becomes one function per ISA variant:
//
//   void name_<isa>(void *const *in, void *const *out, int64_t n,
//                   const float *coeffs)                 (update kernels)
//   double name_<isa>(void *const *states, int64_t n,
//                     const float *coeffs)               (sumsq kernels)
//
// with a loop over full vectors and the tail; the body is the kernel body
// cloned at vector type. W = 16 lanes for AVX-512, 8 for AVX2: UPDATE
// kernels run 2W lanes per iteration (LLVM splits them into two registers:
// independent work for the divide/sqrt unit while loads are in flight, and
// two 16-bit vectors pack into one register-wide store) and a tail (AVX-512:
// masked steps of W lanes; AVX2: scalar), loading through `in` and storing
// through `out`. SUMSQ kernels run
// ZOPT_SUMSQ_LANES f64 accumulators on every ISA, a masked tail and an
// ordered lane sum: the order abi.h defines, so the result is the same bits
// on every variant. bf16 values are carried as the f32 they exactly widen to;
// a kernel whose every access is bf16 (SUMSQ: its loads; UPDATE: its loads
// and stores, on the variants without a bf16 instruction) works in split
// order (BodyEmitter::splitBf16: even elements, then odd ones), which needs
// no 16-bit shuffle.
// The avx512bf16 variant narrows to bf16 with VCVTNEPS2BF16 (BodyEmitter.h); it
// is emitted only for UPDATE kernels that store bf16, where it differs from
// the avx512 one, unless it is the only variant asked for. The zk.control
// becomes the host function `void name(zopt_control *)` (abi.h CONTROL), for
// CPU and GPU steps alike. The zk.descriptor stays: the functions' kernel-table entries are recorded on it
// (cpu_kernels) for zopt-emit-descriptor.
//
//===----------------------------------------------------------------------===//
#include "zopt/Conversion/ZKToCPU/ZKToCPU.h"

#include "../ZKCommon/BodyEmitter.h"
#include "Q8Blocks.h"
#include "zopt/Dialect/ZK/IR/ZKOps.h"
#include "zopt/abi.h"

#include "mlir/IR/IRMapping.h"

#include <cstddef>

namespace mlir::zopt {
#define GEN_PASS_DEF_CONVERTZKTOCPU
#include "zopt/Conversion/Passes.h.inc"
} // namespace mlir::zopt

using namespace mlir;
using namespace mlir::zopt;

namespace {

struct IsaInfo {
  const char *name;
  int lanes;
  zopt_isa code;
  bool nativeBf16;
};

static std::optional<IsaInfo> lookupIsa(StringRef name) {
  if (name == "avx512bf16")
    return IsaInfo{"avx512bf16", 16, ZOPT_ISA_AVX512BF16, true};
  if (name == "avx512")
    return IsaInfo{"avx512", 16, ZOPT_ISA_AVX512, false};
  if (name == "avx2")
    return IsaInfo{"avx2", 8, ZOPT_ISA_AVX2, false};
  return std::nullopt;
}

static bool storesStochastic(zk::KernelOp k) {
  bool any = false;
  k.getBody().walk([&](zk::StoreOp s) {
    any |= s.getRounding() == ZOPT_ROUND_STOCHASTIC;
  });
  return any;
}

static bool storesBf16(zk::KernelOp k) {
  bool any = false;
  k.getBody().walk([&](zk::StoreOp s) { any |= s.getStorage().isBF16(); });
  return any;
}

/// How far ahead of its loads every CPU kernel prefetches each array
/// (runtime/tools/stream_roofline.h's kPrefetchBytes is the same distance).
// The lanes of a masked tail step over elements [from, n) (n - from <
// lanes): the UPDATE's and SUMSQ's last step on AVX-512.
static Value tailMask(OpBuilder &b, Location loc, int lanes, Value n, Value from) {
  Value rem = arith::SubIOp::create(b, loc, n, from);
  return vector::CreateMaskOp::create(
      b, loc, VectorType::get({lanes}, b.getI1Type()),
      ValueRange{arith::IndexCastOp::create(b, loc, b.getIndexType(), rem)});
}

// A SUMSQ's end, after its full vectors summed into `acc`: the tail's
// elements [nVec, n) through `tailAcc(acc, mask)` where there are any, then
// the lanes summed in element order (split order: each lane back at its
// element first), the f64 total. The one pass (lowerKernel) and the pair
// entry (lowerSumsqPair) end alike: the same bits for a chunk either way.
static Value sumsqTailAndTotal(OpBuilder &b, Location loc, int lanes, bool split, Type accTy, Value acc,
                               Value n, Value nVec, llvm::function_ref<Value(Value, Value)> tailAcc) {
  Value hasTail = arith::CmpIOp::create(b, loc, arith::CmpIPredicate::slt, nVec, n);
  auto tail = scf::IfOp::create(b, loc, TypeRange{accTy}, hasTail, true);
  {
    OpBuilder::InsertionGuard g(b);
    b.setInsertionPointToStart(&tail.getThenRegion().front());
    Value mask = tailMask(b, loc, lanes, n, nVec);
    scf::YieldOp::create(b, loc, ValueRange{tailAcc(acc, mask)});
    b.setInsertionPointToStart(&tail.getElseRegion().front());
    scf::YieldOp::create(b, loc, ValueRange{acc});
  }
  Value lanesSum = tail.getResult(0);
  if (split) {
    // a[l] sits in the lane j with splitElement(j) == l.
    SmallVector<int64_t> inv(lanes);
    for (int j = 0; j < lanes; ++j)
      inv[BodyEmitter::splitElement(j, lanes)] = j;
    lanesSum = vector::ShuffleOp::create(b, loc, lanesSum, lanesSum, inv);
  }
  return vector::ReductionOp::create(b, loc, vector::CombiningKind::ADD, lanesSum);
}

static constexpr int64_t kPrefetchBytes = 2048;

static func::FuncOp lowerKernel(OpBuilder &mb, zk::KernelOp k,
                                const IsaInfo &isa, int64_t numStates) {
  MLIRContext *ctx = k.getContext();
  Location loc = k.getLoc();
  auto ptrTy = LLVM::LLVMPointerType::get(ctx);
  Type i64 = IntegerType::get(ctx, 64), f64 = Float64Type::get(ctx),
       f32 = Float32Type::get(ctx);
  bool isSum = k.getRole() == zk::KernelRole::sumsq;
  // Stochastic rounding: (key, first) after the ABI arguments.
  bool sr = !isSum && storesStochastic(k);
  Type i32 = IntegerType::get(ctx, 32);
  // UPDATE: (in, out, n, coeffs[, key, first]); SUMSQ: (states, n, coeffs).
  SmallVector<Type> args =
      isSum ? SmallVector<Type>{ptrTy, i64, ptrTy}
            : SmallVector<Type>{ptrTy, ptrTy, i64, ptrTy};
  if (sr)
    args.append({i32, i32});
  auto fnTy = FunctionType::get(ctx, args, isSum ? TypeRange{f64} : TypeRange{});
  auto fn = func::FuncOp::create(mb, loc,
                                 (k.getSymName() + "_" + isa.name).str(), fnTy);
  fn->setAttr("zopt.isa", StringAttr::get(ctx, isa.name));
  fn->setAttr("llvm.linkage",
              LLVM::LinkageAttr::get(ctx, LLVM::Linkage::External));
  Block *entry = fn.addEntryBlock();
  OpBuilder b = OpBuilder::atBlockEnd(entry);
  Value inTable = entry->getArgument(0);
  Value outTable = isSum ? Value() : entry->getArgument(1);
  Value n = entry->getArgument(isSum ? 1 : 2),
        coeffs = entry->getArgument(isSum ? 2 : 3);
  Block &body = k.getBody().front();

  SmallVector<Value> ptrs(numStates), outPtrs(numStates);
  int64_t maxCoeff = -1;
  for (Operation &op : body) {
    // A remainder master's load and store also touch the param's slot.
    auto in = [&](int64_t slot) {
      if (!ptrs[slot])
        ptrs[slot] = loadPtrAt(b, loc, inTable, slot, ptrTy, ptrTy);
    };
    auto out = [&](int64_t slot) {
      if (!outPtrs[slot])
        outPtrs[slot] = loadPtrAt(b, loc, outTable, slot, ptrTy, ptrTy);
    };
    if (auto l = dyn_cast<zk::LoadOp>(op)) {
      in(l.getSlot());
      if (auto h = l.getRemainderOf())
        in(*h);
    }
    if (auto s = dyn_cast<zk::StoreOp>(op)) {
      out(s.getSlot());
      if (auto h = s.getRemainderOf())
        out(*h);
      if (auto c = s.getKahan()) { // reads the param and its compensation
        in(s.getSlot());
        in(*c);
        out(*c);
      }
    }
    if (auto c = dyn_cast<zk::CoeffOp>(op))
      maxCoeff = std::max<int64_t>(maxCoeff, c.getIndex());
  }
  // UPDATE: two registers' worth per iteration. SUMSQ: ZOPT_SUMSQ_LANES f64
  // accumulators on every ISA (abi.h: the sum's order is part of the
  // contract, so the bits do not depend on the variant).
  const int lanes = isSum ? ZOPT_SUMSQ_LANES : 2 * isa.lanes;
  bool sumsqOfNarrow = false;
  body.walk([&](zk::AccumulateOp a) {
    sumsqOfNarrow = !a.getValue().getType().isF64();
  });
  SmallVector<Value> cs, cv;
  for (int64_t c = 0; c <= maxCoeff; ++c) {
    cs.push_back(loadPtrAt(b, loc, coeffs, c, f32, f32));
    cv.push_back(vector::BroadcastOp::create(
        b, loc, VectorType::get({lanes}, f32), cs.back()));
  }

  Value W = arith::ConstantOp::create(b, loc, b.getI64IntegerAttr(lanes));
  Value zero = arith::ConstantOp::create(b, loc, b.getI64IntegerAttr(0));
  Value one = arith::ConstantOp::create(b, loc, b.getI64IntegerAttr(1));

  // An UPDATE whose every load and store is plain bf16 (the 14 B/param
  // layout: bf16 param, grad and moments) runs in split order
  // (BodyEmitter::splitBf16): widening and narrowing become shifts and
  // masks of 32-bit words instead of 16-bit shuffles, which on AVX2 and on
  // AVX-512 without AVX512_BF16 were the shuffle port's bottleneck. The
  // update is elementwise, so the bits are the same; the stochastic
  // rounding index is permuted with the lanes. Not where the hardware
  // converts (avx512bf16: VCVTNE2PS2BF16 writes element order).
  bool splitUpdate = !isSum && !isa.nativeBf16 && lanes % 2 == 0;
  {
    bool anyLoad = false;
    body.walk([&](zk::LoadOp l) {
      anyLoad = true;
      splitUpdate &= l.getType().isBF16() && !l.getRemainderOf() && !l.getAbsmax();
    });
    body.walk([&](zk::StoreOp st) {
      splitUpdate &= st.getStorage().isBF16() && !st.getRemainderOf() && !st.getAbsmax();
    });
    splitUpdate &= anyLoad;
  }
  BodyEmitter vecE{b, loc, lanes, ptrs, cs, cv};
  vecE.packHalves = true;
  vecE.splitBf16 = splitUpdate;
  vecE.nativeBf16 = isa.nativeBf16;
  vecE.x86Gather = isa.lanes == 16 ? 512 : 256;
  vecE.avx512 = isa.lanes == 16;
  vecE.storePtrs = outPtrs;
  BodyEmitter sclE{b, loc, 1, ptrs, cs, {}};
  sclE.storePtrs = outPtrs;
  Value srFirst, srIota;
  if (sr) {
    vecE.srKey = sclE.srKey = entry->getArgument(4);
    srFirst = entry->getArgument(5);
    SmallVector<int32_t> iota(lanes);
    for (int j = 0; j < lanes; ++j)
      iota[j] = splitUpdate ? int32_t(BodyEmitter::splitElement(j, lanes)) : j;
    srIota = arith::ConstantOp::create(
        b, loc, DenseIntElementsAttr::get(VectorType::get({lanes}, i32), iota));
  }
  // The i32 element index (mod 2^32) of element i of this call.
  auto srIndexAt = [&](Value i) {
    return arith::AddIOp::create(b, loc, srFirst,
                                 arith::TruncIOp::create(b, loc, i32, i));
  };
  Value nVec = arith::SubIOp::create(b, loc, n,
                                     arith::RemSIOp::create(b, loc, n, W));
  // On the hosts measured one thread's hardware prefetch leaves a stream
  // at about 60 % of a plain read of DRAM; a software prefetch
  // kPrefetchBytes ahead of every array the kernel loads, one per 64-byte
  // line, brings the norm pass to a plain read's rate and speeds the
  // update (docs/benchmarks/cpu.md). Prefetches past the end never fault.
  SmallVector<std::pair<Value, int64_t>> streams; // (base, element bytes)
  body.walk([&](zk::LoadOp l) {
    Type t = l.getType();
    int64_t bytes = t.isF64() ? 8 : t.isF32() ? 4 : 2;
    auto stream = [&](Value p, int64_t bytes) {
      if (llvm::none_of(streams, [&](auto &s) { return s.first == p; }))
        streams.push_back({p, bytes});
    };
    if (auto h = l.getRemainderOf()) { // two 16-bit halves
      stream(ptrs[*h], 2);
      bytes = 2;
    }
    if (l.getAbsmax()) // q8 codes
      bytes = 1;
    stream(ptrs[l.getSlot()], bytes);
  });
  body.walk([&](zk::StoreOp s) { // a Kahan param's compensation (bf16)
    if (auto c = s.getKahan())
      if (llvm::none_of(streams, [&](auto &x) { return x.first == ptrs[*c]; }))
        streams.push_back({ptrs[*c], 2});
  });
  auto prefetchAhead = [&](OpBuilder &pb, Location l, Value iv) {
    Type i8 = pb.getI8Type();
    for (auto [base, bytes] : streams) {
      Value off = arith::MulIOp::create(
          pb, l, iv,
          arith::ConstantOp::create(pb, l, pb.getI64IntegerAttr(bytes)));
      for (int64_t k = 0; k < lanes * bytes; k += 64) {
        Value at = arith::AddIOp::create(
            pb, l, off,
            arith::ConstantOp::create(
                pb, l, pb.getI64IntegerAttr(kPrefetchBytes + k)));
        Value addr = LLVM::GEPOp::create(pb, l, base.getType(), i8, base,
                                         ValueRange{at});
        LLVM::Prefetch::create(pb, l, addr, /*rw=*/0, /*hint=*/3,
                               /*cache=*/1);
      }
    }
  };
  bool q8 = false;
  body.walk([&](zk::LoadOp l) { q8 |= bool(l.getAbsmax()); });
  body.walk([&](zk::StoreOp s) { q8 |= bool(s.getAbsmax()); });
  if (!isSum && q8) {
    emitQ8Blocks(b, loc, fn, body, inTable, outTable, n, lanes, vecE, sclE,
                 [&](Value iv) {
                   prefetchAhead(b, loc, iv);
                   if (sr)
                     vecE.srIndex = arith::AddIOp::create(
                         b, loc,
                         vector::BroadcastOp::create(
                             b, loc, VectorType::get({lanes}, i32),
                             srIndexAt(iv)),
                         srIota);
                 },
                 [&](Value iv) {
                   if (sr)
                     sclE.srIndex = srIndexAt(iv);
                 });
    func::ReturnOp::create(b, loc);
    return fn;
  }
  if (!isSum) {
    auto l1 = scf::ForOp::create(b, loc, zero, nVec, W);
    {
      OpBuilder::InsertionGuard g(b);
      b.setInsertionPoint(l1.getBody()->getTerminator());
      prefetchAhead(b, loc, l1.getInductionVar());
      if (sr)
        vecE.srIndex = arith::AddIOp::create(
            b, loc,
            vector::BroadcastOp::create(b, loc, VectorType::get({lanes}, i32),
                                        srIndexAt(l1.getInductionVar())),
            srIota);
      vecE.emit(body, l1.getInductionVar());
    }
    if (isa.lanes == 16) {
      // AVX-512: the tail (< 2W elements) in one-register steps of W
      // lanes, masked (element order, split or not; masked-off lanes
      // compute on zeros and store nothing). The same operations on every
      // element, so the same bits as the scalar tail (zopt-kernel-check
      // compares the variants at n = 1..67). In L1, a call over 100 f32
      // elements cost 1.3x one over 96 with the scalar tail, 1.17x masked
      // (docs/benchmarks/cpu.md "Many small tensors"). AVX2 has no masked
      // 16-bit loads or stores (LLVM would scalarize them): the scalar tail
      // stays there.
      const int w = isa.lanes;
      SmallVector<Value> cw;
      for (Value c : cs)
        cw.push_back(vector::BroadcastOp::create(
            b, loc, VectorType::get({w}, f32), c));
      Value Wt = arith::ConstantOp::create(b, loc, b.getI64IntegerAttr(w));
      Value tIota;
      if (sr) {
        SmallVector<int32_t> iota(w);
        for (int j = 0; j < w; ++j)
          iota[j] = splitUpdate ? int32_t(BodyEmitter::splitElement(j, w)) : j;
        tIota = arith::ConstantOp::create(
            b, loc, DenseIntElementsAttr::get(VectorType::get({w}, i32), iota));
      }
      auto l2 = scf::ForOp::create(b, loc, nVec, n, Wt);
      OpBuilder::InsertionGuard g(b);
      b.setInsertionPoint(l2.getBody()->getTerminator());
      Value iv = l2.getInductionVar();
      Value mask = tailMask(b, loc, w, n, iv);
      BodyEmitter tailE{b, loc, w, ptrs, cs, cw};
      tailE.packHalves = true;
      tailE.splitBf16 = splitUpdate;
      tailE.nativeBf16 = isa.nativeBf16;
      tailE.x86Gather = 512;
      tailE.avx512 = true;
      tailE.storePtrs = outPtrs;
      tailE.loadMask = tailE.storeMask = mask;
      if (sr) {
        tailE.srKey = entry->getArgument(4);
        tailE.srIndex = arith::AddIOp::create(
            b, loc,
            vector::BroadcastOp::create(b, loc, VectorType::get({w}, i32),
                                        srIndexAt(iv)),
            tIota);
      }
      tailE.emit(body, iv);
    } else {
      auto l2 = scf::ForOp::create(b, loc, nVec, n, one);
      OpBuilder::InsertionGuard g(b);
      b.setInsertionPoint(l2.getBody()->getTerminator());
      if (sr)
        sclE.srIndex = srIndexAt(l2.getInductionVar());
      sclE.emit(body, l2.getInductionVar());
    }
    func::ReturnOp::create(b, loc);
    return fn;
  }
  // SUMSQ: lane l accumulates elements l, l + LANES, ...; the tail is one
  // masked iteration (absent lanes add +0.0, which changes no sum); then the
  // lanes are added in order (vector.reduction without reassociation is
  // LLVM's ordered reduction: ((0 + a0) + a1) + ...).
  //
  // When every load is bf16 the vectors are widened in split order
  // (BodyEmitter::splitBf16: lane j holds element splitElement(j), no 16-bit
  // shuffles), so accumulator lane j is abi.h's a[splitElement(j)]; the tail
  // mask is permuted the same way and one shuffle after the loop restores
  // abi.h's lane order before the ordered sum. The bits are the same; the
  // loop does about a third less shuffle-port work (docs/benchmarks/cpu.md).
  bool split = lanes % 2 == 0;
  body.walk([&](zk::LoadOp l) { split &= l.getType().isBF16(); });
  auto accTy = VectorType::get({lanes}, f64);
  Value accInit = arith::ConstantOp::create(
      b, loc, DenseElementsAttr::get(accTy, b.getF64FloatAttr(0.0)));
  auto accumulate = [&](BodyEmitter &e, Value iv, Value acc,
                        Value mask) -> Value {
    Value sq = e.emit(body, iv);
    if (mask && split) {
      SmallVector<int64_t> perm;
      for (int j = 0; j < lanes; ++j)
        perm.push_back(BodyEmitter::splitElement(j, lanes));
      mask = vector::ShuffleOp::create(e.b, loc, mask, mask, perm);
    }
    if (mask)
      sq = arith::SelectOp::create(
          e.b, loc, mask, sq,
          arith::ConstantOp::create(
              e.b, loc, DenseElementsAttr::get(accTy, e.b.getF64FloatAttr(0.0))));
    auto fm = sumsqOfNarrow ? e.accumulateFastmath() : arith::FastMathFlagsAttr();
    return arith::AddFOp::create(e.b, loc, acc, sq, fm);
  };
  auto l1 = scf::ForOp::create(
      b, loc, zero, nVec, W, ValueRange{accInit},
      [&](OpBuilder &lb, Location l, Value iv, ValueRange iter) {
        prefetchAhead(lb, l, iv);
        BodyEmitter e{lb, l, lanes, ptrs, cs, cv};
        e.packHalves = true;
        e.splitBf16 = split;
        scf::YieldOp::create(lb, l,
                             ValueRange{accumulate(e, iv, iter[0], Value())});
      });
  Value total = sumsqTailAndTotal(
      b, loc, lanes, split, accTy, l1.getResult(0), n, nVec,
      [&](Value acc, Value mask) {
        BodyEmitter e{b, loc, lanes, ptrs, cs, cv};
        e.packHalves = true;
        e.splitBf16 = split;
        e.loadMask = mask;
        return accumulate(e, nVec, acc, mask);
      });
  func::ReturnOp::create(b, loc, total);
  (void)one;
  return fn;
}

// SUMSQ on two chunks in one loop (abi.h "SUMSQ pairs"), AVX-512 variants:
//   void name_<isa>_x2(void *const *s0, int64_t n0, const float *c0,
//                      void *const *s1, int64_t n1, const float *c1,
//                      double *out)
// out[j] = the SUMSQ of chunk j, the same bits as the single kernel: each
// chunk has its own ZOPT_SUMSQ_LANES accumulators and sees its elements in
// the same order; the loop over both chunks' common full vectors keeps two
// read streams in flight per thread (one stream gets about half of the
// in-place stream's rate per byte: docs/benchmarks/cpu.md), then each
// chunk's rest, its masked tail and its ordered lane sum as in lowerKernel.
static func::FuncOp lowerSumsqPair(OpBuilder &mb, zk::KernelOp k,
                                   const IsaInfo &isa, int64_t numStates) {
  MLIRContext *ctx = k.getContext();
  Location loc = k.getLoc();
  auto ptrTy = LLVM::LLVMPointerType::get(ctx);
  Type i64 = IntegerType::get(ctx, 64), f64 = Float64Type::get(ctx),
       f32 = Float32Type::get(ctx);
  auto fnTy = FunctionType::get(
      ctx, {ptrTy, i64, ptrTy, ptrTy, i64, ptrTy, ptrTy}, TypeRange{});
  auto fn = func::FuncOp::create(
      mb, loc, (k.getSymName() + "_" + isa.name + "_x2").str(), fnTy);
  fn->setAttr("zopt.isa", StringAttr::get(ctx, isa.name));
  fn->setAttr("llvm.linkage",
              LLVM::LinkageAttr::get(ctx, LLVM::Linkage::External));
  Block *entry = fn.addEntryBlock();
  OpBuilder b = OpBuilder::atBlockEnd(entry);
  Block &body = k.getBody().front();
  const int lanes = ZOPT_SUMSQ_LANES;
  bool sumsqOfNarrow = false;
  body.walk([&](zk::AccumulateOp a) {
    sumsqOfNarrow = !a.getValue().getType().isF64();
  });
  bool split = true;
  body.walk([&](zk::LoadOp l) { split &= l.getType().isBF16(); });
  int64_t maxCoeff = -1;
  body.walk([&](zk::CoeffOp c) {
    maxCoeff = std::max<int64_t>(maxCoeff, c.getIndex());
  });
  Value W = arith::ConstantOp::create(b, loc, b.getI64IntegerAttr(lanes));
  Value zero = arith::ConstantOp::create(b, loc, b.getI64IntegerAttr(0));
  struct Side {
    SmallVector<Value> ptrs, cs, cv;
    SmallVector<std::pair<Value, int64_t>> streams;
    Value n, nVec;
  } side[2];
  for (int j = 0; j < 2; ++j) {
    Side &S = side[j];
    Value table = entry->getArgument(3 * j), coeffs = entry->getArgument(3 * j + 2);
    S.n = entry->getArgument(3 * j + 1);
    S.ptrs.assign(numStates, Value());
    auto in = [&](int64_t slot, int64_t bytes) {
      if (!S.ptrs[slot]) {
        S.ptrs[slot] = loadPtrAt(b, loc, table, slot, ptrTy, ptrTy);
        S.streams.push_back({S.ptrs[slot], bytes});
      }
    };
    body.walk([&](zk::LoadOp l) {
      Type t = l.getType();
      int64_t bytes = t.isF64() ? 8 : t.isF32() ? 4 : 2;
      if (auto h = l.getRemainderOf()) {
        in(*h, 2);
        bytes = 2;
      }
      in(l.getSlot(), bytes);
    });
    for (int64_t c = 0; c <= maxCoeff; ++c) {
      S.cs.push_back(loadPtrAt(b, loc, coeffs, c, f32, f32));
      S.cv.push_back(vector::BroadcastOp::create(
          b, loc, VectorType::get({lanes}, f32), S.cs.back()));
    }
    S.nVec = arith::SubIOp::create(b, loc, S.n,
                                   arith::RemSIOp::create(b, loc, S.n, W));
  }
  auto prefetchAhead = [&](OpBuilder &pb, Location l, const Side &S, Value iv) {
    Type i8 = pb.getI8Type();
    for (auto [base, bytes] : S.streams) {
      Value off = arith::MulIOp::create(
          pb, l, iv,
          arith::ConstantOp::create(pb, l, pb.getI64IntegerAttr(bytes)));
      for (int64_t o = 0; o < lanes * bytes; o += 64) {
        Value at = arith::AddIOp::create(
            pb, l, off,
            arith::ConstantOp::create(pb, l,
                                      pb.getI64IntegerAttr(kPrefetchBytes + o)));
        Value addr = LLVM::GEPOp::create(pb, l, base.getType(), i8, base,
                                         ValueRange{at});
        LLVM::Prefetch::create(pb, l, addr, /*rw=*/0, /*hint=*/3,
                               /*cache=*/1);
      }
    }
  };
  auto accTy = VectorType::get({lanes}, f64);
  Value accInit = arith::ConstantOp::create(
      b, loc, DenseElementsAttr::get(accTy, b.getF64FloatAttr(0.0)));
  auto accumulate = [&](OpBuilder &eb, Location l, const Side &S, Value iv,
                        Value acc, Value mask) -> Value {
    BodyEmitter e{eb, l, lanes, S.ptrs, S.cs, S.cv};
    e.packHalves = true;
    e.splitBf16 = split;
    e.loadMask = mask;
    Value sq = e.emit(body, iv);
    if (mask && split) {
      SmallVector<int64_t> perm;
      for (int j = 0; j < lanes; ++j)
        perm.push_back(BodyEmitter::splitElement(j, lanes));
      mask = vector::ShuffleOp::create(eb, l, mask, mask, perm);
    }
    if (mask)
      sq = arith::SelectOp::create(
          eb, l, mask, sq,
          arith::ConstantOp::create(
              eb, l, DenseElementsAttr::get(accTy, eb.getF64FloatAttr(0.0))));
    auto fm = sumsqOfNarrow ? e.accumulateFastmath() : arith::FastMathFlagsAttr();
    return arith::AddFOp::create(eb, l, acc, sq, fm);
  };
  // Both chunks' common full vectors, then each chunk's rest.
  Value common = arith::MinSIOp::create(b, loc, side[0].nVec, side[1].nVec);
  auto both = scf::ForOp::create(
      b, loc, zero, common, W, ValueRange{accInit, accInit},
      [&](OpBuilder &lb, Location l, Value iv, ValueRange iter) {
        prefetchAhead(lb, l, side[0], iv);
        prefetchAhead(lb, l, side[1], iv);
        Value a0 = accumulate(lb, l, side[0], iv, iter[0], Value());
        Value a1 = accumulate(lb, l, side[1], iv, iter[1], Value());
        scf::YieldOp::create(lb, l, ValueRange{a0, a1});
      });
  Value out = entry->getArgument(6);
  for (int j = 0; j < 2; ++j) {
    const Side &S = side[j];
    auto rest = scf::ForOp::create(
        b, loc, common, S.nVec, W, ValueRange{both.getResult(j)},
        [&](OpBuilder &lb, Location l, Value iv, ValueRange iter) {
          prefetchAhead(lb, l, S, iv);
          scf::YieldOp::create(
              lb, l, ValueRange{accumulate(lb, l, S, iv, iter[0], Value())});
        });
    Value total = sumsqTailAndTotal(
        b, loc, lanes, split, accTy, rest.getResult(0), S.n, S.nVec,
        [&](Value acc, Value mask) {
          return accumulate(b, loc, S, S.nVec, acc, mask);
        });
    Value at = LLVM::GEPOp::create(
        b, loc, ptrTy, f64, out,
        ValueRange{arith::ConstantOp::create(b, loc, b.getI64IntegerAttr(j))});
    LLVM::StoreOp::create(b, loc, total, at);
  }
  func::ReturnOp::create(b, loc);
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
  emitPrepareBody(
      b, loc, p,
      [&](int64_t i) { return loadPtrAt(b, loc, entry->getArgument(0), i, f64, f64); },
      [&](int64_t i) { return loadPtrAt(b, loc, entry->getArgument(1), i, f64, f64); },
      [&](int64_t i, Value v) {
        Value ptr = LLVM::GEPOp::create(b, loc, ptrTy, f32, entry->getArgument(2),
                                        ArrayRef<LLVM::GEPArg>{int32_t(i)});
        LLVM::StoreOp::create(b, loc, v, ptr);
      });
  func::ReturnOp::create(b, loc);
  return fn;
}

/// Byte offset of field `f` in abi.h's zopt_control.
static int64_t controlOffset(zk::ControlField f) {
  using F = zk::ControlField;
  switch (f) {
  case F::sumsq: return offsetof(zopt_control, sumsq);
  case F::max_norm: return offsetof(zopt_control, max_norm);
  case F::scale: return offsetof(zopt_control, scale);
  case F::growth_factor: return offsetof(zopt_control, growth_factor);
  case F::backoff_factor: return offsetof(zopt_control, backoff_factor);
  case F::min_scale: return offsetof(zopt_control, min_scale);
  case F::growth_interval: return offsetof(zopt_control, growth_interval);
  case F::good_steps: return offsetof(zopt_control, good_steps);
  case F::dynamic: return offsetof(zopt_control, dynamic);
  case F::norm: return offsetof(zopt_control, norm);
  case F::clip_coef: return offsetof(zopt_control, clip_coef);
  case F::new_scale: return offsetof(zopt_control, new_scale);
  case F::new_good_steps: return offsetof(zopt_control, new_good_steps);
  case F::skip: return offsetof(zopt_control, skip);
  case F::advance: return offsetof(zopt_control, advance);
  }
  llvm_unreachable("zopt_control field");
}
static_assert(sizeof(zopt_control) == 112, "zopt_control layout");

/// `void <name>(zopt_control *c)`: the zk.control body between loads of
/// its input fields and stores of its output fields (i1 fields are the
/// struct's uint32_t: nonzero / 0 or 1).
static FailureOr<func::FuncOp> lowerControl(OpBuilder &mb, zk::ControlOp c) {
  MLIRContext *ctx = c.getContext();
  Location loc = c.getLoc();
  auto ptrTy = LLVM::LLVMPointerType::get(ctx);
  auto fn = func::FuncOp::create(mb, loc, c.getSymName(),
                                 FunctionType::get(ctx, {ptrTy}, {}));
  fn->setAttr("zopt.isa", StringAttr::get(ctx, "none"));
  Block *entry = fn.addEntryBlock();
  OpBuilder b = OpBuilder::atBlockEnd(entry);
  Value io = entry->getArgument(0);
  Type i8 = b.getI8Type(), i32 = b.getI32Type();
  auto at = [&](zk::ControlField f) -> Value {
    return LLVM::GEPOp::create(b, loc, ptrTy, i8, io,
                               ArrayRef<LLVM::GEPArg>{int32_t(controlOffset(f))});
  };
  SmallVector<zk::ControlField> outputs;
  for (uint32_t f = 0; f <= uint32_t(zk::ControlField::advance); ++f)
    if (!zk::ControlOp::isInput(zk::ControlField(f)))
      outputs.push_back(zk::ControlField(f));
  LogicalResult ok = emitControlBody(
      b, loc, c, outputs,
      [&](zk::ControlField f) -> Value {
        Type t = zk::ControlOp::fieldType(ctx, f);
        if (!t.isInteger(1))
          return LLVM::LoadOp::create(b, loc, t, at(f));
        Value w = LLVM::LoadOp::create(b, loc, i32, at(f));
        return arith::CmpIOp::create(
            b, loc, arith::CmpIPredicate::ne, w,
            arith::ConstantOp::create(b, loc, b.getI32IntegerAttr(0)));
      },
      [&](zk::ControlField f, Value v) {
        if (v.getType().isInteger(1))
          v = arith::ExtUIOp::create(b, loc, i32, v);
        LLVM::StoreOp::create(b, loc, v, at(f));
      });
  if (failed(ok))
    return failure();
  func::ReturnOp::create(b, loc);
  return fn;
}

struct ConvertZKToCPU
    : public mlir::zopt::impl::ConvertZKToCPUBase<ConvertZKToCPU> {
  using Base::Base;
  void runOnOperation() override {
    ModuleOp m = getOperation();
    SmallVector<IsaInfo> variants;
    SmallVector<std::string> names(isas.begin(), isas.end());
    if (names.empty())
      names = {"avx512bf16", "avx512", "avx2"};
    for (const std::string &n : names) {
      auto info = lookupIsa(n);
      if (!info) {
        m.emitError("unknown ISA variant '")
            << n << "'; expected avx512bf16, avx512 or avx2";
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

    MLIRContext *ctx = &getContext();
    const int64_t numStates = d.getStateKinds().size();
    // The kernel-table entries (role, isa, symbol) of the CPU functions, in
    // the order the descriptor lists them (zopt-emit-descriptor).
    SmallVector<Attribute> entries;
    auto addKernel = [&](zopt_kernel_role role, zopt_isa isa, StringRef sym) {
      Type i32 = IntegerType::get(ctx, 32);
      entries.push_back(ArrayAttr::get(
          ctx, {IntegerAttr::get(i32, role), IntegerAttr::get(i32, isa),
                StringAttr::get(ctx, sym)}));
    };

    OpBuilder mb = OpBuilder::atBlockEnd(m.getBody());
    for (auto p : llvm::make_early_inc_range(m.getOps<zk::PrepareOp>())) {
      func::FuncOp f = lowerPrepare(mb, p);
      addKernel(ZOPT_KERNEL_PREPARE, ZOPT_ISA_NONE, f.getSymName());
      p.erase();
    }
    for (auto c : llvm::make_early_inc_range(m.getOps<zk::ControlOp>())) {
      FailureOr<func::FuncOp> f = lowerControl(mb, c);
      if (failed(f))
        return signalPassFailure();
      addKernel(ZOPT_KERNEL_CONTROL, ZOPT_ISA_NONE, f->getSymName());
      c.erase();
    }
    bool onlyNativeBf16 = llvm::all_of(
        variants, [](const IsaInfo &v) { return v.nativeBf16; });
    for (auto k : llvm::make_early_inc_range(m.getOps<zk::KernelOp>())) {
      bool bf16Update =
          k.getRole() == zk::KernelRole::update && storesBf16(k);
      for (const IsaInfo &isa : variants) {
        if (isa.nativeBf16 && !bf16Update && !onlyNativeBf16)
          continue; // would be identical to the avx512 variant
        func::FuncOp f = lowerKernel(mb, k, isa, numStates);
        addKernel(k.getRole() == zk::KernelRole::update ? ZOPT_KERNEL_UPDATE
                                                        : ZOPT_KERNEL_SUMSQ,
                  isa.code, f.getSymName());
        // Its pair entry (abi.h "SUMSQ pairs"): not in the kernel table;
        // the runtime finds it by name. AVX-512 only: on AVX2 two chunks'
        // 16 ymm accumulators would fill the register file.
        if (k.getRole() == zk::KernelRole::sumsq && isa.lanes == 16)
          lowerSumsqPair(mb, k, isa, numStates);
      }
      k.erase();
    }
    d.setCpuKernelsAttr(ArrayAttr::get(ctx, entries));
  }
};

} // namespace
