//===- ZoptEnums.td - zopt enums ---------------------------*- tablegen -*-===//
#ifndef ZOPT_DIALECT_ZOPTENUMS_TD
#define ZOPT_DIALECT_ZOPTENUMS_TD

include "mlir/IR/EnumAttr.td"
include "zopt/Dialect/Zopt/IR/ZoptDialect.td"

// The numeric values of these enums are the ones runtime/include/zopt/abi.h
// gives the descriptor (zopt_state_kind, zopt_placement, zopt_rounding,
// zopt_hyper_kind, zopt_global): a case that disagrees with abi.h, or an
// abi.h value without a case, fails the build
// (lib/Target/Descriptor/AbiCheck.cpp).
def Zopt_StateKind : I32EnumAttr<"StateKind", "kind of per-parameter state", [
    I32EnumAttrCase<"param", 1>, I32EnumAttrCase<"grad", 2>,
    I32EnumAttrCase<"master", 3>, I32EnumAttrCase<"exp_avg", 4>,
    I32EnumAttrCase<"exp_avg_sq", 5>, I32EnumAttrCase<"max_exp_avg_sq", 6>,
    I32EnumAttrCase<"momentum_buffer", 7>]> {
  let cppNamespace = "::mlir::zopt";
  let genSpecializedAttr = 0;
}
def Zopt_StateKindAttr : EnumAttr<Zopt_Dialect, Zopt_StateKind, "state_kind">;

def Zopt_Placement : I32EnumAttr<"Placement", "where a state lives", [
    I32EnumAttrCase<"cpu", 1>, I32EnumAttrCase<"gpu", 2>]> {
  let cppNamespace = "::mlir::zopt";
  let genSpecializedAttr = 0;
}
def Zopt_PlacementAttr : EnumAttr<Zopt_Dialect, Zopt_Placement, "placement">;

def Zopt_Rounding : I32EnumAttr<"Rounding", "rounding of narrowing stores", [
    I32EnumAttrCase<"nearest_even", 1>, I32EnumAttrCase<"stochastic", 2>]> {
  let cppNamespace = "::mlir::zopt";
  let genSpecializedAttr = 0;
}
def Zopt_RoundingAttr : EnumAttr<Zopt_Dialect, Zopt_Rounding, "rounding">;

def Zopt_HyperKind : I32EnumAttr<"HyperKind", "per-group hyperparameter slot", [
    I32EnumAttrCase<"lr", 1>, I32EnumAttrCase<"beta1", 2>,
    I32EnumAttrCase<"beta2", 3>, I32EnumAttrCase<"eps", 4>,
    I32EnumAttrCase<"weight_decay", 5>, I32EnumAttrCase<"momentum", 6>,
    I32EnumAttrCase<"dampening", 7>, I32EnumAttrCase<"bias_correction", 8>]> {
  let cppNamespace = "::mlir::zopt";
  let genSpecializedAttr = 0;
}
def Zopt_HyperKindAttr : EnumAttr<Zopt_Dialect, Zopt_HyperKind, "hyper">;

def Zopt_GlobalKind : I32EnumAttr<"GlobalKind", "step-level runtime scalar", [
    I32EnumAttrCase<"step", 0>, I32EnumAttrCase<"clip_coef", 1>,
    I32EnumAttrCase<"grad_scale", 2>]> {
  let cppNamespace = "::mlir::zopt";
  let genSpecializedAttr = 0;
}
def Zopt_GlobalKindAttr : EnumAttr<Zopt_Dialect, Zopt_GlobalKind, "global">;

#endif
