//===- ZoptDialect.cpp - zopt dialect -------------------------------------===//
#include "zopt/Dialect/Zopt/IR/ZoptOps.h"

#include "mlir/IR/DialectImplementation.h"
#include "llvm/ADT/TypeSwitch.h"
#include "zopt/abi.h"

#include <cmath>
#include <cstdio>
#include <limits>

using namespace mlir;
using namespace mlir::zopt;

#include "zopt/Dialect/Zopt/IR/ZoptDialect.cpp.inc"
#include "zopt/Dialect/Zopt/IR/ZoptEnums.cpp.inc"
#define GET_ATTRDEF_CLASSES
#include "zopt/Dialect/Zopt/IR/ZoptAttrs.cpp.inc"

void ZoptDialect::initialize() {
  addOperations<
#define GET_OP_LIST
#include "zopt/Dialect/Zopt/IR/Zopt.cpp.inc"
      >();
  addAttributes<
#define GET_ATTRDEF_LIST
#include "zopt/Dialect/Zopt/IR/ZoptAttrs.cpp.inc"
      >();
}

unsigned mlir::zopt::storageBits(Type t) {
  if (t.isF32())
    return 32;
  if (t.isBF16() || t.isF16())
    return 16;
  return 0;
}

unsigned mlir::zopt::dtypeCode(Type t) {
  if (t.isF32())
    return ZOPT_DTYPE_F32;
  if (t.isBF16())
    return ZOPT_DTYPE_BF16;
  if (t.isF16())
    return ZOPT_DTYPE_F16;
  if (t.isInteger(16))
    return ZOPT_DTYPE_I16; // a remainder master's low half
  return 0;
}

HyperInfo mlir::zopt::getHyperInfo(HyperKind kind) {
  const double inf = std::numeric_limits<double>::infinity();
  switch (kind) {
  case HyperKind::lr:
    return {1e-3, 0.0, inf, false};
  case HyperKind::beta1:
    return {0.9, 0.0, 1.0, true};
  case HyperKind::beta2:
    return {0.999, 0.0, 1.0, true};
  case HyperKind::eps:
    return {1e-8, std::numeric_limits<double>::min(), inf, false};
  case HyperKind::weight_decay:
    return {0.0, 0.0, inf, false};
  case HyperKind::momentum:
    return {0.9, 0.0, 1.0, false};
  case HyperKind::dampening:
    return {0.0, 0.0, 1.0, false};
  case HyperKind::bias_correction:
    return {1.0, 0.0, 1.0, false};
  }
  llvm_unreachable("unknown hyper kind");
}

std::string mlir::zopt::formatNumber(double v) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%g", v);
  return buf;
}

//===----------------------------------------------------------------------===//
// Op verifiers
//===----------------------------------------------------------------------===//

LogicalResult StateOp::verify() {
  if (!storageBits(getType()))
    return emitOpError("state '")
           << stringifyStateKind(getKind()) << "' has type " << getType()
           << "; states are stored as f32, bf16 or f16";
  if (getRemainder()) {
    if (getKind() != StateKind::master)
      return emitOpError("'remainder' stores an f32 master as the int16 low "
                         "half beside its bf16 param; state '")
             << stringifyStateKind(getKind())
             << "' is not a master: drop 'remainder'";
    if (!getType().isF32())
      return emitOpError("a remainder master is an f32 master (the bf16 "
                         "param is its high half, the remainder its low "
                         "half); this master is ")
             << getType();
  }
  if (getKahan()) {
    // docs/NUMERICS.md §11: a bf16 param and its bf16 compensation.
    if (getKind() != StateKind::param)
      return emitOpError("'kahan' compensates the rounding of a bf16 param's "
                         "stores; state '")
             << stringifyStateKind(getKind()) << "' is not the param: drop 'kahan'";
    if (!getType().isBF16())
      return emitOpError("'kahan' compensates a bf16 param (its compensation "
                         "is bf16 too); this param is ")
             << getType();
  }
  if (getQ8()) {
    // docs/NUMERICS.md §10: the two Adam moments, quantized per block.
    if (getKind() != StateKind::exp_avg && getKind() != StateKind::exp_avg_sq)
      return emitOpError("'q8' block-quantizes an Adam moment (exp_avg: the "
                         "signed map, exp_avg_sq: the unsigned one); state '")
             << stringifyStateKind(getKind()) << "' is not one: drop 'q8'";
    if (!getType().isF32())
      return emitOpError("a q8 moment is an f32 moment stored as 8-bit codes "
                         "and a per-block absmax (the rule sees f32); this "
                         "moment is ")
             << getType() << ": declare it f32";
    if (getRounding())
      return emitOpError("a q8 moment is encoded to the nearest value of its "
                         "map (docs/NUMERICS.md §10), not rounded: drop "
                         "'rounding'");
  }
  if (!getRounding())
    return success();
  if (*getRounding() != Rounding::nearest_even && getType().isF32())
    return emitOpError("rounding applies to narrowing stores; state '")
           << stringifyStateKind(getKind())
           << "' is f32 and never rounds: drop 'rounding'";
  // The gradient is never written (it belongs to the user), so a rounding
  // mode on it would silently do nothing.
  if (getKind() == StateKind::grad) {
    InFlightDiagnostic d =
        emitOpError("rounding applies to stores, and 'grad' is never stored: "
                    "drop 'rounding'");
    d.attachNote() << "the gradient is read-only (it belongs to the user); "
                      "rounding is a property of the states the step writes";
    return d;
  }
  if (*getRounding() == Rounding::stochastic && !getType().isBF16()) {
    InFlightDiagnostic d = emitOpError("stochastic rounding is implemented for "
                                       "bf16 states; this state is ")
                           << getType() << " (use nearest_even)";
    d.attachNote() << "stochastic rounding adds 16 random bits below a bf16 "
                      "significand (abi.h \"Stochastic rounding\"); store the "
                      "state as bf16 to round it stochastically";
    return d;
  }
  return success();
}

LogicalResult HyperOp::verify() {
  if (!getDefaultValue())
    return success();
  HyperInfo info = getHyperInfo(getKind());
  double v = getDefaultValue()->convertToDouble();
  bool ok = std::isfinite(v) && v >= info.minValue &&
            (info.maxExclusive ? v < info.maxValue : v <= info.maxValue);
  if (!ok)
    return emitOpError("default ")
           << stringifyHyperKind(getKind()) << " = " << formatNumber(v)
           << " is out of range [" << formatNumber(info.minValue) << ", "
           << formatNumber(info.maxValue) << (info.maxExclusive ? ")" : "]");
  return success();
}

LogicalResult ClipByGlobalNormOp::verify() {
  double v = getMaxNorm().convertToDouble();
  if (!(v > 0.0) || !std::isfinite(v))
    return emitOpError("max_norm must be a positive finite number, got ")
           << formatNumber(v);
  return success();
}

LogicalResult YieldOp::verify() {
  if (getValues().size() != getTargets().size())
    return emitOpError("yields ")
           << getValues().size() << " values into " << getTargets().size()
           << " states; pair each new value with one state";
  for (auto [i, v] : llvm::enumerate(getValues()))
    if (!storageBits(v.getType()))
      return emitOpError("value #") << i << " has type " << v.getType()
                                    << "; only f32, bf16 or f16 can be stored";
  return success();
}

StateOp StepOp::getState(StateKind kind) {
  for (Operation &op : getBody().front())
    if (auto s = dyn_cast<StateOp>(op); s && s.getKind() == kind)
      return s;
  return {};
}

YieldOp StepOp::getYield() {
  return dyn_cast<YieldOp>(getBody().front().getTerminator());
}

#define GET_OP_CLASSES
#include "zopt/Dialect/Zopt/IR/Zopt.cpp.inc"
