//===- ProgramDialect.h - the step-program dialect (zprog) ------*- C++ -*-===//
//
// include/zopt/Dialect/Program/ owns the zprog dialect: the step program
// the plan phase writes (what one step does on every rank, in order) and
// zopt-emit-descriptor lowers into abi.h's program table. Its verifier
// (lib/Dialect/Program/IR/ProgramOps.cpp) enforces the order the runtime's
// executor relies on; docs/Dialects/Program.md lists the rules.
//
//===----------------------------------------------------------------------===//
#ifndef ZOPT_DIALECT_PROGRAM_IR_PROGRAMDIALECT_H
#define ZOPT_DIALECT_PROGRAM_IR_PROGRAMDIALECT_H

#include "mlir/IR/Dialect.h"
#include "zopt/Dialect/Zopt/IR/ZoptDialect.h"

#include "zopt/Dialect/Program/IR/ProgramDialect.h.inc"

#endif
