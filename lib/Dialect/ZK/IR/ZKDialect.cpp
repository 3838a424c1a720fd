//===- ZKDialect.cpp - the fused-kernel dialect (zk) ----------------------===//
#include "zopt/Dialect/ZK/IR/ZKOps.h"

#include "mlir/IR/DialectImplementation.h"
#include "llvm/ADT/TypeSwitch.h"

using namespace mlir;
using namespace mlir::zk;

#include "zopt/Dialect/ZK/IR/ZKDialect.cpp.inc"
#include "zopt/Dialect/ZK/IR/ZKEnums.cpp.inc"
#define GET_ATTRDEF_CLASSES
#include "zopt/Dialect/ZK/IR/ZKAttrs.cpp.inc"

void ZKDialect::initialize() {
  addOperations<
#define GET_OP_LIST
#include "zopt/Dialect/ZK/IR/ZK.cpp.inc"
      >();
  addAttributes<
#define GET_ATTRDEF_LIST
#include "zopt/Dialect/ZK/IR/ZKAttrs.cpp.inc"
      >();
}
