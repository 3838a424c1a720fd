//===- InitKernel.cpp - the INIT kernel of a GPU step --------------------===//
//
// <step>_init_gpu (GPUKernels.h): the states initialized from the param,
// over the work list, at finalize.
//
//===----------------------------------------------------------------------===//
#include "KernelIR.h"

#include "../ZKCommon/BodyEmitter.h"


using namespace mlir;
using namespace mlir::zopt;
using namespace mlir::zopt::gpu_kernels;

/// INIT (abi.h): every state initialized from the param (the master) gets
/// the param's values, converted as the host's convert() does (widening
/// exactly; narrowing to nearest even), over the work list at finalize.
void gpu_kernels::buildInitKernel(OpBuilder &gb, Location loc,
                                  const Step &st) {
  OpBuilder::InsertionGuard guard(gb);
  MLIRContext *ctx = gb.getContext();
  Type ptr = LLVM::LLVMPointerType::get(ctx), i64 = gb.getI64Type(),
       i32 = gb.getI32Type(), i16 = gb.getI16Type(), f32 = gb.getF32Type(),
       f16 = gb.getF16Type();
  auto fn = makeKernel(gb, loc, st.name + "_init_gpu", {ptr, ptr, ptr, i64},
                       ZOPT_GPU_BLOCK);
  Block &entry = fn.getBody().front();
  OpBuilder b = OpBuilder::atBlockEnd(&entry);
  G g{b, loc};
  int64_t param = -1;
  SmallVector<int64_t> targets;
  for (int64_t k = 0; k < st.numStates; ++k) {
    if (st.kinds[k] == ZOPT_STATE_PARAM)
      param = k;
    if (st.inits[k] == ZOPT_INIT_FROM_PARAM)
      targets.push_back(k);
  }
  auto memType = [&](int32_t dt) { return dt == ZOPT_DTYPE_F32 ? f32 : dt == ZOPT_DTYPE_F16 ? f16 : i16; };
  if (param >= 0 && !targets.empty()) {
    Value states = g.toGlobal(entry.getArgument(0)),
          chunks = g.toGlobal(entry.getArgument(2));
    auto chunkLoop = forChunks(g, entry.getArgument(3));
    b.setInsertionPoint(chunkLoop.getBody()->getTerminator());
    Value c = chunkLoop.getInductionVar();
    auto zext = [&](Value v) { return arith::ExtUIOp::create(b, loc, i64, v); };
    Value begin = g.load(i64, g.gep(i64, chunks, g.mul(c, g.i64(2))));
    Value seg = zext(g.load(i32, g.gep(i32, chunks, g.add(g.mul(c, g.i64(4)), g.i64(2)))));
    Value n = zext(g.load(i32, g.gep(i32, chunks, g.add(g.mul(c, g.i64(4)), g.i64(3)))));
    Value row = g.mul(seg, g.i64(st.numStates));
    auto slotPtr = [&](int64_t k) {
      return g.toGlobal(g.load(g.ptr(), g.gep(g.ptr(), states, g.add(row, g.i64(k)))));
    };
    Value src = slotPtr(param);
    SmallVector<Value> dst;
    for (int64_t k : targets)
      dst.push_back(slotPtr(k));
    auto loop = scf::ForOp::create(b, loc, g.add(begin, g.tid()), g.add(begin, n), g.bdim());
    b.setInsertionPoint(loop.getBody()->getTerminator());
    Value i = loop.getInductionVar();
    int32_t pdt = st.dtypes[param];
    Value x = g.load(memType(pdt), g.gep(memType(pdt), src, i));
    SmallVector<Value> noCoeffs;
    BodyEmitter e{b, loc, 1, {}, noCoeffs, {}};
    Value f = pdt == ZOPT_DTYPE_F32   ? x
              : pdt == ZOPT_DTYPE_F16 ? arith::ExtFOp::create(b, loc, f32, x).getResult()
                                      : e.bf16BitsToF32(x);
    for (auto [k, p] : llvm::zip(targets, dst)) {
      int32_t dt = st.dtypes[k];
      // A remainder master (I16) of the widened param is 0 (abi.h).
      Value v = dt == ZOPT_DTYPE_I16     ? e.intCst(b.getI16Type(), 0)
                : dt == pdt              ? x
                : dt == ZOPT_DTYPE_F32   ? f
                : dt == ZOPT_DTYPE_F16   ? arith::TruncFOp::create(b, loc, f16, f).getResult()
                                         : e.f32ToBf16BitsInt(f);
      LLVM::StoreOp::create(b, loc, v, g.gep(memType(dt), p, i));
    }
  }
  b.setInsertionPointToEnd(&entry);
  gpu::ReturnOp::create(b, loc);
}
