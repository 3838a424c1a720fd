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

// The fields of abi.h's zopt_control that zk.control reads (inputs) and
// writes (outputs); the lowerings map each to its struct field (the CPU) or
// to the device's step globals and scaler (the GPU).
def ZK_ControlField : I32EnumAttr<"ControlField", "a field of zopt_control", [
    I32EnumAttrCase<"sumsq", 0>, I32EnumAttrCase<"max_norm", 1>,
    I32EnumAttrCase<"scale", 2>, I32EnumAttrCase<"growth_factor", 3>,
    I32EnumAttrCase<"backoff_factor", 4>, I32EnumAttrCase<"min_scale", 5>,
    I32EnumAttrCase<"growth_interval", 6>, I32EnumAttrCase<"good_steps", 7>,
    I32EnumAttrCase<"dynamic", 8>,
    I32EnumAttrCase<"norm", 9>, I32EnumAttrCase<"clip_coef", 10>,
    I32EnumAttrCase<"new_scale", 11>, I32EnumAttrCase<"new_good_steps", 12>,
    I32EnumAttrCase<"skip", 13>, I32EnumAttrCase<"advance", 14>]> {
  let cppNamespace = "::mlir::zk";
  let genSpecializedAttr = 0;
}
def ZK_ControlFieldAttr : EnumAttr<ZK_Dialect, ZK_ControlField, "control_field">;

#endif
