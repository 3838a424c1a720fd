//===- ZK.td - zk dialect umbrella -------------------------*- tablegen -*-===//
#ifndef ZOPT_DIALECT_ZK_TD
#define ZOPT_DIALECT_ZK_TD

include "zopt/Dialect/ZK/IR/ZKDialect.td"
include "zopt/Dialect/ZK/IR/ZKEnums.td"
include "zopt/Dialect/ZK/IR/ZKOps.td"

#endif
