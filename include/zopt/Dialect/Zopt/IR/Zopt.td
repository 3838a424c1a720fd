//===- Zopt.td - zopt dialect umbrella ---------------------*- tablegen -*-===//
#ifndef ZOPT_DIALECT_ZOPT_TD
#define ZOPT_DIALECT_ZOPT_TD

include "zopt/Dialect/Zopt/IR/ZoptDialect.td"
include "zopt/Dialect/Zopt/IR/ZoptEnums.td"
include "zopt/Dialect/Zopt/IR/ZoptOps.td"

#endif
