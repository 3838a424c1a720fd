//===- UpdateKernel.cpp - the UPDATE kernel of a GPU step ----------------===//
//
// <step>_update (GPUKernels.h): ONE persistent grid-stride launch over the
// chunk work list; the body is the shared BodyEmitter (lib/Conversion/
// ZKCommon) at 16 bytes per access of the narrowest state (4 x f32 or 8 x
// 16-bit lanes) plus a scalar head and tail; inactive tensors and skipped
// steps are left alone; stochastic rounding keyed as abi.h says.
//
//===----------------------------------------------------------------------===//
#include "KernelIR.h"

#include "../ZKCommon/BodyEmitter.h"

#include "mlir/Dialect/Vector/IR/VectorOps.h"

using namespace mlir;
using namespace mlir::zopt;
using namespace mlir::zopt::gpu_kernels;

void gpu_kernels::buildUpdateKernel(OpBuilder &gb, zk::KernelOp k,
                                    const Step &st) {
  OpBuilder::InsertionGuard guard(gb);
  Location loc = k.getLoc();
  MLIRContext *ctx = gb.getContext();
  Type ptr = LLVM::LLVMPointerType::get(ctx), i64 = gb.getI64Type();
  KernelInfo info = analyze(k);
  // (states, segs, chunks, num_chunks, coeffs, sg, active); stochastic
  // rounding (abi.h): the tensors' step t (tensor_t) and the seed follow.
  bool sr = false;
  k.getBody().walk([&](zk::StoreOp s) {
    sr |= s.getRounding() == ZOPT_ROUND_STOCHASTIC;
  });
  SmallVector<Type> args = {ptr, ptr, ptr, i64, ptr, ptr, ptr};
  if (sr)
    args.append({ptr, i64});
  auto fn = makeKernel(gb, loc, k.getSymName(), args, ZOPT_GPU_BLOCK);
  Block &entry = fn.getBody().front();
  Value states = entry.getArgument(0), segs = entry.getArgument(1),
        chunks = entry.getArgument(2), nchunks = entry.getArgument(3),
        coeffs = entry.getArgument(4), sg = entry.getArgument(5),
        active = entry.getArgument(6);
  OpBuilder b = OpBuilder::atBlockEnd(&entry);
  G g{b, loc};
  Block &body = k.getBody().front();
  Value sgGeneric = sg;
  active = g.toGlobal(active);
  states = g.toGlobal(states);
  segs = g.toGlobal(segs);
  chunks = g.toGlobal(chunks);
  coeffs = g.toGlobal(coeffs);
  sg = g.toGlobal(sg);

  // skip = sg ? sg->skip : 0
  Value sgNull = LLVM::ICmpOp::create(b, loc, LLVM::ICmpPredicate::eq, sgGeneric,
                                      LLVM::ZeroOp::create(b, loc, ptr));
  auto skipIf = scf::IfOp::create(
      b, loc, sgNull,
      [&](OpBuilder &tb, Location l) {
        scf::YieldOp::create(tb, l, ValueRange{g.i32(0)});
      },
      [&](OpBuilder &eb, Location l) {
        G ge{eb, l};
        Value v = ge.load(eb.getI32Type(), ge.gepc(eb.getI32Type(), sg, kSgSkip));
        scf::YieldOp::create(eb, l, ValueRange{v});
      });
  Value run = arith::CmpIOp::create(b, loc, arith::CmpIPredicate::eq,
                                    skipIf.getResult(0), g.i32(0));
  auto runIf = scf::IfOp::create(b, loc, run, /*withElse=*/false);
  b.setInsertionPoint(runIf.thenBlock()->getTerminator());
  auto chunkLoop = forChunks(g, nchunks);
  b.setInsertionPoint(chunkLoop.getBody()->getTerminator());
  Chunk ch = loadChunk(g, st, info, states, segs, chunks, coeffs,
                       chunkLoop.getInductionVar());
  // A tensor not updated this step (active[seg] == 0) is left as it is.
  Value isActive = arith::CmpIOp::create(
      b, loc, arith::CmpIPredicate::ne,
      g.load(b.getI8Type(), g.gep(b.getI8Type(), active, ch.seg)),
      arith::ConstantOp::create(b, loc, b.getI8IntegerAttr(0)));
  auto activeIf = scf::IfOp::create(b, loc, isActive, /*withElse=*/false);
  b.setInsertionPoint(activeIf.thenBlock()->getTerminator());
  Type i32 = b.getI32Type();
  Value srPartial;
  if (sr) {
    // Per chunk: its tensor's step t (tensor_t) and its tensor index.
    Value tensorT = g.toGlobal(entry.getArgument(7));
    Value tD = g.load(b.getF64Type(), g.gep(b.getF64Type(), tensorT, ch.seg));
    Value t = arith::FPToUIOp::create(b, loc, b.getI64Type(), tD);
    Value tensor = g.load(
        i32, g.gep(i32, segs, g.add(g.mul(ch.seg, g.i64(4)), g.i64(3))));
    srPartial = srKeyPartial(g, entry.getArgument(8), t, tensor);
  }
  // The key and i32 index of element i (a chunk, hence a vector, never
  // straddles a multiple of 2^32 elements: abi.h).
  auto setSr = [&](OpBuilder &ob, Location l, BodyEmitter &e, Value i) {
    if (!sr)
      return;
    G go{ob, l};
    Value hi = arith::TruncIOp::create(
        ob, l, i32, arith::ShRUIOp::create(ob, l, i, go.i64(32)));
    e.srKey = emitFmix32(ob, l, arith::XOrIOp::create(ob, l, srPartial, hi));
    Value lo = arith::TruncIOp::create(ob, l, i32, i);
    if (e.lanes == 1) {
      e.srIndex = lo;
      return;
    }
    SmallVector<int32_t> iota(e.lanes);
    for (int j = 0; j < e.lanes; ++j)
      iota[j] = j;
    auto vt = VectorType::get({e.lanes}, i32);
    e.srIndex = arith::AddIOp::create(
        ob, l, vector::BroadcastOp::create(ob, l, vt, lo),
        arith::ConstantOp::create(ob, l, DenseIntElementsAttr::get(vt, iota)));
  };
  forChunkElements(
      g, ch, info.lanes, {},
      [&](OpBuilder &vb, Location l, Value i, ValueRange) {
        BodyEmitter e{vb, l, info.lanes, ch.ptrs, ch.cs, ch.cv};
        e.vecAlign = 16;
        setSr(vb, l, e, i);
        e.emit(body, i);
        return SmallVector<Value>{};
      },
      [&](OpBuilder &sb, Location l, Value i, ValueRange) {
        BodyEmitter e{sb, l, 1, ch.ptrs, ch.cs, {}};
        setSr(sb, l, e, i);
        e.emit(body, i);
        return SmallVector<Value>{};
      });
  b.setInsertionPointToEnd(&entry);
  gpu::ReturnOp::create(b, loc);
}
