//===- ZoptOps.h - zopt operations ------------------------------*- C++ -*-===//
#ifndef ZOPT_DIALECT_ZOPT_IR_ZOPTOPS_H
#define ZOPT_DIALECT_ZOPT_IR_ZOPTOPS_H

#include "mlir/Bytecode/BytecodeOpInterface.h"
#include "mlir/IR/Builders.h"
#include "mlir/IR/BuiltinOps.h"
#include "mlir/IR/OpDefinition.h"
#include "mlir/IR/SymbolTable.h"
#include "mlir/Interfaces/SideEffectInterfaces.h"
#include "llvm/ADT/SmallPtrSet.h"
#include "zopt/Dialect/Zopt/IR/ZoptDialect.h"

#include "zopt/Dialect/Zopt/IR/ZoptEnums.h.inc"
#define GET_ATTRDEF_CLASSES
#include "zopt/Dialect/Zopt/IR/ZoptAttrs.h.inc"

namespace mlir::zopt {
class StepOp;
class StateOp;
class YieldOp;

/// Refuses attributes of a zopt op that are neither declared by the op
/// (inherent) nor compiler-internal (`zopt.` prefix, set by a pass); the
/// error names the attribute, the closest known one and the known ones.
LogicalResult verifyKnownAttributes(Operation *op);

/// The trait every zopt op carries (Zopt_Op in ZoptDialect.td).
template <typename ConcreteType>
class KnownAttributesOnly
    : public OpTrait::TraitBase<ConcreteType, KnownAttributesOnly> {
public:
  static LogicalResult verifyTrait(Operation *op) {
    return verifyKnownAttributes(op);
  }
};
} // namespace mlir::zopt

#define GET_OP_CLASSES
#include "zopt/Dialect/Zopt/IR/Zopt.h.inc"

namespace mlir::zopt {
/// Bit width of a storage element type (f32: 32, bf16/f16: 16), 0 otherwise.
unsigned storageBits(Type t);
/// The abi.h zopt_dtype code of a storage type (1 f32, 2 bf16, 3 f16), or 0.
unsigned dtypeCode(Type t);
/// Default value and valid range of a hyperparameter slot, shared by the
/// verifier, the descriptor writer and (through the descriptor) the runtime.
struct HyperInfo {
  double defaultValue, minValue, maxValue;
  bool maxExclusive;
};
HyperInfo getHyperInfo(HyperKind kind);
/// A double as diagnostics print it (%g: 1, 0.001, inf).
std::string formatNumber(double v);
/// Whether `arch` names a CUDA architecture zopt compiles for: sm_70 or
/// newer, one LLVM's NVPTX backend knows (sm_80, sm_90, ...).
bool isKnownGpuArch(llvm::StringRef arch);
/// The list of them, for diagnostics ("sm_70, sm_72, ...").
std::string knownGpuArchs();
/// The ops of a step body that reach a stored value: the terminator, ops
/// with effects and, transitively, the ops whose results they use.
void collectLiveOps(Block &body, llvm::SmallPtrSetImpl<Operation *> &live);
} // namespace mlir::zopt

#endif
