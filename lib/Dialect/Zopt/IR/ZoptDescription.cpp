//===- ZoptDescription.cpp - reading a step description -------------------===//
//
// The limits and description-level rules are listed in docs/Dialects/Zopt.md.
//
//===----------------------------------------------------------------------===//
#include "zopt/Dialect/Zopt/IR/ZoptDescription.h"
#include "zopt/Dialect/Zopt/IR/ZoptOps.h"

#include "mlir/IR/Verifier.h"
#include "mlir/Parser/Parser.h"
#include "llvm/ADT/DenseMap.h"
#include "llvm/ADT/SmallPtrSet.h"

using namespace mlir;
using namespace mlir::zopt;

size_t mlir::zopt::findExcessiveNesting(StringRef text, unsigned maxNesting) {
  unsigned depth = 0;
  const size_t n = text.size();
  for (size_t i = 0; i < n; ++i) {
    switch (text[i]) {
    case '"': // a string literal (no newline inside, \" escapes)
      for (++i; i < n && text[i] != '"' && text[i] != '\n'; ++i)
        if (text[i] == '\\')
          ++i;
      break;
    case '/': // a comment to the end of the line
      if (i + 1 < n && text[i + 1] == '/')
        while (i < n && text[i] != '\n')
          ++i;
      break;
    case '(':
    case '[':
    case '{':
    case '<':
      if (++depth > maxNesting)
        return i;
      break;
    case ')':
    case ']':
    case '}':
      if (depth)
        --depth;
      break;
    case '>': // not the arrow of a function type
      if (depth && !(i > 0 && text[i - 1] == '-'))
        --depth;
      break;
    default:
      break;
    }
  }
  return StringRef::npos;
}

/// The location of byte `offset` of buffer `id`.
static Location locationOf(llvm::SourceMgr &sm, unsigned id, size_t offset,
                           MLIRContext *ctx) {
  const llvm::MemoryBuffer *buf = sm.getMemoryBuffer(id);
  auto [line, col] = sm.getLineAndColumn(
      llvm::SMLoc::getFromPointer(buf->getBufferStart() + offset), id);
  return FileLineColLoc::get(ctx, buf->getBufferIdentifier(), line, col);
}

LogicalResult mlir::zopt::checkNesting(llvm::SourceMgr &sm, unsigned id,
                                       MLIRContext *ctx, unsigned maxNesting) {
  StringRef text = sm.getMemoryBuffer(id)->getBuffer();
  size_t at = findExcessiveNesting(text, maxNesting);
  if (at == StringRef::npos)
    return success();
  // A located error; for a very long line (a generated input), the column
  // goes into the message instead of printing the whole line under it.
  Location loc = locationOf(sm, id, at, ctx);
  auto flc = cast<FileLineColLoc>(loc);
  size_t lineStart = text.rfind('\n', at);
  lineStart = lineStart == StringRef::npos ? 0 : lineStart + 1;
  size_t lineEnd = text.find('\n', at);
  bool longLine = (lineEnd == StringRef::npos ? text.size() : lineEnd) -
                      lineStart > 240;
  if (longLine)
    loc = FileLineColLoc::get(flc.getFilename(), flc.getLine(), 0);
  InFlightDiagnostic d = emitError(loc) << "brackets nested deeper than "
                                        << maxNesting << " levels";
  if (longLine)
    d << " at column " << flc.getColumn();
  d << " (the limit of the nesting of ( [ { < in the input)";
  return d;
}

LogicalResult mlir::zopt::verifyDescription(ModuleOp module) {
  // Generic Operation API only: the module is not verified yet (a generic
  // "zopt.step"() may have no region).
  Operation *step = nullptr;
  for (Operation &op : module.getBody()->getOperations()) {
    if (op.getName().getStringRef() != StepOp::getOperationName())
      return op.emitError("'")
             << op.getName()
             << "' cannot appear at the top level of a description: a "
                "description holds one zopt.step and nothing else";
    if (step) {
      InFlightDiagnostic d =
          op.emitError("a description holds one zopt.step (limit: ")
          << DescriptionLimits::kMaxSteps
          << " step per description); this is another one";
      d.attachNote(step->getLoc()) << "the first zopt.step";
      return d;
    }
    step = &op;
  }
  if (!step)
    return emitError(module.getLoc(), "the description holds no zopt.step");

  unsigned numOps = 0;
  WalkResult r = step->walk<WalkOrder::PreOrder>([&](Operation *op) {
    for (NamedAttribute a : op->getDiscardableAttrs())
      if (a.getName().strref().starts_with("zopt.")) {
        op->emitError("'")
              << a.getName().strref()
              << "' is an attribute the compiler sets (a pass's record); a "
                 "description cannot set it";
        return WalkResult::interrupt();
      }
    if (op == step)
      return WalkResult::advance();
    if (++numOps > DescriptionLimits::kMaxOpsPerStep) {
      op->emitError("the step has more than ")
            << DescriptionLimits::kMaxOpsPerStep
            << " operations (limit: " << DescriptionLimits::kMaxOpsPerStep
            << " operations per step; a real optimizer needs a few dozen)";
      return WalkResult::interrupt();
    }
    StringRef ns = op->getName().getDialectNamespace();
    if (ns != "zopt") {
      op->emitError("'")
            << op->getName()
            << "' cannot appear in a description: a zopt.step holds zopt "
               "operations only (states, hyperparameters, primitives, named "
               "rules, yield)";
      return WalkResult::interrupt();
    }
    if (isa<GlobalOp, ReduceSumSqOp>(op)) {
      op->emitError("'")
            << op->getName()
            << "' is introduced by the compiler (plan and decompose phases); "
               "a description cannot use it (zopt.clip_by_global_norm and "
               "zopt.unscale are the step-level transformations)";
      return WalkResult::interrupt();
    }
    return WalkResult::advance();
  });
  return failure(r.wasInterrupted());
}

/// Description-level rules that need a verified step.
static LogicalResult verifyVerifiedDescription(StepOp step) {
  // Every declaration of a hyperparameter says the same default, or none
  // at all: `zopt.hyper lr` next to `zopt.hyper lr default 0.5` reads as
  // two different defaults (the IR verifier lets a declaration without a
  // default defer to another, which the decompose phase relies on).
  Block &body = step.getBody().front();
  llvm::DenseMap<int, HyperOp> first;
  for (HyperOp h : body.getOps<HyperOp>()) {
    auto [it, inserted] = first.try_emplace(int(h.getKind()), h);
    if (!inserted && it->second.getDefaultValue() != h.getDefaultValue()) {
      InFlightDiagnostic d = h.emitOpError("conflicting defaults for "
                                           "hyperparameter '")
                             << stringifyHyperKind(h.getKind())
                             << "'; give the default once";
      d.attachNote(it->second.getLoc()) << "first declared here";
      return d;
    }
  }
  // Adam's direction reads the bias_correction slot itself: the decompose
  // phase declares it again, without a default, and an unused declaration
  // of the description is deleted with its default (found by the fuzzer:
  // `default 0.0` silently became 1). Refused until the decompose phase
  // keeps the description's declaration.
  llvm::SmallPtrSet<Operation *, 32> live;
  collectLiveOps(body, live);
  bool adamDirection = llvm::any_of(body, [&](Operation &op) {
    return isa<AdamOp, AdamDirectionOp>(op) && live.contains(&op);
  });
  for (HyperOp h : body.getOps<HyperOp>())
    if (adamDirection && h.getKind() == HyperKind::bias_correction &&
        h.getDefaultValue() && !live.contains(h))
      return h.emitOpError("the default of 'bias_correction' would be lost: "
                           "Adam's direction reads the slot through its own "
                           "declaration, without a default; set "
                           "bias_correction per group at run time instead");
  return success();
}

void mlir::zopt::lintDescription(StepOp step) {
  Block &body = step.getBody().front();
  llvm::SmallPtrSet<Operation *, 32> live;
  collectLiveOps(body, live);
  // Adam's direction reads the bias_correction slot without an operand.
  bool adamDirection = llvm::any_of(body, [&](Operation &op) {
    return isa<AdamOp, AdamDirectionOp>(op) && live.contains(&op);
  });
  for (Operation &op : body) {
    if (live.contains(&op))
      continue;
    if (isa<StateOp>(op)) {
      continue; // the verifier refuses an unused grad; others are stored
    } else if (auto h = dyn_cast<HyperOp>(op)) {
      if (adamDirection && h.getKind() == HyperKind::bias_correction)
        continue;
      h.emitWarning("hyperparameter '")
          << stringifyHyperKind(h.getKind())
          << "' never reaches a stored value: setting it has no effect";
    } else if (op.getNumResults()) {
      op.emitWarning("the result of '")
          << op.getName()
          << "' never reaches a stored value: this computation has no effect";
    }
  }
}

OwningOpRef<ModuleOp> mlir::zopt::parseDescription(llvm::SourceMgr &sm,
                                                   MLIRContext *ctx) {
  unsigned id = sm.getMainFileID();
  size_t size = sm.getMemoryBuffer(id)->getBufferSize();
  if (size > DescriptionLimits::kMaxBytes) {
    emitError(locationOf(sm, id, 0, ctx))
        << "the description is " << size << " bytes (limit: "
        << DescriptionLimits::kMaxBytes
        << " bytes, 1 MiB; a real optimizer takes a few KB)";
    return nullptr;
  }
  if (failed(checkNesting(sm, id, ctx)))
    return nullptr;
  // Parse without verifying: the step and op limits come first, so that a
  // huge input is refused before the verifier and the passes see it.
  OwningOpRef<ModuleOp> module =
      parseSourceFile<ModuleOp>(sm, ParserConfig(ctx, /*verifyAfterParse=*/false));
  if (!module || failed(verifyDescription(*module)) ||
      failed(mlir::verify(*module)))
    return nullptr;
  for (StepOp step : module->getOps<StepOp>())
    if (failed(verifyVerifiedDescription(step)))
      return nullptr;
  for (StepOp step : module->getOps<StepOp>())
    lintDescription(step);
  return module;
}

DiagnosticEngine::HandlerID mlir::zopt::registerDescriptionHints(MLIRContext *ctx) {
  return ctx->getDiagEngine().registerHandler([](Diagnostic &d) {
    if (d.getSeverity() != DiagnosticSeverity::Error)
      return failure();
    std::string msg = d.str();
    StringRef m(msg);
    // A type list that does not match the operands: the parser's message
    // for an SSA value used with another type, or an operand constraint.
    if (m.contains("expects different type than prior uses") ||
        (m.contains("op operand #") && m.contains("must be f32, bf16 or f16")))
      d.attachNote()
          << "the types after ':' are the stored types of the operands, in "
             "order: a state's declared type, f32 for a value computed by a "
             "primitive (hyperparameters are f64 and not listed); "
             "zopt.yield lists the values' types, then 'into' and the "
             "states' types";
    return failure(); // the printing handler still prints it
  });
}

bool mlir::zopt::kernelsOnGpu(ModuleOp module) {
  bool onGpu = false;
  module->walk([&](StepOp step) {
    std::optional<Placement> dev, param;
    step.walk([&](StateOp s) {
      if (s.getKind() == StateKind::param)
        param = s.getPlacement();
      else if (s.getKind() != StateKind::grad)
        dev = s.getPlacement();
    });
    onGpu |= dev.value_or(param.value_or(Placement::cpu)) == Placement::gpu;
  });
  return onGpu;
}
