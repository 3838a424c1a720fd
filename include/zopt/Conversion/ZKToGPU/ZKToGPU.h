//===- ZKToGPU.h - zk kernels into one CUDA module --------------*- C++ -*-===//
//
// convert-zk-to-gpu: the zk kernels of a step whose optimizer states live
// on the GPU become one gpu.module of NVVM kernels (abi.h "GPU kernels");
// zopt-gpu-precise-sqrt keeps their square roots IEEE after
// convert-gpu-to-nvvm. The CUDA toolkit that turns the module into
// fatbinaries is driven from include/zopt/Target/CUDA/.
//
//===----------------------------------------------------------------------===//
#ifndef ZOPT_CONVERSION_ZKTOGPU_ZKTOGPU_H
#define ZOPT_CONVERSION_ZKTOGPU_ZKTOGPU_H

#include "mlir/Dialect/Arith/IR/Arith.h"
#include "mlir/Dialect/GPU/IR/GPUDialect.h"
#include "mlir/Dialect/LLVMIR/LLVMDialect.h"
#include "mlir/Dialect/LLVMIR/NVVMDialect.h"
#include "mlir/Dialect/Math/IR/Math.h"
#include "mlir/Dialect/MemRef/IR/MemRef.h"
#include "mlir/Dialect/SCF/IR/SCF.h"
#include "mlir/Pass/Pass.h"

namespace mlir::zopt {
#define GEN_PASS_DECL_CONVERTZKTOGPU
#define GEN_PASS_DECL_ZOPTGPUPRECISESQRT
#include "zopt/Conversion/Passes.h.inc"
} // namespace mlir::zopt

#endif
