//===- ZKOps.cpp - zk operations ------------------------------------------===//
#include "zopt/Dialect/ZK/IR/ZKOps.h"

#include "zopt/abi.h"

#include "mlir/Dialect/Arith/IR/Arith.h"
#include "mlir/Dialect/Math/IR/Math.h"

using namespace mlir;
using namespace mlir::zk;

LogicalResult DescriptorOp::verify() {
  size_t n = getStateKinds().size();
  if (getStateDtypes().size() != n || getStatePlacements().size() != n ||
      getStateRoundings().size() != n || getStateInits().size() != n ||
      getStateAccess().size() != n || getStateFlags().size() != n)
    return emitOpError("state arrays must all have the same length");
  if (n > ZOPT_MAX_STATES)
    return emitOpError("at most ") << ZOPT_MAX_STATES << " states";
  size_t h = getHyperKinds().size();
  if (getHyperDefaults().size() != h || getHyperMins().size() != h ||
      getHyperMaxs().size() != h || getHyperMaxExclusive().size() != h)
    return emitOpError("hyper arrays must all have the same length");
  if (h > ZOPT_MAX_HYPERS)
    return emitOpError("at most ") << ZOPT_MAX_HYPERS << " hyperparameters";
  if (getNumCoeffs() < 0 || getNumCoeffs() > ZOPT_MAX_COEFFS)
    return emitOpError("coefficient count must be in [0, ")
           << ZOPT_MAX_COEFFS << "]";
  if (getName().size() >= ZOPT_NAME_LEN)
    return emitOpError("step name longer than ") << ZOPT_NAME_LEN - 1;
  // The kernel table the conversions record: arrays of i32 codes and a
  // symbol name ([role, isa, "symbol"] on the CPU, [role, "symbol"] and
  // [sm, "symbol"] on the GPU).
  auto checkTable = [&](ArrayAttr table, StringRef name,
                        unsigned codes) -> LogicalResult {
    if (!table)
      return success();
    for (Attribute a : table) {
      auto entry = dyn_cast<ArrayAttr>(a);
      bool ok = entry && entry.size() == codes + 1 &&
                isa<StringAttr>(entry[codes]);
      for (unsigned i = 0; ok && i < codes; ++i) {
        auto c = dyn_cast<IntegerAttr>(entry[i]);
        ok = c && c.getType().isInteger(32);
      }
      if (!ok)
        return emitOpError(name) << " entries are [" << (codes == 2 ? "i32, " : "")
                                 << "i32, \"symbol\"] arrays; got " << a;
    }
    return success();
  };
  if (failed(checkTable(getCpuKernelsAttr(), "cpu_kernels", 2)) ||
      failed(checkTable(getGpuKernelsAttr(), "gpu_kernels", 1)) ||
      failed(checkTable(getGpuImagesAttr(), "gpu_images", 1)))
    return failure();
  return success();
}

LogicalResult KernelOp::verifyRegions() {
  bool hasAcc = false, hasStore = false;
  for (Operation &op : getBody().front()) {
    hasAcc |= isa<AccumulateOp>(op);
    hasStore |= isa<StoreOp>(op);
  }
  if (getRole() == KernelRole::update && (hasAcc || !hasStore))
    return emitOpError("an update kernel stores and does not accumulate");
  if (getRole() == KernelRole::sumsq && (!hasAcc || hasStore))
    return emitOpError("a sumsq kernel accumulates and does not store");
  return success();
}

bool ControlOp::isInput(ControlField f) {
  return uint32_t(f) <= uint32_t(ControlField::dynamic);
}

Type ControlOp::fieldType(MLIRContext *ctx, ControlField f) {
  switch (f) {
  case ControlField::growth_interval:
  case ControlField::good_steps:
  case ControlField::new_good_steps:
    return IntegerType::get(ctx, 64);
  case ControlField::dynamic:
  case ControlField::skip:
  case ControlField::advance:
    return IntegerType::get(ctx, 1);
  default:
    return Float64Type::get(ctx);
  }
}

// A remainder master (docs/NUMERICS.md §9): an f32 joined from, or split
// into, the int16 at `slot` and the bf16 at `remainder_of`.
LogicalResult LoadOp::verify() {
  if (getRemainderOf() && !getType().isF32())
    return emitOpError("a remainder master loads as f32, not ") << getType();
  if (getRemainderOf() && *getRemainderOf() == getSlot())
    return emitOpError("a remainder master's high half is another slot");
  // A q8 moment (docs/NUMERICS.md §10): codes at `slot`, absmax at `absmax`.
  if (getAbsmax() && (!getType().isF32() || getRemainderOf() ||
                      *getAbsmax() == getSlot()))
    return emitOpError("a q8 moment loads as f32 from codes and an absmax in "
                       "another slot");
  if (getQ8Unsigned() && !getAbsmax())
    return emitOpError("q8_unsigned needs absmax (a q8 moment)");
  return success();
}

LogicalResult StoreOp::verify() {
  Type st = getStorage();
  if (getQ8Unsigned() && !getAbsmax())
    return emitOpError("q8_unsigned needs absmax (a q8 moment)");
  if (getAbsmax()) {
    if (!st.isInteger(8) || !getValue().getType().isF32() ||
        getRemainderOf() || *getAbsmax() == getSlot())
      return emitOpError("a q8 moment stores an f32 into i8 codes and an "
                         "absmax in another slot, not ")
             << getValue().getType() << " into " << st;
    return success();
  }
  if (getKahan()) {
    // A Kahan-compensated param (docs/NUMERICS.md §11).
    if (!st.isBF16() || !getValue().getType().isF32() || getRemainderOf() ||
        getRounding() != ZOPT_ROUND_NEAREST_EVEN || *getKahan() == getSlot())
      return emitOpError("a Kahan-compensated param stores an f32 into bf16, "
                         "rounded to nearest even, with its compensation in "
                         "another slot, not ")
             << getValue().getType() << " into " << st;
    return success();
  }
  if (getRemainderOf()) {
    if (!st.isInteger(16) || !getValue().getType().isF32())
      return emitOpError("a remainder master stores an f32 into i16, not ")
             << getValue().getType() << " into " << st;
    if (*getRemainderOf() == getSlot())
      return emitOpError("a remainder master's high half is another slot");
    return success();
  }
  if (!st.isF32() && !st.isBF16() && !st.isF16())
    return emitOpError("stores into f32, bf16 or f16 (i16 only as a "
                       "remainder master, with remainder_of; i8 only as a "
                       "q8 moment, with absmax), not ")
           << st;
  return success();
}

LogicalResult ControlInOp::verify() {
  if (!ControlOp::isInput(getField()))
    return emitOpError("reads '") << stringifyControlField(getField())
                                  << "', an output of zopt_control";
  Type want = ControlOp::fieldType(getContext(), getField());
  if (getType() != want)
    return emitOpError("field '") << stringifyControlField(getField())
                                  << "' is " << want << ", not " << getType();
  return success();
}

LogicalResult ControlOutOp::verify() {
  if (ControlOp::isInput(getField()))
    return emitOpError("writes '") << stringifyControlField(getField())
                                   << "', an input of zopt_control";
  Type want = ControlOp::fieldType(getContext(), getField());
  if (getValue().getType() != want)
    return emitOpError("field '")
           << stringifyControlField(getField()) << "' is " << want << ", not "
           << getValue().getType();
  return success();
}

LogicalResult ControlOp::verifyRegions() {
  // Every output written exactly once, so that each lowering is total; the
  // body is scalar arith/math between the field ops (no memory, no loops).
  uint32_t written = 0;
  for (Operation &op : getBody().front()) {
    if (auto out = dyn_cast<ControlOutOp>(op)) {
      uint32_t bit = 1u << uint32_t(out.getField());
      if (written & bit)
        return out.emitOpError("writes '")
               << stringifyControlField(out.getField()) << "' twice";
      written |= bit;
      continue;
    }
    if (isa<ControlInOp>(op))
      continue;
    if (op.getNumRegions() ||
        !llvm::isa<arith::ArithDialect, math::MathDialect>(op.getDialect()))
      return op.emitOpError("is not scalar arith/math: a zk.control body "
                            "holds only zk.control_in/out and arith/math");
  }
  for (uint32_t f = 0; f <= uint32_t(ControlField::advance); ++f)
    if (!isInput(ControlField(f)) && !(written & (1u << f)))
      return emitOpError("does not write '")
             << stringifyControlField(ControlField(f)) << "'";
  return success();
}

#define GET_OP_CLASSES
#include "zopt/Dialect/ZK/IR/ZK.cpp.inc"
