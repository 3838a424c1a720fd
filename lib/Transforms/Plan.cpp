//===- Plan.cpp - placement, partition and global reductions --------------===//
#include "Builders.h"
#include "zopt/Transforms/Passes.h"

namespace mlir::zopt {
#define GEN_PASS_DEF_ZOPTPLAN
#include "zopt/Transforms/Passes.h.inc"
} // namespace mlir::zopt

using namespace mlir;
using namespace mlir::zopt;

namespace {

/// Multiplies `x` (widened to f32) by the step-level runtime scalar `kind`.
static Value scaleByGlobal(OpBuilder &b, Location loc, Value x,
                           GlobalKind kind) {
  ElemBuilder a{b, loc};
  Value s = GlobalOp::create(b, loc, b.getF64Type(), kind);
  return a.mul(a.toF32(x), a.coeff(s));
}

static LogicalResult planStep(StepOp step) {
  MLIRContext *ctx = step.getContext();
  Block &body = step.getBody().front();

  // Placement: the fused update runs where the optimizer states live (the
  // verifier made them agree); with no optimizer state, where the param is.
  Placement device = step.getState(StateKind::param).getPlacement();
  for (Operation &op : body)
    if (auto s = dyn_cast<StateOp>(op);
        s && s.getKind() != StateKind::param && s.getKind() != StateKind::grad)
      device = s.getPlacement();
  // GPU-placed states need gpu_arch (checked by the verifier): the kernels
  // are then compiled for the device by convert-zk-to-gpu.
  step->setAttr("zopt.device", PlacementAttr::get(ctx, device));

  // Partition: flat per-group buffers, each tensor's segment padded to
  // `align` elements; under ZeRO stage >= 1 rank r of W owns the contiguous
  // r-th slice of every optimizer-state buffer (stage 2 adds the grads,
  // stage 3 the params). Recorded for the runtime and for readers.
  int64_t stage = step.getZeroStage();
  SmallVector<Attribute> partitioned;
  auto addPart = [&](StateKind k) {
    partitioned.push_back(StringAttr::get(ctx, stringifyStateKind(k)));
  };
  if (stage >= 1)
    for (StateKind k : {StateKind::master, StateKind::exp_avg,
                        StateKind::exp_avg_sq, StateKind::max_exp_avg_sq,
                        StateKind::momentum_buffer})
      if (step.getState(k))
        addPart(k);
  if (stage >= 2)
    addPart(StateKind::grad);
  if (stage >= 3)
    addPart(StateKind::param);
  step->setAttr("zopt.partitioned", ArrayAttr::get(ctx, partitioned));

  // Slots: param, grad, then the runtime-owned states by kind.
  SmallVector<StateOp> states;
  for (Operation &op : body)
    if (auto s = dyn_cast<StateOp>(op))
      states.push_back(s);
  llvm::sort(states, [](StateOp x, StateOp y) { // kinds are unique
    return int(x.getKind()) < int(y.getKind());
  });
  for (auto [i, s] : llvm::enumerate(states))
    s->setAttr("zopt.slot", IntegerAttr::get(IntegerType::get(ctx, 64), i));

  // Global reductions.
  UnscaleOp unscale;
  ClipByGlobalNormOp clip;
  for (Operation &op : body) {
    if (auto u = dyn_cast<UnscaleOp>(op))
      unscale = u;
    if (auto c = dyn_cast<ClipByGlobalNormOp>(op))
      clip = c;
  }
  if (unscale) {
    OpBuilder b(unscale);
    Value r = scaleByGlobal(b, unscale.getLoc(), unscale.getGrad(),
                            GlobalKind::inv_loss_scale);
    if (!clip) // the non-finite check alone
      ReduceSumSqOp::create(b, r.getLoc(), r);
    unscale.replaceAllUsesWith(r);
    unscale.erase();
    step->setAttr("zopt.loss_scale", UnitAttr::get(ctx));
  }
  if (clip) {
    OpBuilder b(clip);
    Value x = ElemBuilder{b, clip.getLoc()}.toF32(clip.getOperand());
    ReduceSumSqOp::create(b, clip.getLoc(), x);
    Value r = scaleByGlobal(b, clip.getLoc(), x, GlobalKind::clip_coef);
    step->setAttr("zopt.max_norm", clip.getMaxNormAttr());
    clip.replaceAllUsesWith(r);
    clip.erase();
  }
  return success();
}

struct ZoptPlan : public mlir::zopt::impl::ZoptPlanBase<ZoptPlan> {
  void runOnOperation() override {
    for (auto step : llvm::make_early_inc_range(getOperation().getOps<StepOp>()))
      if (failed(planStep(step)))
        return signalPassFailure();
  }
};

} // namespace
