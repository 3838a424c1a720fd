//===- ProgramEnums.td - zprog enums -----------------------*- tablegen -*-===//
#ifndef ZOPT_DIALECT_PROGRAM_PROGRAMENUMS_TD
#define ZOPT_DIALECT_PROGRAM_PROGRAMENUMS_TD

include "mlir/IR/EnumAttr.td"
include "zopt/Dialect/Program/IR/ProgramDialect.td"

// The numeric values equal the zopt_range values of runtime/include/zopt/abi.h
// (checked by lib/Target/Descriptor/AbiCheck.cpp).
def ZProg_Range : I32EnumAttr<"Range", "which elements a program op covers", [
    I32EnumAttrCase<"owned", 1>, I32EnumAttrCase<"all", 2>]> {
  let cppNamespace = "::mlir::zprog";
  let genSpecializedAttr = 0;
}
def ZProg_RangeAttr : EnumAttr<ZProg_Dialect, ZProg_Range, "range">;

#endif
