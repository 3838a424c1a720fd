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

/// The attributes an op's syntax gives (its assembly format binds them):
/// restating one in the op's attribute dictionary would silently win over
/// the syntax (`zopt.clip_by_global_norm %g max 1.0 {max_norm = 100.0}`
/// clipped at 100: the property test's finding F2).
static ArrayRef<StringRef> syntaxAttributes(StringRef opName) {
  static const StringRef step[] = {"sym_name"};
  static const StringRef state[] = {"kind", "placement", "rounding", "remainder",
                                    "kahan"};
  static const StringRef hyper[] = {"kind", "default_value"};
  static const StringRef global[] = {"kind"};
  static const StringRef clip[] = {"max_norm"};
  if (opName == "zopt.step") return step;
  if (opName == "zopt.state") return state;
  if (opName == "zopt.hyper") return hyper;
  if (opName == "zopt.global") return global;
  if (opName == "zopt.clip_by_global_norm") return clip;
  return {};
}

/// Offset of the `}` closing the `{` at `open`, skipping strings and nested
/// brackets; npos if none.
static size_t closingBrace(StringRef t, size_t open) {
  int depth = 0;
  for (size_t i = open; i < t.size(); ++i) {
    char c = t[i];
    if (c == '"') {
      for (++i; i < t.size() && t[i] != '"' && t[i] != '\n'; ++i)
        if (t[i] == '\\')
          ++i;
    } else if (c == '{' || c == '[' || c == '(' || c == '<') {
      ++depth;
    } else if (c == '}' || c == ']' || c == ')' || (c == '>' && depth > 1)) {
      if (--depth == 0)
        return c == '}' ? i : StringRef::npos;
    }
  }
  return StringRef::npos;
}

/// Refuses an attribute dictionary that restates an attribute the op's
/// syntax gives. The text of each op runs from its location to the next
/// op's; its dictionary is the first top-level `{` in it (for zopt.step:
/// the one after the `attributes` keyword, before the body).
static LogicalResult checkRestatedAttributes(ModuleOp module,
                                             llvm::SourceMgr &sm, unsigned id,
                                             MLIRContext *ctx) {
  StringRef text = sm.getMemoryBuffer(id)->getBuffer();
  std::vector<std::pair<Operation *, size_t>> ops; // (op, offset), in order
  module->walk<WalkOrder::PreOrder>([&](Operation *op) {
    if (op == module.getOperation())
      return;
    auto loc = dyn_cast<FileLineColLoc>(op->getLoc());
    if (!loc)
      return;
    llvm::SMLoc at = sm.FindLocForLineAndColumn(id, loc.getLine(), loc.getColumn());
    if (at.isValid())
      ops.push_back({op, size_t(at.getPointer() - text.data())});
  });
  for (size_t k = 0; k < ops.size(); ++k) {
    Operation *op = ops[k].first;
    ArrayRef<StringRef> bound = syntaxAttributes(op->getName().getStringRef());
    if (bound.empty())
      continue;
    size_t begin = ops[k].second;
    size_t end = k + 1 < ops.size() && ops[k + 1].second > begin ? ops[k + 1].second
                                                                  : text.size();
    StringRef seg = text.slice(begin, end);
    size_t open = StringRef::npos;
    if (isa<StepOp>(op)) {
      // `zopt.step @name attributes {...} {body`: a dictionary only after
      // the keyword, which comes before the body's brace.
      size_t body = seg.find('{'), kw = seg.find(" attributes");
      if (kw != StringRef::npos && kw < body)
        open = seg.find('{', kw);
    } else {
      // The first `{` outside strings and <...> (types and enum
      // attributes carry no braces).
      int angle = 0;
      for (size_t i = 0; i < seg.size() && open == StringRef::npos; ++i) {
        char c = seg[i];
        if (c == '"') {
          for (++i; i < seg.size() && seg[i] != '"' && seg[i] != '\n'; ++i)
            if (seg[i] == '\\')
              ++i;
        } else if (c == '/' && i + 1 < seg.size() && seg[i + 1] == '/') {
          while (i < seg.size() && seg[i] != '\n')
            ++i;
        } else if (c == '<') {
          ++angle;
        } else if (c == '>' && angle) {
          --angle;
        } else if (c == '{' && !angle) {
          open = i;
        }
      }
    }
    if (open == StringRef::npos)
      continue;
    size_t close = closingBrace(seg, open);
    if (close == StringRef::npos)
      continue; // the parser accepted it: not a dictionary we understand
    // The keys at the dictionary's top level: `key = value` or `key`.
    StringRef dict = seg.slice(open + 1, close);
    size_t i = 0;
    while (i < dict.size()) {
      while (i < dict.size() && (isspace((unsigned char)dict[i]) || dict[i] == ','))
        ++i;
      size_t kb = i;
      if (i < dict.size() && dict[i] == '"') {
        for (++i; i < dict.size() && dict[i] != '"'; ++i)
          if (dict[i] == '\\')
            ++i;
        ++i;
      } else {
        while (i < dict.size() && (isalnum((unsigned char)dict[i]) || dict[i] == '_' ||
                                   dict[i] == '.' || dict[i] == '$' || dict[i] == '-'))
          ++i;
      }
      StringRef key = dict.slice(kb, i).trim('"');
      if (llvm::is_contained(bound, key)) {
        emitError(locationOf(sm, id, begin + open + 1 + kb, ctx))
            << "'" << op->getName() << "' gets '" << key
            << "' from its syntax; restating it in the attribute dictionary "
               "would override what the syntax says: remove it";
        return failure();
      }
      // Skip the value, up to the next top-level comma.
      int depth = 0;
      for (; i < dict.size(); ++i) {
        char c = dict[i];
        if (c == '"') {
          for (++i; i < dict.size() && dict[i] != '"'; ++i)
            if (dict[i] == '\\')
              ++i;
        } else if (c == '{' || c == '[' || c == '(' || c == '<') {
          ++depth;
        } else if (c == '}' || c == ']' || c == ')' || c == '>') {
          --depth;
        } else if (c == ',' && depth == 0) {
          break;
        }
      }
    }
  }
  return success();
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
      failed(checkRestatedAttributes(*module, sm, id, ctx)) ||
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
