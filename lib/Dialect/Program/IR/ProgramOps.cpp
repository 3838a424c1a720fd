//===- ProgramOps.cpp - the rules of a zprog.program ----------------------===//
//
// A zprog.program is made by the plan phase, but it is also what a reader
// sees with --compile-to=plan and what lit tests and hand-written programs
// feed back in, so its shape is checked: the runtime executes it as written
// (abi.h "The step program"), on every rank, and relies on the order below
// (runtime/src/exec/exec.cpp: run_begin runs the ops up to the NORM, which
// decides the skip and the clip coefficient, run_end the rest; an UPDATE or
// an `unless_skipped` op is not run on a skipped step). Every rule is listed
// with its reason in docs/Dialects/Program.md. The rules that need the
// step's descriptor (dtypes, partitioned states, flags) are checked where
// the program meets it, in zopt-emit-descriptor.
//
//===----------------------------------------------------------------------===//
#include "zopt/Dialect/Program/IR/ProgramOps.h"

using namespace mlir;
using namespace mlir::zprog;

static bool isStorageType(Type t) { return t.isF32() || t.isBF16() || t.isF16(); }

UpdateOp ProgramOp::getUpdate() {
  for (Operation &op : getBody().front())
    if (auto u = dyn_cast<UpdateOp>(op))
      return u;
  return {};
}

namespace {
/// What the ops before the one being checked did.
struct Seen {
  Operation *reduce = nullptr, *gatherGrad = nullptr, *gatherParam = nullptr;
  Operation *prepare = nullptr, *partials = nullptr, *norm = nullptr;
  Operation *update = nullptr, *finish = nullptr;
  bool nonCopy = false; // an op other than a copy ran
};
} // namespace

/// The op that must come `where` `op`, named by its mnemonic.
static InFlightDiagnostic needs(Operation *op, StringRef what,
                               StringRef where = "before it") {
  return op->emitOpError("needs zprog.") << what << " " << where;
}

static LogicalResult duplicate(Operation *op, Operation *first) {
  InFlightDiagnostic d = op->emitOpError("appears twice in the program");
  d.attachNote(first->getLoc()) << "first here";
  return d;
}

LogicalResult ProgramOp::verifyRegions() {
  Block &body = getBody().front();
  UpdateOp update = getUpdate();
  if (!update)
    return emitOpError("has no zprog.update (a program updates once)");
  // Where the update runs: every op but a copy runs there too.
  const Placement device = update.getOn();
  Seen seen;
  auto sameDevice = [&](Operation *op, Placement on) -> LogicalResult {
    if (on == device)
      return success();
    return op->emitOpError("runs on ")
           << zopt::stringifyPlacement(on)
           << ", but the update runs on " << zopt::stringifyPlacement(device)
           << " (only copies move between placements)";
  };
  // Ops that read the gradient (the norm's partials and the update) read
  // the reduced one: a reduce_scatter before them and, over every element
  // (`all`), the all_gather of the reduced grad too.
  auto readsGrad = [&](Operation *op, Range range) -> LogicalResult {
    if (!seen.reduce)
      return needs(op, "reduce_scatter of the grad",
                   "before it (the gradient is reduced across ranks before "
                   "it is read; on one rank it does nothing)");
    if (range == Range::all && !seen.gatherGrad)
      return needs(op, "all_gather of the grad",
                   "before it: it covers every element, and after the "
                   "reduce_scatter each rank holds only its shards of the "
                   "reduced gradient");
    return success();
  };

  for (Operation &op : body) {
    if (seen.finish)
      return op.emitOpError("follows zprog.finish, which ends the program");
    auto unlessSkipped = [&](bool flag) -> LogicalResult {
      if (flag && !seen.update)
        return op.emitOpError("is 'unless_skipped' before the update; the "
                              "skip is decided by the norm before the update, "
                              "so only ops after it can depend on it");
      return success();
    };
    if (auto c = dyn_cast<CopyOp>(op)) {
      if (c.getSrc() == c.getDst())
        return c.emitOpError("copies from ")
               << zopt::stringifyPlacement(c.getSrc()) << " to itself";
      if (!isStorageType(c.getType()))
        return c.emitOpError("type must be f32, bf16 or f16");
      if (c.getState() != StateKind::grad && c.getState() != StateKind::param)
        return c.emitOpError("copies the grad or the param only (the "
                             "runtime stages them for an offloaded update)");
      if (c.getDst() == device) {
        // In: the update (and the reduction before it) read the staged copy.
        if (seen.nonCopy)
          return c.emitOpError("copies to the update's placement after "
                               "other ops; copies in come first");
      } else { // out of the update's placement (there are two)
        if (c.getState() == StateKind::grad)
          return c.emitOpError("copies the grad back; the grad is read, "
                               "never written");
        if (!seen.update)
          return c.emitOpError("copies the ")
                 << zopt::stringifyStateKind(c.getState())
                 << " out before the update wrote it";
      }
      if (failed(unlessSkipped(c.getUnlessSkipped())))
        return failure();
      continue;
    }
    seen.nonCopy = true;
    if (auto r = dyn_cast<ReduceScatterOp>(op)) {
      if (r.getState() != StateKind::grad)
        return r.emitOpError("reduces the grad only (got '")
               << zopt::stringifyStateKind(r.getState()) << "')";
      if (!isStorageType(r.getType()) || !r.getAccumulate().isF32())
        return r.emitOpError(
            "moves f32, bf16 or f16 values and accumulates in f32");
      if (seen.partials || seen.update)
        return r.emitOpError("must come before the norm and the update");
      if (seen.reduce)
        return duplicate(r, seen.reduce);
      seen.reduce = r;
    } else if (auto g = dyn_cast<AllGatherOp>(op)) {
      if (!isStorageType(g.getType()))
        return g.emitOpError("type must be f32, bf16 or f16");
      if (g.getState() == StateKind::grad) {
        if (!seen.reduce)
          return needs(g, "reduce_scatter of the grad",
                       "before it (it gathers the reduced shards)");
        if (seen.partials || seen.update)
          return g.emitOpError(
              "gathers the grad after the norm or the update read it");
        if (seen.gatherGrad)
          return duplicate(g, seen.gatherGrad);
        seen.gatherGrad = g;
        if (failed(unlessSkipped(g.getUnlessSkipped())))
          return failure();
      } else if (g.getState() == StateKind::param) {
        if (!seen.update)
          return g.emitOpError("gathers the param before the update wrote it");
        if (seen.gatherParam)
          return duplicate(g, seen.gatherParam);
        seen.gatherParam = g;
      } else {
        return g.emitOpError("gathers the grad or the param only");
      }
    } else if (auto p = dyn_cast<PrepareOp>(op)) {
      if (failed(sameDevice(p, p.getOn())))
        return failure();
      if (seen.prepare)
        return duplicate(p, seen.prepare);
      if (seen.partials)
        return p.emitOpError("must come before zprog.norm_partials "
                             "(zprog.norm recomputes the table with the clip "
                             "coefficient)");
      seen.prepare = p;
    } else if (auto np = dyn_cast<NormPartialsOp>(op)) {
      if (failed(sameDevice(np, np.getOn())))
        return failure();
      if (seen.partials)
        return duplicate(np, seen.partials);
      if (!seen.prepare)
        return op.emitOpError("needs zprog.prepare before it (the sum of "
                              "squares reads the coefficient table)");
      if (seen.update)
        return op.emitOpError("must come before the update");
      if (failed(readsGrad(np, np.getRange())))
        return failure();
      seen.partials = np;
    } else if (isa<NormOp>(op)) {
      if (seen.norm)
        return duplicate(&op, seen.norm);
      if (!seen.partials)
        return op.emitOpError("needs zprog.norm_partials before it");
      seen.norm = &op;
    } else if (auto u = dyn_cast<UpdateOp>(op)) {
      if (seen.update)
        return duplicate(u, seen.update);
      if (!seen.prepare)
        return u.emitOpError("needs zprog.prepare before it");
      if (seen.partials && !seen.norm)
        return u.emitOpError("needs zprog.norm after zprog.norm_partials");
      if (failed(readsGrad(u, u.getRange())))
        return failure();
      seen.update = u;
    } else if (auto f = dyn_cast<FinishOp>(op)) {
      if (failed(sameDevice(f, f.getOn())))
        return failure();
      seen.finish = f;
    } else {
      return op.emitOpError("is not a step-program op");
    }
  }
  // (norm_partials without a norm is caught at the update, which follows.)
  if (!seen.finish)
    return emitOpError("does not end with zprog.finish (the step's "
                       "bookkeeping)");
  return success();
}

#define GET_OP_CLASSES
#include "zopt/Dialect/Program/IR/Program.cpp.inc"
