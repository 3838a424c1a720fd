//===- PrepareKernel.cpp - the PREPARE kernel of a GPU step --------------===//
//
// <step>_prepare_gpu (GPUKernels.h): the step's zk.prepare body, one row of
// the coefficient table per segment (tensor), one thread per row.
//
//===----------------------------------------------------------------------===//
#include "KernelIR.h"

#include "../ZKCommon/BodyEmitter.h"


using namespace mlir;
using namespace mlir::zopt;
using namespace mlir::zopt::gpu_kernels;

void gpu_kernels::buildPrepareKernel(OpBuilder &gb, Location loc,
                                     const Step &st) {
  OpBuilder::InsertionGuard guard(gb);
  MLIRContext *ctx = gb.getContext();
  Type ptr = LLVM::LLVMPointerType::get(ctx), i64 = gb.getI64Type();
  // (hypers, globals, segs, tensor_t, num_rows, coeffs)
  auto fn = makeKernel(gb, loc, st.name + "_prepare_gpu",
                       {ptr, ptr, ptr, ptr, i64, ptr}, ZOPT_GPU_PREPARE_BLOCK);
  Block &entry = fn.getBody().front();
  OpBuilder b = OpBuilder::atBlockEnd(&entry);
  G g{b, loc};
  auto [gtid, nthr] = g.grid();
  auto loop = scf::ForOp::create(b, loc, gtid, entry.getArgument(4), nthr);
  {
    OpBuilder::InsertionGuard ig(b);
    b.setInsertionPoint(loop.getBody()->getTerminator());
    emitPrepareForRow(g, st, g.toGlobal(entry.getArgument(0)),
                      g.toGlobal(entry.getArgument(1)),
                      g.toGlobal(entry.getArgument(2)),
                      g.toGlobal(entry.getArgument(3)),
                      g.toGlobal(entry.getArgument(5)), loop.getInductionVar(),
                      Value());
  }
  gpu::ReturnOp::create(b, loc);
}
