//===- GPUKernels.h - the CUDA kernels of a GPU step ------------*- C++ -*-===//
//
// What convert-zk-to-gpu builds into `gpu.module @<step>_gpu`, with the
// launch ABI of abi.h's "GPU kernels" section:
//
//   <step>_prepare_gpu(hypers, globals, segs, tensor_t, num_rows, coeffs)
//   <step>_sumsq(states, segs, chunks, num_chunks, coeffs, partials, sg,
//                hypers, globals, num_rows, tensor_t, active)
//                                                      (if a sumsq kernel)
//   <step>_update(states, segs, chunks, num_chunks, coeffs, sg, active
//                 [, tensor_t, seed])
//   <step>_finish(globals, num_groups, sg, scaler, tensor_t, active,
//                 num_rows)
//   <step>_init_gpu(states, segs, chunks, num_chunks)
//
// The coefficient table has one row per segment (tensor): its group's
// hyperparameters at the tensor's own step t (tensor_t); `active` says
// which tensors (and groups) a step updates.
//
// Each builder appends one gpu.func kernel at `gb` (inside the gpu.module).
//
//===----------------------------------------------------------------------===//
#ifndef ZOPT_LIB_CONVERSION_ZKTOGPU_GPUKERNELS_H
#define ZOPT_LIB_CONVERSION_ZKTOGPU_GPUKERNELS_H

#include "zopt/Dialect/ZK/IR/ZKOps.h"

#include <string>

namespace mlir::zopt::gpu_kernels {

/// What the kernels need to know of the step (its zk.descriptor,
/// zk.prepare and zk.control).
struct Step {
  std::string name;
  int64_t numStates, numHypers, numCoeffs;
  uint32_t flags;
  double maxNorm;
  zk::PrepareOp prepare;
  ArrayRef<int32_t> kinds, dtypes, inits;
  zk::ControlOp control;
};

/// PREPARE: the zk.prepare body per group, one thread per group.
void buildPrepareKernel(OpBuilder &gb, Location loc, const Step &st);
/// UPDATE: kernel `k` over the chunk work list (skipped when sg->skip).
void buildUpdateKernel(OpBuilder &gb, zk::KernelOp k, const Step &st);
/// INIT: the states initialized from the param, at finalize.
void buildInitKernel(OpBuilder &gb, Location loc, const Step &st);
/// SUMSQ: the two-stage sum of squares of kernel `k`; the last block writes
/// the norm, clip coefficient and skip flag of the step's zk.control and
/// recomputes the coefficients.
LogicalResult buildSumsqKernel(OpBuilder &gb, zk::KernelOp k, const Step &st);
/// FINISH: step counts and the loss scaler as the step's zk.control says,
/// and 1/S in the globals.
LogicalResult buildFinishKernel(OpBuilder &gb, Location loc, const Step &st);

} // namespace mlir::zopt::gpu_kernels

#endif
