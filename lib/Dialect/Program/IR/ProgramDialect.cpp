//===- ProgramDialect.cpp - the step-program dialect (zprog) --------------===//
#include "zopt/Dialect/Program/IR/ProgramOps.h"

#include "mlir/IR/DialectImplementation.h"
#include "llvm/ADT/TypeSwitch.h"

using namespace mlir;
using namespace mlir::zprog;

#include "zopt/Dialect/Program/IR/ProgramDialect.cpp.inc"
#include "zopt/Dialect/Program/IR/ProgramEnums.cpp.inc"
#define GET_ATTRDEF_CLASSES
#include "zopt/Dialect/Program/IR/ProgramAttrs.cpp.inc"

void ZProgDialect::initialize() {
  addOperations<
#define GET_OP_LIST
#include "zopt/Dialect/Program/IR/Program.cpp.inc"
      >();
  addAttributes<
#define GET_ATTRDEF_LIST
#include "zopt/Dialect/Program/IR/ProgramAttrs.cpp.inc"
      >();
}
