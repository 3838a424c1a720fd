//===- ZoptDialect.h - zopt dialect -----------------------------*- C++ -*-===//
//
// include/zopt/Dialect/Zopt/ owns the zopt dialect, the user's declarative
// description of one optimizer step (zopt.step): its ops and enums (IR/,
// ZoptOps.td), the verifier and the description-level rules, limits and
// warnings (ZoptDescription.h; docs/Dialects/Zopt.md), and the passes that
// rewrite it (Transforms/: decompose, plan, fuse).
//
//===----------------------------------------------------------------------===//
#ifndef ZOPT_DIALECT_ZOPT_IR_ZOPTDIALECT_H
#define ZOPT_DIALECT_ZOPT_IR_ZOPTDIALECT_H

#include "mlir/Dialect/Arith/IR/Arith.h"
#include "mlir/Dialect/Math/IR/Math.h"
#include "mlir/IR/Dialect.h"

#include "zopt/Dialect/Zopt/IR/ZoptDialect.h.inc"

#endif
