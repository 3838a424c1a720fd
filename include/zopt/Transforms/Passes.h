//===- Passes.h - zopt passes -----------------------------------*- C++ -*-===//
#ifndef ZOPT_TRANSFORMS_PASSES_H
#define ZOPT_TRANSFORMS_PASSES_H

#include "mlir/Dialect/Func/IR/FuncOps.h"
#include "mlir/Dialect/GPU/IR/GPUDialect.h"
#include "mlir/Dialect/LLVMIR/NVVMDialect.h"
#include "mlir/Dialect/MemRef/IR/MemRef.h"
#include "mlir/Dialect/LLVMIR/LLVMDialect.h"
#include "mlir/Dialect/SCF/IR/SCF.h"
#include "mlir/Dialect/Vector/IR/VectorOps.h"
#include "mlir/Pass/Pass.h"
#include "zopt/Dialect/ZK/IR/ZKOps.h"
#include "zopt/Dialect/Zopt/IR/ZoptOps.h"

namespace mlir::zopt {
#define GEN_PASS_DECL
#include "zopt/Transforms/Passes.h.inc"
#define GEN_PASS_REGISTRATION
#include "zopt/Transforms/Passes.h.inc"
} // namespace mlir::zopt

#endif
