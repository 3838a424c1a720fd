//===- ZKToCPU.h - zk kernels into vectorized CPU functions -----*- C++ -*-===//
//
// convert-zk-to-cpu: every zk.kernel becomes one function per x86 ISA
// variant with the C ABI of abi.h, zk.prepare an f64 host function; the
// kernel-table entries are recorded on the zk.descriptor for
// zopt-emit-descriptor (include/zopt/Target/Passes.td).
//
//===----------------------------------------------------------------------===//
#ifndef ZOPT_CONVERSION_ZKTOCPU_ZKTOCPU_H
#define ZOPT_CONVERSION_ZKTOCPU_ZKTOCPU_H

#include "mlir/Dialect/Arith/IR/Arith.h"
#include "mlir/Dialect/Func/IR/FuncOps.h"
#include "mlir/Dialect/LLVMIR/LLVMDialect.h"
#include "mlir/Dialect/Math/IR/Math.h"
#include "mlir/Dialect/SCF/IR/SCF.h"
#include "mlir/Dialect/Vector/IR/VectorOps.h"
#include "mlir/Pass/Pass.h"

namespace mlir::zopt {
#define GEN_PASS_DECL_CONVERTZKTOCPU
#include "zopt/Conversion/Passes.h.inc"
} // namespace mlir::zopt

#endif
