//===- Plan.cpp - placement, partition, global reductions, step program ---===//
#include "Builders.h"
#include "zopt/Dialect/Zopt/Transforms/Passes.h"

namespace mlir::zopt {
#define GEN_PASS_DEF_ZOPTPLAN
#include "zopt/Dialect/Zopt/Transforms/Passes.h.inc"
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

/// Whether the update reads state `s` (any use but being a yield target).
static bool updateReads(StepOp step, StateOp s) {
  YieldOp yield = step.getYield();
  return llvm::any_of(s->getUses(), [&](OpOperand &u) {
    return u.getOwner() != yield.getOperation() ||
           u.getOperandNumber() < yield.getValues().size();
  });
}

/// The step program (abi.h "The step program", the zprog dialect): what one
/// step does on every rank, in order, decided by the ZeRO stage, the
/// placements, clipping and loss scaling.
///   stage 0: every rank holds every state and updates every element; the
///            grads are reduced and gathered (DDP's all-reduce).
///   stage 1: the optimizer states are sharded; grads reduced and gathered
///            (every rank keeps the full mean gradient, as DeepSpeed's
///            ZeRO-1 does); each rank updates its shards; params gathered.
///   stage 2: as 1, but the grads are only reduced into their owners' shards.
///   stage 3: as 2, and the params stay sharded (no gather: the forward
///            gathers them on demand).
/// Offloaded steps (param and grad on the GPU, the update on the CPU) copy
/// the grads (and the params, when the update reads them) to host staging
/// first and the new params back last.
static void buildProgram(StepOp step, Placement device, int64_t stage) {
  MLIRContext *ctx = step.getContext();
  StateOp param = step.getState(StateKind::param);
  StateOp grad = step.getState(StateKind::grad);
  Type pt = param.getType(), gt = grad.getType();
  auto where = PlacementAttr::get(ctx, device);
  bool norm = step->hasAttr("zopt.max_norm") || step->hasAttr("zopt.loss_scale");
  bool offload = device == Placement::cpu && param.getPlacement() == Placement::gpu;
  auto range = zprog::RangeAttr::get(
      ctx, stage == 0 ? zprog::Range::all : zprog::Range::owned);

  OpBuilder b(ctx);
  b.setInsertionPointAfter(step);
  auto prog = zprog::ProgramOp::create(b, step.getLoc(), step.getSymName());
  prog.getBody().push_back(new Block());
  b.setInsertionPointToStart(&prog.getBody().front());
  Location loc = step.getLoc();
  auto kindAttr = [&](StateKind k) { return StateKindAttr::get(ctx, k); };
  auto gpu = PlacementAttr::get(ctx, Placement::gpu);
  auto cpu = PlacementAttr::get(ctx, Placement::cpu);
  if (offload) {
    zprog::CopyOp::create(b, loc, kindAttr(StateKind::grad), TypeAttr::get(gt),
                          gpu, cpu, nullptr);
    if (updateReads(step, param))
      zprog::CopyOp::create(b, loc, kindAttr(StateKind::param),
                            TypeAttr::get(pt), gpu, cpu, nullptr);
  }
  zprog::ReduceScatterOp::create(b, loc, kindAttr(StateKind::grad),
                                 TypeAttr::get(gt),
                                 TypeAttr::get(b.getF32Type()));
  if (stage <= 1)
    zprog::AllGatherOp::create(b, loc, kindAttr(StateKind::grad),
                               TypeAttr::get(gt), nullptr);
  zprog::PrepareOp::create(b, loc, where);
  if (norm) {
    zprog::NormPartialsOp::create(b, loc, range, where);
    zprog::NormOp::create(b, loc);
  }
  zprog::UpdateOp::create(b, loc, range, where);
  if (stage == 1 || stage == 2)
    zprog::AllGatherOp::create(b, loc, kindAttr(StateKind::param),
                               TypeAttr::get(pt), b.getUnitAttr());
  if (offload)
    zprog::CopyOp::create(b, loc, kindAttr(StateKind::param),
                          TypeAttr::get(pt), cpu, gpu, b.getUnitAttr());
  zprog::FinishOp::create(b, loc, where);
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

  // The gradient scale: every read of the grad becomes `g * grad_scale`
  // (1 / (S * D): loss scale and divisor, the world size by default, so the
  // reduced gradient is the ranks' mean). Multiplying by 1.0 is exact, so a
  // one-rank step without loss scaling computes the same bits as before.
  StateOp gradState = step.getState(StateKind::grad);
  UnscaleOp unscale;
  ClipByGlobalNormOp clip;
  for (Operation &op : body) {
    if (auto u = dyn_cast<UnscaleOp>(op))
      unscale = u;
    if (auto c = dyn_cast<ClipByGlobalNormOp>(op))
      clip = c;
  }
  if (unscale && unscale.getGrad() != gradState.getResult())
    return unscale.emitOpError("must take the grad state (the loss-scaled "
                               "gradient) as its operand");
  {
    YieldOp yield = step.getYield();
    OpBuilder b(ctx);
    b.setInsertionPointAfter(gradState);
    Value scaled = scaleByGlobal(b, gradState.getLoc(), gradState.getResult(),
                                 GlobalKind::grad_scale);
    Operation *mul = scaled.getDefiningOp();
    Operation *widen = mul->getOperand(0).getDefiningOp(); // null for f32
    // After decompose, a narrow grad is only read through arith.extf: those
    // widenings become the scaled value itself.
    for (OpOperand &use : llvm::make_early_inc_range(gradState->getUses())) {
      Operation *owner = use.getOwner();
      if (owner == mul || owner == widen)
        continue;
      if (owner == yield.getOperation() &&
          use.getOperandNumber() >= yield.getValues().size())
        continue; // a yield target
      if (auto ext = dyn_cast<arith::ExtFOp>(owner);
          ext && ext.getType().isF32()) {
        ext.replaceAllUsesWith(scaled);
        ext.erase();
        continue;
      }
      use.set(scaled);
    }
  }

  // Global reductions: one sum of squares over the value clipping / the
  // non-finite check is taken of.
  if (unscale) {
    Value r = unscale.getGrad(); // now g * grad_scale: the division is done
    if (!clip) { // the non-finite check alone
      OpBuilder b(unscale);
      ReduceSumSqOp::create(b, unscale.getLoc(), r);
    }
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

  buildProgram(step, device, stage);
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
