//===- Passes.h - zopt's conversions ----------------------------*- C++ -*-===//
//
// include/zopt/Conversion/ owns the lowerings out of the zk dialect, one
// folder per lowering: ZKToCPU/ (vectorized x86 functions) and ZKToGPU/ (a
// CUDA gpu.module). Both emit kernel bodies through the shared library in
// lib/Conversion/ZKCommon/. Passes.td declares every conversion pass.
//
//===----------------------------------------------------------------------===//
#ifndef ZOPT_CONVERSION_PASSES_H
#define ZOPT_CONVERSION_PASSES_H

#include "zopt/Conversion/ZKToCPU/ZKToCPU.h"
#include "zopt/Conversion/ZKToGPU/ZKToGPU.h"

namespace mlir::zopt {
#define GEN_PASS_REGISTRATION
#include "zopt/Conversion/Passes.h.inc"
} // namespace mlir::zopt

#endif
