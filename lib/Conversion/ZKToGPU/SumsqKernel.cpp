//===- SumsqKernel.cpp - the SUMSQ kernel of a GPU step ------------------===//
//
// <step>_sumsq (GPUKernels.h): a two-stage f64 sum of squares whose last
// block evaluates the step's zk.control (norm, clip coefficient, skip; the
// runtime's max_norm from the step globals) on the device and recomputes
// the coefficients with the clip coefficient.
//
//===----------------------------------------------------------------------===//
#include "KernelIR.h"

#include "../ZKCommon/BodyEmitter.h"

#include "mlir/Dialect/MemRef/IR/MemRef.h"
#include "mlir/Dialect/LLVMIR/NVVMDialect.h"

using namespace mlir;
using namespace mlir::zopt;
using namespace mlir::zopt::gpu_kernels;

LogicalResult gpu_kernels::buildSumsqKernel(OpBuilder &gb, zk::KernelOp k,
                                            const Step &st) {
  OpBuilder::InsertionGuard guard(gb);
  Location loc = k.getLoc();
  MLIRContext *ctx = gb.getContext();
  Type ptr = LLVM::LLVMPointerType::get(ctx), i64 = gb.getI64Type(),
       f64 = gb.getF64Type(), i32 = gb.getI32Type();
  KernelInfo info = analyze(k);
  auto wg = gpu::AddressSpaceAttr::get(ctx, gpu::AddressSpace::Workgroup);
  auto redTy = MemRefType::get({ZOPT_GPU_BLOCK}, f64, AffineMap(), wg);
  auto flagTy = MemRefType::get({1}, i32, AffineMap(), wg);
  // (states, segs, chunks, num_chunks, coeffs, partials, sg, hypers,
  //  globals, num_rows, tensor_t, active)
  auto fn = makeKernel(gb, loc, k.getSymName(),
                       {ptr, ptr, ptr, i64, ptr, ptr, ptr, ptr, ptr, i64, ptr, ptr},
                       ZOPT_GPU_BLOCK, {redTy, flagTy});
  Block &entry = fn.getBody().front();
  Value states = entry.getArgument(0), segs = entry.getArgument(1),
        chunks = entry.getArgument(2), nchunks = entry.getArgument(3),
        coeffs = entry.getArgument(4), partials = entry.getArgument(5),
        sg = entry.getArgument(6), hypers = entry.getArgument(7),
        globals = entry.getArgument(8), nrows = entry.getArgument(9),
        tensorT = entry.getArgument(10), active = entry.getArgument(11);
  Value red = fn.getWorkgroupAttributions()[0],
        flag = fn.getWorkgroupAttributions()[1];
  OpBuilder b = OpBuilder::atBlockEnd(&entry);
  G g{b, loc};
  Block &body = k.getBody().front();
  for (Value *v : {&states, &segs, &chunks, &coeffs, &partials, &sg, &hypers, &globals, &tensorT, &active})
    *v = g.toGlobal(*v);

  // Stage 1: this thread's sum of squares over its elements of the block's
  // chunks, in f64 (a fixed order for a fixed grid and work list).
  auto chunkLoop = scf::ForOp::create(
      b, loc, g.bid(), nchunks, g.gdim(), ValueRange{g.f64(0.0)},
      [&](OpBuilder &cb, Location cl, Value c, ValueRange iter) {
        G gc{cb, cl};
        Chunk ch = loadChunk(gc, st, info, states, segs, chunks, coeffs, c);
        // A tensor not updated this step adds nothing (+0.0 changes no sum).
        Value isActive = arith::CmpIOp::create(
            cb, cl, arith::CmpIPredicate::ne,
            gc.load(cb.getI8Type(), gc.gep(cb.getI8Type(), active, ch.seg)),
            arith::ConstantOp::create(cb, cl, cb.getI8IntegerAttr(0)));
        auto activeIf = scf::IfOp::create(cb, cl, TypeRange{f64}, isActive,
                                          /*withElse=*/true);
        scf::YieldOp::create(cb, cl, activeIf.getResults());
        OpBuilder::InsertionGuard aig(cb);
        cb.setInsertionPointToStart(&activeIf.getElseRegion().front());
        scf::YieldOp::create(cb, cl, iter);
        cb.setInsertionPointToStart(&activeIf.getThenRegion().front());
        ValueRange r = forChunkElements(
            gc, ch, info.lanes, iter,
            [&](OpBuilder &vb, Location l, Value i, ValueRange acc) {
              BodyEmitter e{vb, l, info.lanes, ch.ptrs, ch.cs, ch.cv};
              e.vecAlign = 16;
              Value sq = e.emit(body, i);
              Value a = acc[0];
              G gv{vb, l};
              for (int j = 0; j < info.lanes; ++j)
                a = arith::AddFOp::create(
                    vb, l, a, LLVM::ExtractElementOp::create(vb, l, sq, gv.i32(j)));
              return SmallVector<Value>{a};
            },
            [&](OpBuilder &sb, Location l, Value i, ValueRange acc) {
              BodyEmitter e{sb, l, 1, ch.ptrs, ch.cs, {}};
              Value sq = e.emit(body, i);
              return SmallVector<Value>{arith::AddFOp::create(sb, l, acc[0], sq)};
            });
        scf::YieldOp::create(cb, cl, r);
      });
  Value total = chunkLoop.getResult(0);

  // Block tree reduction in shared memory (blockDim.x == ZOPT_GPU_BLOCK).
  Value tx = gpu::ThreadIdOp::create(b, loc, gpu::Dimension::x);
  blockTreeReduce(b, loc, red, tx, total,
                  [](OpBuilder &ob, Location l, Value x, Value y) -> Value {
                    return arith::AddFOp::create(ob, l, x, y);
                  });

  // Stage 2: thread 0 publishes the partial; the last block finishes.
  Value zeroIdx = arith::ConstantIndexOp::create(b, loc, 0);
  Value isT0 = arith::CmpIOp::create(b, loc, arith::CmpIPredicate::eq, tx, zeroIdx);
  auto t0 = scf::IfOp::create(b, loc, isT0, false);
  {
    OpBuilder::InsertionGuard ig(b);
    b.setInsertionPoint(t0.thenBlock()->getTerminator());
    Value total = memref::LoadOp::create(b, loc, red, ValueRange{zeroIdx});
    LLVM::StoreOp::create(b, loc, total, g.gep(f64, partials, g.bid()));
    // Release: the partial must be visible device-wide before the counter
    // says this block is done. The atomic below is written acq_rel, but
    // NVPTX lowers it to a relaxed `atom.global.add.u32` (no .acq_rel
    // qualifier, no fence): this membar.gl is what orders the store before
    // it, as __threadfence() does in CUDA's threadFenceReduction sample.
    // Do not remove it (nor the one after the atomic in the last block).
    NVVM::MembarOp::create(b, loc, NVVM::MemScopeKind::GPU);
    Value old = LLVM::AtomicRMWOp::create(
        b, loc, LLVM::AtomicBinOp::add, g.gepc(i32, sg, kSgDone), g.i32(1),
        LLVM::AtomicOrdering::acq_rel);
    Value last = arith::CmpIOp::create(
        b, loc, arith::CmpIPredicate::eq, old,
        arith::TruncIOp::create(b, loc, i32,
                                arith::SubIOp::create(b, loc, g.gdim(), g.i64(1))));
    memref::StoreOp::create(b, loc, arith::ExtUIOp::create(b, loc, i32, last),
                            flag, ValueRange{zeroIdx});
  }
  gpu::BarrierOp::create(b, loc);
  Value isLast = arith::CmpIOp::create(
      b, loc, arith::CmpIPredicate::ne,
      memref::LoadOp::create(b, loc, flag, ValueRange{zeroIdx}), g.i32(0));
  auto lastIf = scf::IfOp::create(b, loc, isLast, false);
  b.setInsertionPoint(lastIf.thenBlock()->getTerminator());
  auto fin = scf::IfOp::create(b, loc, isT0, false);
  {
    OpBuilder::InsertionGuard ig(b);
    b.setInsertionPoint(fin.thenBlock()->getTerminator());
    // Acquire: the last block saw every other block's increment (relaxed,
    // see above); this membar.gl orders its reads of the partials after it,
    // and the reads are volatile (ld.volatile: not served from a stale L1).
    NVVM::MembarOp::create(b, loc, NVVM::MemScopeKind::GPU);
    auto sum = scf::ForOp::create(
        b, loc, g.i64(0), g.gdim(), g.i64(1), ValueRange{g.f64(0.0)},
        [&](OpBuilder &lb, Location l, Value i, ValueRange acc) {
          G gl{lb, l};
          Value p = LLVM::LoadOp::create(lb, l, f64, gl.gep(f64, partials, i),
                                         /*alignment=*/8, /*isVolatile=*/true);
          scf::YieldOp::create(lb, l,
                               ValueRange{arith::AddFOp::create(lb, l, acc[0], p)});
        });
    Value s = sum.getResult(0);
    // The step's control (zk.control: the same IR as the host CONTROL) on
    // this sum, with the max_norm the runtime wrote into the step globals
    // (the compiled one unless zopt_optimizer_set_max_norm changed it):
    // norm, clip coefficient, skip.
    using F = zk::ControlField;
    Value norm, clip, skip1;
    if (failed(emitControlBody(
            b, loc, st.control, {F::norm, F::clip_coef, F::skip},
            [&](F f) -> Value {
              if (f == F::sumsq)
                return s;
              if (f == F::max_norm)
                return g.load(f64, g.gepc(f64, sg, kSgMaxNorm));
              return Value(); // the scaler is FINISH's
            },
            [&](F f, Value v) {
              (f == F::norm ? norm : f == F::clip_coef ? clip : skip1) = v;
            })))
      return failure();
    Value nonfinite = arith::ExtUIOp::create(b, loc, i32, skip1);
    Value skip = nonfinite;
    LLVM::StoreOp::create(b, loc, s, g.gepc(f64, sg, kSgSumsq));
    LLVM::StoreOp::create(b, loc, norm, g.gepc(f64, sg, kSgNorm));
    LLVM::StoreOp::create(b, loc, clip, g.gepc(f64, sg, kSgClip));
    LLVM::StoreOp::create(b, loc, nonfinite, g.gepc(i32, sg, kSgNonfinite));
    LLVM::StoreOp::create(b, loc, skip, g.gepc(i32, sg, kSgSkip));
    LLVM::StoreOp::create(b, loc, g.i32(0), g.gepc(i32, sg, kSgDone));
    memref::StoreOp::create(b, loc, clip, red, ValueRange{zeroIdx});
  }
  gpu::BarrierOp::create(b, loc);
  // The coefficient table again, with the device's clip coefficient.
  Value clip = memref::LoadOp::create(b, loc, red, ValueRange{zeroIdx});
  auto gl = scf::ForOp::create(b, loc, g.toI64(tx), nrows, g.bdim());
  {
    OpBuilder::InsertionGuard ig(b);
    b.setInsertionPoint(gl.getBody()->getTerminator());
    emitPrepareForRow(g, st, hypers, globals, segs, tensorT, coeffs,
                      gl.getInductionVar(), clip);
  }
  b.setInsertionPointToEnd(&entry);
  gpu::ReturnOp::create(b, loc);
  return success();
}
