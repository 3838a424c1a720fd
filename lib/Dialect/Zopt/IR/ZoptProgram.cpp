//===- ZoptProgram.cpp - rules of a zopt.program --------------------------===//
//
// A zopt.program is made by the plan phase, but it is also what a reader
// sees with --compile-to=plan and what lit tests and hand-written programs
// feed back in, so its shape is checked: the runtime executes it as written
// (abi.h "The step program"), on every rank.
//
//===----------------------------------------------------------------------===//
#include "zopt/Dialect/Zopt/IR/ZoptOps.h"

using namespace mlir;
using namespace mlir::zopt;

static bool isStorageType(Type t) { return t.isF32() || t.isBF16() || t.isF16(); }

LogicalResult ProgramOp::verifyRegions() {
  int updates = 0, norms = 0, partials = 0, prepares = 0, finishes = 0;
  bool seenUpdate = false, seenPartials = false, seenNorm = false,
       seenPrepare = false, seenFinish = false;
  (void)norms;
  for (Operation &op : getBody().front()) {
    if (seenFinish)
      return op.emitOpError("follows zopt.finish, which ends the program");
    if (auto c = dyn_cast<CopyOp>(op)) {
      if (c.getSrc() == c.getDst())
        return c.emitOpError("copies from ")
               << stringifyPlacement(c.getSrc()) << " to itself";
      if (!isStorageType(c.getType()))
        return c.emitOpError("type must be f32, bf16 or f16");
    } else if (auto r = dyn_cast<ReduceScatterOp>(op)) {
      if (r.getState() != StateKind::grad)
        return r.emitOpError("reduces the grad only (got '")
               << stringifyStateKind(r.getState()) << "')";
      if (!isStorageType(r.getType()) || !r.getAccumulate().isF32())
        return r.emitOpError(
            "moves f32, bf16 or f16 values and accumulates in f32");
      if (seenPartials || seenUpdate)
        return r.emitOpError("must come before the norm and the update");
    } else if (auto g = dyn_cast<AllGatherOp>(op)) {
      if (g.getState() != StateKind::grad && g.getState() != StateKind::param)
        return g.emitOpError("gathers the grad or the param only");
      if (!isStorageType(g.getType()))
        return g.emitOpError("type must be f32, bf16 or f16");
      if (g.getState() == StateKind::param && !seenUpdate)
        return g.emitOpError("gathers the param before the update wrote it");
    } else if (isa<NormPartialsOp>(op)) {
      ++partials;
      seenPartials = true;
      if (!seenPrepare)
        return op.emitOpError("needs zopt.prepare before it (the sum of "
                              "squares reads the coefficient table)");
      if (seenUpdate)
        return op.emitOpError("must come before the update");
    } else if (isa<NormOp>(op)) {
      ++norms;
      if (!seenPartials)
        return op.emitOpError("needs zopt.norm_partials before it");
      seenNorm = true;
    } else if (isa<PrepareOp>(op)) {
      ++prepares;
      if (seenPartials)
        return op.emitOpError("must come before zopt.norm_partials (zopt.norm "
                              "recomputes the table with the clip "
                              "coefficient)");
      seenPrepare = true;
    } else if (auto u = dyn_cast<UpdateOp>(op)) {
      ++updates;
      if (!seenPrepare)
        return u.emitOpError("needs zopt.prepare before it");
      if (seenPartials && !seenNorm)
        return u.emitOpError("needs zopt.norm after zopt.norm_partials");
      seenUpdate = true;
    } else if (isa<FinishOp>(op)) {
      ++finishes;
      seenFinish = true;
    } else {
      return op.emitOpError("is not a step-program op");
    }
  }
  if (updates != 1 || prepares != 1 || finishes != 1 || partials > 1 ||
      norms != partials)
    return emitOpError("needs exactly one zopt.prepare, zopt.update and "
                       "zopt.finish, and at most one zopt.norm_partials / "
                       "zopt.norm pair");
  return success();
}
