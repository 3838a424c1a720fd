//===- Decompose.cpp - named rules and primitives into per-element math ---===//
//
// One rewrite per op, in two sweeps: named rules into primitives, then
// primitives into arith/math. Per-element math is f32; coefficients that only
// depend on hyperparameters and the step count are built in f64 and reach
// the element math through one arith.truncf each (the fuse phase moves them
// into the per-group prepare function).
//
//===----------------------------------------------------------------------===//
#include "Builders.h"
#include "zopt/Dialect/Zopt/Transforms/Passes.h"

#include "llvm/ADT/TypeSwitch.h"

namespace mlir::zopt {
#define GEN_PASS_DEF_ZOPTDECOMPOSE
#include "zopt/Dialect/Zopt/Transforms/Passes.h.inc"
} // namespace mlir::zopt

using namespace mlir;
using namespace mlir::zopt;

namespace {

/// Expands zopt.adam into primitives.
static void expandAdam(AdamOp op) {
  OpBuilder b(op);
  Location loc = op.getLoc();
  Type f32 = b.getF32Type();
  Value p = op.getParam(), g = op.getGrad();
  if (op.getDecoupled())
    p = DecoupledDecayOp::create(b, loc, f32, p, op.getLr(), op.getWeightDecay());
  else
    g = L2DecayOp::create(b, loc, f32, g, p, op.getWeightDecay());
  Value m1 = EmaOp::create(b, loc, f32, op.getExpAvg(), g, op.getBeta1());
  Value v1 = EmaSqOp::create(b, loc, f32, op.getExpAvgSq(), g, op.getBeta2());
  Value u = AdamDirectionOp::create(b, loc, f32, m1, v1, op.getBeta1(),
                                    op.getBeta2(), op.getEps());
  Value p1 = ApplyOp::create(b, loc, f32, p, u, op.getLr());
  op.replaceAllUsesWith(ValueRange{p1, m1, v1});
  op.erase();
}

/// Expands one primitive into arith/math; returns false if `op` is none.
static bool expandPrimitive(Operation *op) {
  OpBuilder b(op);
  ElemBuilder a{b, op->getLoc()};
  auto one64 = [&] { return a.f64(1.0); };
  auto stepCount = [&] {
    return GlobalOp::create(b, op->getLoc(), b.getF64Type(), GlobalKind::step).getResult();
  };
  Value r =
      llvm::TypeSwitch<Operation *, Value>(op)
          .Case([&](L2DecayOp o) { // g + wd * p
            return a.add(a.toF32(o.getLhs()),
                         a.mul(a.coeff(o.getHyper()), a.toF32(o.getRhs())));
          })
          .Case([&](DecoupledDecayOp o) { // p * (1 - lr * wd)
            Value k = a.sub(one64(), a.mul(o.getLr(), o.getWeightDecay()));
            return a.mul(a.toF32(o.getParam()), a.coeff(k));
          })
          .Case([&](EmaOp o) { // b * m + (1 - b) * x
            Value c = a.sub(one64(), o.getHyper());
            return a.add(a.mul(a.coeff(o.getHyper()), a.toF32(o.getLhs())),
                         a.mul(a.coeff(c), a.toF32(o.getRhs())));
          })
          .Case([&](EmaSqOp o) { // b * v + (1 - b) * x * x
            Value c = a.sub(one64(), o.getHyper());
            Value x = a.toF32(o.getRhs());
            return a.add(a.mul(a.coeff(o.getHyper()), a.toF32(o.getLhs())),
                         a.mul(a.mul(a.coeff(c), x), x));
          })
          .Case([&](NesterovOp o) { // g + mu * buf
            return a.add(a.toF32(o.getLhs()),
                         a.mul(a.coeff(o.getHyper()), a.toF32(o.getRhs())));
          })
          .Case([&](ApplyOp o) { // p - lr * u
            return a.sub(a.toF32(o.getLhs()),
                         a.mul(a.coeff(o.getHyper()), a.toF32(o.getRhs())));
          })
          .Case([&](MaxOp o) {
            return arith::MaximumFOp::create(b, o.getLoc(), a.toF32(o.getLhs()),
                                             a.toF32(o.getRhs()))
                .getResult();
          })
          .Case([&](SignOp o) { // torch.sign: NaN and +-0 pass through
            Value x = a.toF32(o.getOperand());
            Type f32 = b.getF32Type();
            Value zero = a.cst(0.0, f32);
            Value neg = a.select(a.cmp(arith::CmpFPredicate::OLT, x, zero),
                                 a.cst(-1.0, f32), x);
            return a.select(a.cmp(arith::CmpFPredicate::OGT, x, zero),
                            a.cst(1.0, f32), neg);
          })
          .Case([&](AdamDirectionOp o) {
            // (m / bc1) / (sqrt(v) / sqrt(bc2) + eps), bias correction per
            // group: bc = 1 - beta^t when the bias_correction slot is set.
            Value t = stepCount();
            Value flag = HyperOp::create(b, o.getLoc(), b.getF64Type(),
                                         HyperKind::bias_correction, FloatAttr());
            Value on = a.cmp(arith::CmpFPredicate::ONE, flag, a.f64(0.0));
            Value bc1 = a.select(
                on, a.sub(one64(), a.pow(o.getBeta1(), t)), one64());
            Value bc2s = a.select(
                on, a.sqrt(a.sub(one64(), a.pow(o.getBeta2(), t))), one64());
            // Both reciprocals are per-group coefficients, so the element
            // math has one division (the divider is the scarce unit).
            Value invBc1 = a.div(one64(), bc1);
            Value invBc2s = a.div(one64(), bc2s);
            Value mhat = a.mul(a.toF32(o.getExpAvg()), a.coeff(invBc1));
            Value den = a.add(a.mul(a.sqrt(a.toF32(o.getExpAvgSq())),
                                    a.coeff(invBc2s)),
                              a.coeff(o.getEps()));
            return a.div(mhat, den);
          })
          .Case([&](MomentumOp o) {
            // t == 1: buf = g; else buf = mu * buf + (1 - dampening) * g.
            // momentum == 0 is plain SGD in torch (no buffer, dampening
            // ignored): buf = g as well.
            Value first = a.cmp(arith::CmpFPredicate::OEQ, stepCount(), one64());
            Value noMomentum =
                a.cmp(arith::CmpFPredicate::OEQ, o.getMomentum(), a.f64(0.0));
            Value plain = arith::OrIOp::create(b, o.getLoc(), first, noMomentum);
            Value ca = a.select(first, a.f64(0.0), o.getMomentum());
            Value cb =
                a.select(plain, one64(), a.sub(one64(), o.getDampening()));
            return a.add(a.mul(a.coeff(ca), a.toF32(o.getBuf())),
                         a.mul(a.coeff(cb), a.toF32(o.getGrad())));
          })
          .Default([](Operation *) { return Value(); });
  if (!r)
    return false;
  op->getResult(0).replaceAllUsesWith(r);
  op->erase();
  return true;
}

struct ZoptDecompose
    : public mlir::zopt::impl::ZoptDecomposeBase<ZoptDecompose> {
  void runOnOperation() override {
    SmallVector<AdamOp> rules;
    getOperation().walk([&](AdamOp op) { rules.push_back(op); });
    for (AdamOp op : rules)
      expandAdam(op);
    numRules += rules.size();

    SmallVector<Operation *> prims;
    getOperation().walk([&](Operation *op) {
      if (isa<L2DecayOp, DecoupledDecayOp, EmaOp, EmaSqOp, NesterovOp, ApplyOp,
              MaxOp, SignOp, AdamDirectionOp, MomentumOp>(op))
        prims.push_back(op);
    });
    // What the rule is, for the descriptor's flags (zopt-fuse): the ops
    // that say it are expanded below.
    for (Operation *op : prims) {
      StringRef mark = isa<NesterovOp>(op)         ? "zopt.nesterov"
                       : isa<DecoupledDecayOp>(op) ? "zopt.decoupled_decay"
                                                   : "";
      if (auto step = op->getParentOfType<StepOp>(); step && !mark.empty())
        step->setAttr(mark, UnitAttr::get(op->getContext()));
    }
    for (Operation *op : prims)
      numPrimitives += expandPrimitive(op);
  }
};

} // namespace
