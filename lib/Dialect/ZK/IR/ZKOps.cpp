//===- ZKOps.cpp - zk operations ------------------------------------------===//
#include "zopt/Dialect/ZK/IR/ZKOps.h"

#include "zopt/abi.h"

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

#define GET_OP_CLASSES
#include "zopt/Dialect/ZK/IR/ZK.cpp.inc"
