//===- Q8Blocks.cpp - the block loop of CPU UPDATE kernels with q8 --------===//
//
// Q8Blocks.h says what it emits; docs/NUMERICS.md §10 the format.
//
//===----------------------------------------------------------------------===//
#include "Q8Blocks.h"

#include "mlir/Dialect/Math/IR/Math.h"

using namespace mlir;
using namespace mlir::zopt;

/// An UPDATE kernel with q8 moments (abi.h "q8 moments"): one pass over
/// blocks of ZOPT_Q8_BLOCK elements (the call starts at a block boundary).
/// Per block: each q8 moment's absmax is loaded; the body runs over the
/// block's elements (vectors of `lanes`, then single elements), decoding
/// the codes and writing each new f32 moment into a block buffer on the
/// stack (L1) while its |max| is reduced in registers; then the block's new
/// absmax is stored and the buffer encoded into codes. `beforeVec` /
/// `beforeScalar` run at the top of each body iteration (prefetch, the
/// stochastic-rounding index).
void mlir::zopt::emitQ8Blocks(OpBuilder &b, Location loc, func::FuncOp fn,
                               Block &body, Value inTable, Value outTable,
                               Value n, int lanes, BodyEmitter &vecE,
                               BodyEmitter &sclE,
                               function_ref<void(Value)> beforeVec,
                               function_ref<void(Value)> beforeScalar) {
  MLIRContext *ctx = b.getContext();
  auto ptrTy = LLVM::LLVMPointerType::get(ctx);
  Type f32 = b.getF32Type(), i8 = b.getI8Type();
  struct Q8 {
    int64_t slot, absSlot;
    bool isUnsigned;
    Value absIn, absOut, buf;
  };
  SmallVector<Q8> qs;
  auto entry = [&](int64_t slot, int64_t absSlot, bool uns) -> Q8 & {
    for (Q8 &q : qs)
      if (q.slot == slot)
        return q;
    qs.push_back({slot, absSlot, uns, Value(), Value(), Value()});
    return qs.back();
  };
  auto cst = [&](int64_t v) -> Value {
    return arith::ConstantOp::create(b, loc, b.getI64IntegerAttr(v));
  };
  body.walk([&](zk::LoadOp l) {
    if (auto a = l.getAbsmax()) {
      Q8 &q = entry(l.getSlot(), *a, l.getQ8Unsigned());
      q.absIn = loadPtrAt(b, loc, inTable, *a, ptrTy, ptrTy);
    }
  });
  SmallVector<int64_t> stored; // indices into qs, in store order
  body.walk([&](zk::StoreOp s) {
    if (auto a = s.getAbsmax()) {
      Q8 &q = entry(s.getSlot(), *a, s.getQ8Unsigned());
      q.absOut = loadPtrAt(b, loc, outTable, *a, ptrTy, ptrTy);
      q.buf = LLVM::AllocaOp::create(b, loc, ptrTy, f32, cst(ZOPT_Q8_BLOCK),
                                     /*alignment=*/64);
      stored.push_back(&q - qs.data());
    }
  });
  for (BodyEmitter *e : {&vecE, &sclE})
    for (int t = 0; t < 6; ++t)
      e->q8Tables[t] = q8TableAddress(b, loc, fn->getParentOp(), Q8Table(t));
  const Value B = cst(ZOPT_Q8_BLOCK), W = cst(lanes), zero = cst(0),
              one = cst(1);
  Value nBlocks = arith::DivSIOp::create(
      b, loc, arith::AddIOp::create(b, loc, n, cst(ZOPT_Q8_BLOCK - 1)), B);
  auto vecTy = VectorType::get({lanes}, f32);
  Value zeroVec = arith::ConstantOp::create(
      b, loc, DenseElementsAttr::get(vecTy, b.getF32FloatAttr(0)));
  auto blocks = scf::ForOp::create(b, loc, zero, nBlocks, one);
  OpBuilder::InsertionGuard guard(b);
  b.setInsertionPoint(blocks.getBody()->getTerminator());
  Value blk = blocks.getInductionVar();
  Value b0 = arith::MulIOp::create(b, loc, blk, B);
  Value end = arith::MinSIOp::create(
      b, loc, arith::AddIOp::create(b, loc, b0, B), n);
  Value len = arith::SubIOp::create(b, loc, end, b0);
  Value lenVec = arith::SubIOp::create(b, loc, len,
                                       arith::RemSIOp::create(b, loc, len, W));
  Value vecEnd = arith::AddIOp::create(b, loc, b0, lenVec);
  for (BodyEmitter *e : {&vecE, &sclE}) {
    e->q8Base = b0;
    for (Q8 &q : qs) {
      if (q.absIn)
        e->q8Absmax[q.slot] = LLVM::LoadOp::create(
            b, loc, f32,
            LLVM::GEPOp::create(b, loc, ptrTy, f32, q.absIn, ValueRange{blk}),
            4);
      if (q.buf)
        e->q8Buf[q.slot] = q.buf;
    }
  }
  // The new moments' |max|: NaN-propagating (a NaN moment makes the
  // block's absmax NaN).
  auto maxOf = [&](BodyEmitter &e, ValueRange acc) {
    SmallVector<Value> next;
    for (auto [k, qi] : llvm::enumerate(stored)) {
      Value v;
      for (auto &[slot, val] : e.q8Stored)
        if (slot == qs[qi].slot)
          v = val;
      next.push_back(arith::MaximumFOp::create(
          b, loc, acc[k], math::AbsFOp::create(b, loc, v)));
    }
    return next;
  };
  SmallVector<Value> init(stored.size(), zeroVec);
  // Without iter_args scf.for has its terminator already.
  auto fill = [&](scf::ForOp l, BodyEmitter &e, function_ref<void(Value)> pre) {
    OpBuilder::InsertionGuard g(b);
    if (stored.empty())
      b.setInsertionPoint(l.getBody()->getTerminator());
    else
      b.setInsertionPointToStart(l.getBody());
    pre(l.getInductionVar());
    e.q8Stored.clear();
    e.emit(body, l.getInductionVar());
    if (!stored.empty())
      scf::YieldOp::create(b, loc, maxOf(e, l.getRegionIterArgs()));
  };
  auto l1 = scf::ForOp::create(b, loc, b0, vecEnd, W, init);
  fill(l1, vecE, beforeVec);
  SmallVector<Value> red;
  for (Value v : l1.getResults())
    red.push_back(vector::ReductionOp::create(
        b, loc, vector::CombiningKind::MAXIMUMF, v));
  auto l2 = scf::ForOp::create(b, loc, vecEnd, end, one, red);
  fill(l2, sclE, beforeScalar);
  // The block's new absmax, then its codes from the buffer.
  for (auto [k, qi] : llvm::enumerate(stored)) {
    Q8 &q = qs[qi];
    Value a = l2.getResult(k);
    LLVM::StoreOp::create(
        b, loc, a,
        LLVM::GEPOp::create(b, loc, ptrTy, f32, q.absOut, ValueRange{blk}), 4);
    Value codesOut = loadPtrAt(b, loc, outTable, q.slot, ptrTy, ptrTy);
    auto encodeAt = [&](BodyEmitter &e, Value j) {
      Type t = e.vec(f32);
      Value x = LLVM::LoadOp::create(
          b, loc, t,
          LLVM::GEPOp::create(b, loc, ptrTy, f32, q.buf, ValueRange{j}), 4);
      Value c = e.q8Encode(x, a, q.isUnsigned);
      LLVM::StoreOp::create(
          b, loc, c,
          LLVM::GEPOp::create(b, loc, ptrTy, i8, codesOut,
                              ValueRange{arith::AddIOp::create(b, loc, b0, j)}),
          1);
    };
    auto e1 = scf::ForOp::create(b, loc, zero, lenVec, W);
    {
      OpBuilder::InsertionGuard g(b);
      b.setInsertionPoint(e1.getBody()->getTerminator());
      encodeAt(vecE, e1.getInductionVar());
    }
    auto e2 = scf::ForOp::create(b, loc, lenVec, len, one);
    {
      OpBuilder::InsertionGuard g(b);
      b.setInsertionPoint(e2.getBody()->getTerminator());
      encodeAt(sclE, e2.getInductionVar());
    }
  }
}

