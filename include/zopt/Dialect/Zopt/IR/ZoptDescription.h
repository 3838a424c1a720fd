//===- ZoptDescription.h - reading a step description -----------*- C++ -*-===//
//
// What zopt-compile (and zopt.compile() in Python, and the fuzz target) do
// with a description before any pass: bounded-cost checks of the text,
// parsing, the description-only rules, the verifier and the warnings. The
// limits and rules are listed in docs/Dialects/Zopt.md ("Limits",
// "Description-level rules", "Warnings").
//
//===----------------------------------------------------------------------===//
#ifndef ZOPT_DIALECT_ZOPT_IR_ZOPTDESCRIPTION_H
#define ZOPT_DIALECT_ZOPT_IR_ZOPTDESCRIPTION_H

#include "mlir/IR/BuiltinOps.h"
#include "mlir/IR/Diagnostics.h"
#include "mlir/IR/OwningOpRef.h"
#include "llvm/Support/SourceMgr.h"

#include <cstddef>

namespace mlir::zopt {

class StepOp;

/// The documented limits of a description. Each is far above any real
/// optimizer (the examples are < 2 KB, < 30 ops, nesting < 4) and keeps the
/// compile time bounded (about a second at the op limit on one core).
struct DescriptionLimits {
  /// Size of the description text, in bytes (1 MiB).
  static constexpr size_t kMaxBytes = size_t(1) << 20;
  /// Nesting of ( [ { < outside strings and comments.
  static constexpr unsigned kMaxNesting = 128;
  /// Operations in the zopt.step, its terminator included.
  static constexpr unsigned kMaxOpsPerStep = 1024;
  /// zopt.step operations in a description.
  static constexpr unsigned kMaxSteps = 1;
};

/// The stack the drivers parse and compile on (a thread of this size), so
/// that recursion that brackets do not count (long affine expressions in an
/// attribute) stays far from the end of the stack.
constexpr unsigned kDriverStackBytes = 256u << 20;

/// The first byte of `text` whose bracket ( [ { < nesting, counted outside
/// string literals and `//` comments, exceeds `maxNesting`; npos if none.
/// Linear, no recursion: safe on any input.
size_t findExcessiveNesting(llvm::StringRef text, unsigned maxNesting);

/// Refuses a buffer nested deeper than `maxNesting` with a located error
/// (before the recursive-descent parser sees it). Used by zopt-opt too.
LogicalResult checkNesting(llvm::SourceMgr &sm, unsigned bufferId,
                           MLIRContext *ctx,
                           unsigned maxNesting = DescriptionLimits::kMaxNesting);

/// Reads the description in the main buffer of `sm`: the size and nesting
/// limits, parsing (without the verifier), the step and op limits, the
/// description-level rules (one zopt.step and nothing else, zopt ops only,
/// no compiler-internal ops or attributes), the verifier, then warnings.
/// Returns null after emitting located diagnostics on failure.
OwningOpRef<ModuleOp> parseDescription(llvm::SourceMgr &sm, MLIRContext *ctx);

/// The description-level rules on a parsed (not yet verified) module.
LogicalResult verifyDescription(ModuleOp module);

/// Warnings on a verified step: values that reach no stored value, unused
/// hyperparameters, a gradient that is never read.
void lintDescription(StepOp step);

/// Whether the step's kernels run on the GPU: where its optimizer states
/// live (else where the param lives). What zopt-compile's --gpu and the fuzz
/// targets decide the code generators by.
bool kernelsOnGpu(ModuleOp module);

/// Registers a diagnostic handler that adds notes to errors about the
/// description's type convention (the types after ':') and passes every
/// diagnostic on. Register it after the handler that prints (handlers run
/// newest first).
DiagnosticEngine::HandlerID registerDescriptionHints(MLIRContext *ctx);

} // namespace mlir::zopt

#endif
