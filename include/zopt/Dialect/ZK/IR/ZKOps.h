//===- ZKOps.h - zk operations ----------------------------------*- C++ -*-===//
#ifndef ZOPT_DIALECT_ZK_IR_ZKOPS_H
#define ZOPT_DIALECT_ZK_IR_ZKOPS_H

#include "mlir/Bytecode/BytecodeOpInterface.h"
#include "mlir/IR/Builders.h"
#include "mlir/IR/BuiltinOps.h"
#include "mlir/IR/OpDefinition.h"
#include "mlir/IR/SymbolTable.h"
#include "mlir/Interfaces/SideEffectInterfaces.h"
#include "zopt/Dialect/ZK/IR/ZKDialect.h"
#include "zopt/abi.h" // the codes of zk.descriptor and zk.store

#include "zopt/Dialect/ZK/IR/ZKEnums.h.inc"
#define GET_ATTRDEF_CLASSES
#include "zopt/Dialect/ZK/IR/ZKAttrs.h.inc"

#define GET_OP_CLASSES
#include "zopt/Dialect/ZK/IR/ZK.h.inc"

#endif
