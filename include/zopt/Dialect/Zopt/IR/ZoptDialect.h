//===- ZoptDialect.h - zopt dialect -----------------------------*- C++ -*-===//
#ifndef ZOPT_DIALECT_ZOPT_IR_ZOPTDIALECT_H
#define ZOPT_DIALECT_ZOPT_IR_ZOPTDIALECT_H

#include "mlir/Dialect/Arith/IR/Arith.h"
#include "mlir/Dialect/Math/IR/Math.h"
#include "mlir/IR/Dialect.h"

#include "zopt/Dialect/Zopt/IR/ZoptDialect.h.inc"

#endif
