//===- FinishKernel.cpp - the FINISH kernel of a GPU step ----------------===//
//
// <step>_finish (GPUKernels.h): the step's zk.control evaluated again for
// the step counts and the loss scaler, which stay on the device, and 1/S
// in the globals table.
//
//===----------------------------------------------------------------------===//
#include "KernelIR.h"

#include "../ZKCommon/BodyEmitter.h"


using namespace mlir;
using namespace mlir::zopt;
using namespace mlir::zopt::gpu_kernels;

/// FINISH: the step's bookkeeping on the device (abi.h): step counts, the
/// dynamic loss scaler and 1/S in the globals table. Any grid
/// (ZOPT_FLAG_FINISH_GRID): every thread of the grid strides over the
/// per-tensor counts; block 0 alone does the per-group counts, thread 0 of
/// it the applied count and the scaler. (One block of 32 threads took
/// ~0.2 ms at 10,000 tensors on an H200: docs/benchmarks/gpu.md.)
LogicalResult gpu_kernels::buildFinishKernel(OpBuilder &gb, Location loc,
                                             const Step &st) {
  OpBuilder::InsertionGuard guard(gb);
  MLIRContext *ctx = gb.getContext();
  Type ptr = LLVM::LLVMPointerType::get(ctx), i64 = gb.getI64Type(),
       f64 = gb.getF64Type(), i32 = gb.getI32Type(), i8 = gb.getI8Type();
  // (globals, num_groups, sg, sc, tensor_t, active, num_rows)
  auto fn = makeKernel(gb, loc, st.name + "_finish",
                       {ptr, i64, ptr, ptr, ptr, ptr, i64}, ZOPT_GPU_FINISH_BLOCK);
  Block &entry = fn.getBody().front();
  Value globals = entry.getArgument(0), ngroups = entry.getArgument(1),
        sgGeneric = entry.getArgument(2), scGeneric = entry.getArgument(3),
        tensorT = entry.getArgument(4), active = entry.getArgument(5),
        nrows = entry.getArgument(6);
  OpBuilder b = OpBuilder::atBlockEnd(&entry);
  G g{b, loc};
  globals = g.toGlobal(globals);
  tensorT = g.toGlobal(tensorT);
  active = g.toGlobal(active);
  Value sg = g.toGlobal(sgGeneric), sc = g.toGlobal(scGeneric);
  auto isNull = [&](Value p) {
    return LLVM::ICmpOp::create(b, loc, LLVM::ICmpPredicate::eq, p,
                                LLVM::ZeroOp::create(b, loc, ptr));
  };
  auto notI1 = [&](Value v) {
    return arith::XOrIOp::create(b, loc, v,
                                 arith::ConstantOp::create(b, loc, b.getBoolAttr(true)));
  };
  Value tid = g.tid(), bdim = g.bdim();
  Value block0 = arith::CmpIOp::create(b, loc, arith::CmpIPredicate::eq, g.bid(), g.i64(0));
  Value first = arith::AndIOp::create(
      b, loc, arith::CmpIOp::create(b, loc, arith::CmpIPredicate::eq, tid, g.i64(0)), block0);
  auto isActive = [&](Value idx) {
    return arith::CmpIOp::create(b, loc, arith::CmpIPredicate::ne,
                                 g.load(i8, g.gep(i8, active, idx)),
                                 arith::ConstantOp::create(b, loc, b.getI8IntegerAttr(0)));
  };

  // The step's control (zk.control: the same IR as the host CONTROL) on
  // sumsq = sg ? sg->sumsq : 0 (no SUMSQ: never skipped) and the scaler.
  using F = zk::ControlField;
  Value sgNull = isNull(sgGeneric);
  auto sumsq = [&]() -> Value {
    auto r = scf::IfOp::create(
        b, loc, sgNull,
        [&](OpBuilder &tb, Location l) {
          scf::YieldOp::create(tb, l, ValueRange{G{tb, l}.f64(0.0)});
        },
        [&](OpBuilder &eb, Location l) {
          G ge{eb, l};
          scf::YieldOp::create(
              eb, l, ValueRange{ge.load(f64, ge.gepc(f64, sg, kSgSumsq))});
        });
    return r.getResult(0);
  };
  // max_norm = sg ? sg->max_norm (the runtime's: zopt_optimizer_set_max_norm)
  // : the compiled one (no SUMSQ: no clipping either).
  auto maxNorm = [&]() -> Value {
    auto r = scf::IfOp::create(
        b, loc, sgNull,
        [&](OpBuilder &tb, Location l) {
          scf::YieldOp::create(tb, l, ValueRange{G{tb, l}.f64(st.maxNorm)});
        },
        [&](OpBuilder &eb, Location l) {
          G ge{eb, l};
          scf::YieldOp::create(
              eb, l, ValueRange{ge.load(f64, ge.gepc(f64, sg, kSgMaxNorm))});
        });
    return r.getResult(0);
  };
  Value applied;
  if (failed(emitControlBody(
          b, loc, st.control, {F::advance},
          [&](F f) -> Value {
            if (f == F::sumsq)
              return sumsq();
            if (f == F::max_norm)
              return maxNorm();
            return Value(); // counts do not depend on the scaler
          },
          [&](F, Value v) { applied = v; })))
    return failure();
  // When it advances: every updated tensor's t (tensor_t), the grid's
  // threads striding over them, and every group with an updated tensor
  // (active[num_rows + g]) its STEP global, block 0's threads striding over
  // them; thread 0 of block 0 counts the step.
  auto stepIf = scf::IfOp::create(b, loc, applied, /*withElse=*/false);
  {
    OpBuilder::InsertionGuard ig(b);
    b.setInsertionPoint(stepIf.thenBlock()->getTerminator());
    auto rows = scf::ForOp::create(b, loc, g.add(g.mul(g.bid(), bdim), tid), nrows,
                                   g.mul(g.gdim(), bdim));
    {
      OpBuilder::InsertionGuard lg(b);
      b.setInsertionPoint(rows.getBody()->getTerminator());
      Value r = rows.getInductionVar();
      auto upd = scf::IfOp::create(b, loc, isActive(r), /*withElse=*/false);
      b.setInsertionPoint(upd.thenBlock()->getTerminator());
      Value p = g.gep(f64, tensorT, r);
      LLVM::StoreOp::create(
          b, loc, arith::AddFOp::create(b, loc, g.load(f64, p), g.f64(1.0)), p);
    }
    auto inBlock0 = scf::IfOp::create(b, loc, block0, /*withElse=*/false);
    OpBuilder::InsertionGuard bg(b);
    b.setInsertionPoint(inBlock0.thenBlock()->getTerminator());
    auto groups = scf::ForOp::create(b, loc, tid, ngroups, bdim);
    {
      OpBuilder::InsertionGuard lg(b);
      b.setInsertionPoint(groups.getBody()->getTerminator());
      Value gi = groups.getInductionVar();
      auto upd = scf::IfOp::create(b, loc, isActive(g.add(nrows, gi)), /*withElse=*/false);
      b.setInsertionPoint(upd.thenBlock()->getTerminator());
      Value p = g.gep(f64, globals,
                      g.add(g.mul(gi, g.i64(ZOPT_NUM_GLOBALS)), g.i64(ZOPT_GLOBAL_STEP)));
      LLVM::StoreOp::create(
          b, loc, arith::AddFOp::create(b, loc, g.load(f64, p), g.f64(1.0)), p);
    }
    auto cnt = scf::IfOp::create(b, loc, arith::AndIOp::create(b, loc, first, notI1(sgNull)),
                                 /*withElse=*/false);
    b.setInsertionPoint(cnt.thenBlock()->getTerminator());
    Value p = g.gepc(i32, sg, kSgApplied);
    LLVM::StoreOp::create(b, loc, g.add(g.load(i32, p), g.i32(1)), p);
  }

  if (st.flags & ZOPT_FLAG_LOSS_SCALE) {
    // Block 0 only, and sc is the same pointer for every thread: a branch
    // uniform over the block (the barrier inside is reached by all of its
    // threads or none).
    auto scIf = scf::IfOp::create(
        b, loc, arith::AndIOp::create(b, loc, block0, notI1(isNull(scGeneric))),
        /*withElse=*/false);
    b.setInsertionPoint(scIf.thenBlock()->getTerminator());
    auto fld = [&](Type t, int64_t i) { return g.gepc(t, sc, i); };
    auto t0 = scf::IfOp::create(b, loc, first, /*withElse=*/false);
    {
      OpBuilder::InsertionGuard ig(b);
      b.setInsertionPoint(t0.thenBlock()->getTerminator());
      LLVM::StoreOp::create(b, loc, g.load(f64, fld(f64, kScScale)),
                            fld(f64, kScLast));
      Value newScale, newGood;
      if (failed(emitControlBody(
              b, loc, st.control, {F::new_scale, F::new_good_steps},
              [&](F f) -> Value {
                switch (f) {
                case F::sumsq: return sumsq();
                case F::max_norm: return maxNorm();
                case F::scale: return g.load(f64, fld(f64, kScScale));
                case F::growth_factor: return g.load(f64, fld(f64, kScGrowth));
                case F::backoff_factor: return g.load(f64, fld(f64, kScBackoff));
                case F::min_scale: return g.load(f64, fld(f64, kScMin));
                case F::growth_interval: return g.load(i64, fld(i64, kScInterval));
                case F::good_steps: return g.load(i64, fld(i64, kScGood));
                case F::dynamic:
                  return arith::CmpIOp::create(b, loc, arith::CmpIPredicate::ne,
                                               g.load(i32, fld(i32, kScDynamic)),
                                               g.i32(0));
                default: return Value();
                }
              },
              [&](F f, Value v) { (f == F::new_scale ? newScale : newGood) = v; })))
        return failure();
      LLVM::StoreOp::create(b, loc, newScale, fld(f64, kScScale));
      LLVM::StoreOp::create(b, loc, newGood, fld(i64, kScGood));
    }
    gpu::BarrierOp::create(b, loc);
    // GRAD_SCALE = 1 / (S * D) (abi.h), with each group's sign kept: a
    // maximizing group's (ZOPT_GROUP_MAXIMIZE) is negative, as the host
    // wrote it.
    Value inv = arith::DivFOp::create(
        b, loc, g.f64(1.0),
        arith::MulFOp::create(b, loc, g.load(f64, fld(f64, kScScale)),
                              g.load(f64, fld(f64, kScDivisor))));
    auto loop = scf::ForOp::create(b, loc, tid, ngroups, bdim);
    b.setInsertionPoint(loop.getBody()->getTerminator());
    Value at = g.gep(f64, globals,
                     g.add(g.mul(loop.getInductionVar(), g.i64(ZOPT_NUM_GLOBALS)),
                           g.i64(ZOPT_GLOBAL_GRAD_SCALE)));
    Value negative = arith::CmpFOp::create(b, loc, arith::CmpFPredicate::OLT,
                                           g.load(f64, at), g.f64(0.0));
    Value signedInv = arith::SelectOp::create(
        b, loc, negative, arith::NegFOp::create(b, loc, inv), inv);
    LLVM::StoreOp::create(b, loc, signedInv, at);
  }
  b.setInsertionPointToEnd(&entry);
  gpu::ReturnOp::create(b, loc);
  return success();
}
