//===- ZKEnums.td - zk enums -------------------------------*- tablegen -*-===//
#ifndef ZOPT_DIALECT_ZK_ZKENUMS_TD
#define ZOPT_DIALECT_ZK_ZKENUMS_TD

include "mlir/IR/EnumAttr.td"
include "zopt/Dialect/ZK/IR/ZKDialect.td"

// The numeric values equal the zopt_kernel_role values of
// runtime/include/zopt/abi.h (checked by lib/Target/Descriptor/AbiCheck.cpp).
def ZK_KernelRole : I32EnumAttr<"KernelRole", "role of an elementwise kernel", [
    I32EnumAttrCase<"update", 2>, I32EnumAttrCase<"sumsq", 3>]> {
  let cppNamespace = "::mlir::zk";
  let genSpecializedAttr = 0;
}
def ZK_KernelRoleAttr : EnumAttr<ZK_Dialect, ZK_KernelRole, "role">;

#endif
