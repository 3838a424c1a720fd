//===- Passes.h - zopt's target passes --------------------------*- C++ -*-===//
//
// include/zopt/Target/ owns what turns the converted module into the parts
// of step.so the runtime reads: zopt-emit-descriptor writes abi.h's
// descriptor (lib/Target/Descriptor, the one writer of it),
// zopt-set-target-attrs the per-function x86 targets (lib/Target/CPU),
// zopt-embed-gpu-binaries the CUDA fatbinaries built with the toolkit of
// CUDA/Toolkit.h (lib/Target/CUDA); Emit.h turns the LLVM dialect into
// LLVM IR, objects and the linked step.so.
//
//===----------------------------------------------------------------------===//
#ifndef ZOPT_TARGET_PASSES_H
#define ZOPT_TARGET_PASSES_H

#include "mlir/Dialect/GPU/IR/GPUDialect.h"
#include "mlir/Dialect/LLVMIR/LLVMDialect.h"
#include "mlir/Dialect/LLVMIR/NVVMDialect.h"
#include "mlir/Pass/Pass.h"

namespace mlir::zopt {
#define GEN_PASS_DECL
#include "zopt/Target/Passes.h.inc"
#define GEN_PASS_REGISTRATION
#include "zopt/Target/Passes.h.inc"
} // namespace mlir::zopt

#endif
