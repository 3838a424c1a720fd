//===- ZKDialect.h - the fused-kernel dialect (zk) --------------*- C++ -*-===//
//
// include/zopt/Dialect/ZK/ owns the zk dialect: the output of the fuse phase
// and the input of the conversions (lib/Conversion/ZKToCPU, ZKToGPU). A
// module in zk holds one zk.descriptor (what the runtime must know), one
// zk.prepare (the per-group f64 coefficients) and the zk.kernel bodies over
// one element. It says nothing about a device; ops in ZKOps.td.
//
//===----------------------------------------------------------------------===//
#ifndef ZOPT_DIALECT_ZK_IR_ZKDIALECT_H
#define ZOPT_DIALECT_ZK_IR_ZKDIALECT_H

#include "mlir/Dialect/Arith/IR/Arith.h"
#include "mlir/Dialect/Math/IR/Math.h"
#include "mlir/IR/Dialect.h"

#include "zopt/Dialect/ZK/IR/ZKDialect.h.inc"

#endif
