//===- Passes.h - passes of the zopt dialect --------------------*- C++ -*-===//
//
// include/zopt/Dialect/Zopt/Transforms/ owns the passes that rewrite a
// description, in phase order: zopt-decompose, zopt-plan, zopt-fuse
// (Passes.td; one pass per .cpp in lib/Dialect/Zopt/Transforms/, with the
// small scalar IR builders they share in Builders.h there).
//
//===----------------------------------------------------------------------===//
#ifndef ZOPT_DIALECT_ZOPT_TRANSFORMS_PASSES_H
#define ZOPT_DIALECT_ZOPT_TRANSFORMS_PASSES_H

#include "mlir/Pass/Pass.h"
#include "zopt/Dialect/Program/IR/ProgramOps.h"
#include "zopt/Dialect/ZK/IR/ZKOps.h"
#include "zopt/Dialect/Zopt/IR/ZoptOps.h"

namespace mlir::zopt {
#define GEN_PASS_DECL
#include "zopt/Dialect/Zopt/Transforms/Passes.h.inc"
#define GEN_PASS_REGISTRATION
#include "zopt/Dialect/Zopt/Transforms/Passes.h.inc"
} // namespace mlir::zopt

#endif
