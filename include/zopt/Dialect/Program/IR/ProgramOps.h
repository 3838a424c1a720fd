//===- ProgramOps.h - zprog operations --------------------------*- C++ -*-===//
#ifndef ZOPT_DIALECT_PROGRAM_IR_PROGRAMOPS_H
#define ZOPT_DIALECT_PROGRAM_IR_PROGRAMOPS_H

#include "mlir/Bytecode/BytecodeOpInterface.h"
#include "mlir/IR/Builders.h"
#include "mlir/IR/BuiltinOps.h"
#include "mlir/IR/OpDefinition.h"
#include "zopt/Dialect/Program/IR/ProgramDialect.h"
#include "zopt/Dialect/Zopt/IR/ZoptOps.h"

#include "zopt/Dialect/Program/IR/ProgramEnums.h.inc"
#define GET_ATTRDEF_CLASSES
#include "zopt/Dialect/Program/IR/ProgramAttrs.h.inc"

namespace mlir::zprog {
// The zopt enums the program ops take (state kinds, placements).
using zopt::Placement;
using zopt::PlacementAttr;
using zopt::StateKind;
using zopt::StateKindAttr;
} // namespace mlir::zprog

#define GET_OP_CLASSES
#include "zopt/Dialect/Program/IR/Program.h.inc"

#endif
