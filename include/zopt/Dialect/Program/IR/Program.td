//===- Program.td - zprog dialect umbrella -----------------*- tablegen -*-===//
#ifndef ZOPT_DIALECT_PROGRAM_TD
#define ZOPT_DIALECT_PROGRAM_TD

include "zopt/Dialect/Program/IR/ProgramDialect.td"
include "zopt/Dialect/Program/IR/ProgramEnums.td"
include "zopt/Dialect/Program/IR/ProgramOps.td"

#endif
