//===- BodyEmitter.h - zk kernel bodies at a vector width -------*- C++ -*-===//
//
// Shared by the CPU and GPU code generators: clones the per-element body of a
// zk.kernel at `lanes` lanes (1: scalar). bf16 is carried as the f32 it
// exactly widens to; narrowing to bf16 rounds to nearest even in integer
// arithmetic (bit-exact, NaN-preserving), so both devices round identically.
// Also the f64 zk.prepare body, with the sources of hyperparameters and
// globals and the sink of coefficients left to the caller.
//
//===----------------------------------------------------------------------===//
#ifndef ZOPT_LIB_TRANSFORMS_BODYEMITTER_H
#define ZOPT_LIB_TRANSFORMS_BODYEMITTER_H

#include "mlir/Dialect/Arith/IR/Arith.h"
#include "mlir/Dialect/LLVMIR/LLVMDialect.h"
#include "mlir/IR/Builders.h"
#include "mlir/IR/IRMapping.h"
#include "zopt/Dialect/Kernel/IR/KernelDialect.h"

#include <functional>

namespace mlir::zopt {

/// Builds code for one kernel body at one width.
struct BodyEmitter {
  OpBuilder &b;
  Location loc;
  int lanes; // 1: scalar
  ArrayRef<Value> statePtrs;  // indexed by slot (null when unused)
  ArrayRef<Value> coeffScalars;
  SmallVector<Value> coeffVecs;
  /// Alignment in bytes of vector loads/stores (0: the element's own, as
  /// for unaligned CPU pointers). Scalar accesses always use the element's.
  int vecAlign = 0;

  int64_t alignFor(int elemAlign) {
    return (lanes > 1 && vecAlign) ? vecAlign : elemAlign;
  }

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
    Type ptrTy = statePtrs[slot].getType(); // keeps the address space
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
              LLVM::LoadOp::create(b, loc, vec(b.getI16Type()), p, alignFor(2)));
        } else {
          Value p = elemPtr(l.getSlot(), t, i);
          r = LLVM::LoadOp::create(b, loc, vec(t), p,
                                   alignFor(t.isF32() ? 4 : 2));
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
                              alignFor(align));
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
          st.attributes.set("fastmath",
                            arith::FastMathFlagsAttr::get(
                                b.getContext(), arith::FastMathFlags::contract));
        Operation *n = b.create(st);
        for (auto [o, r] : llvm::zip(op.getResults(), n->getResults()))
          map.map(o, r);
      }
    }
    return acc;
  }
};

/// Emits the f64 body of `p` at `b`: `hyper(i)` / `global(i)` give the f64
/// values of zk.hyper / zk.global, `setCoeff(i, v)` receives each f32
/// coefficient.
inline void emitPrepareBody(OpBuilder &b, Location loc, zk::PrepareOp p,
                            llvm::function_ref<Value(int64_t)> hyper,
                            llvm::function_ref<Value(int64_t)> global,
                            llvm::function_ref<void(int64_t, Value)> setCoeff) {
  IRMapping map;
  for (Operation &op : p.getBody().front()) {
    if (auto h = dyn_cast<zk::HyperOp>(op)) {
      map.map(h.getResult(), hyper(h.getIndex()));
    } else if (auto g = dyn_cast<zk::GlobalOp>(op)) {
      map.map(g.getResult(), global(g.getIndex()));
    } else if (auto s = dyn_cast<zk::SetCoeffOp>(op)) {
      Value v = map.lookup(s.getValue());
      if (!v.getType().isF32())
        v = arith::TruncFOp::create(b, loc, b.getF32Type(), v);
      setCoeff(s.getIndex(), v);
    } else {
      b.clone(op, map);
    }
  }
}

/// Loads element `idx` of type `result` from `base` viewed as `elem`s.
inline Value loadPtrAt(OpBuilder &b, Location loc, Value base, int64_t idx,
                       Type elem, Type result) {
  auto ptrTy = LLVM::LLVMPointerType::get(b.getContext());
  Value p = LLVM::GEPOp::create(b, loc, ptrTy, elem, base,
                                ArrayRef<LLVM::GEPArg>{int32_t(idx)});
  return LLVM::LoadOp::create(b, loc, result, p);
}

} // namespace mlir::zopt

#endif
