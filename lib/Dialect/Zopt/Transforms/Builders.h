//===- Builders.h - small IR-building helpers shared by the passes -*- C++ -*-===//
//
// The IR-building helpers the passes of lib/Dialect/Zopt/Transforms/
// (zopt-decompose, zopt-plan, zopt-fuse and the control body of Control.cpp)
// share; the passes are declared in include/zopt/Dialect/Zopt/Transforms/.
//===----------------------------------------------------------------------===//
#ifndef ZOPT_LIB_DIALECT_ZOPT_TRANSFORMS_BUILDERS_H
#define ZOPT_LIB_DIALECT_ZOPT_TRANSFORMS_BUILDERS_H

#include "mlir/Dialect/Arith/IR/Arith.h"
#include "mlir/IR/Builders.h"

namespace mlir::zopt {

/// Arithmetic over scalars of one float type, at one location.
struct ElemBuilder {
  OpBuilder &b;
  Location loc;
  Value cst(double v, Type t);
  Value f64(double v) { return cst(v, b.getF64Type()); }
  Value add(Value x, Value y);
  Value sub(Value x, Value y);
  Value mul(Value x, Value y);
  Value div(Value x, Value y);
  Value sqrt(Value x);
  Value pow(Value x, Value y);
  Value select(Value c, Value x, Value y);
  Value cmp(arith::CmpFPredicate p, Value x, Value y);
  /// Widens a stored element (bf16/f16/f32) to f32; exact.
  Value toF32(Value x);
  /// Truncates a uniform f64 to the f32 that per-element math uses.
  Value coeff(Value x64);
};

/// Appends at `b` the `zk.control @<stepName>_control` of a step whose
/// descriptor flags are `flags` (ZOPT_FLAG_*): the step's control semantics
/// (Control.cpp; abi.h "CONTROL").
void buildControl(OpBuilder &b, Location loc, StringRef stepName,
                  int64_t flags);

} // namespace mlir::zopt

#endif
