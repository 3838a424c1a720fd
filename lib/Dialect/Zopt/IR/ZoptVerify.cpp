//===- ZoptVerify.cpp - the rules a zopt.step must satisfy ----------------===//
//
// Every rule here is listed, with its reason, in docs/Dialects/Zopt.md.
//
//===----------------------------------------------------------------------===//
#include "zopt/Dialect/Zopt/IR/ZoptOps.h"

#include "llvm/ADT/DenseMap.h"
#include "llvm/ADT/SmallPtrSet.h"

using namespace mlir;
using namespace mlir::zopt;

static StringRef kindName(StateKind k) { return stringifyStateKind(k); }

static bool isOptimizerState(StateKind k) {
  return k != StateKind::param && k != StateKind::grad;
}

LogicalResult StepOp::verifyRegions() {
  // Step attributes.
  int64_t stage = getZeroStage();
  if (stage < 0 || stage > 3)
    return emitOpError("zero_stage must be 0, 1, 2 or 3 (got ") << stage << ")";
  int64_t align = getAlign();
  if (align < 1 || (align & (align - 1)) != 0 || align > (1 << 20))
    return emitOpError("align must be a power of two between 1 and 1048576 "
                       "elements (got ")
           << align << ")";
  if (auto arch = getGpuArch()) {
    unsigned sm = 0;
    if (!arch->starts_with("sm_") || arch->drop_front(3).getAsInteger(10, sm) ||
        sm < 70)
      return emitOpError("gpu_arch must name a CUDA architecture sm_70 or "
                         "newer, like \"sm_90\" (got \"")
             << *arch << "\")";
  }

  Block &body = getBody().front();
  llvm::DenseMap<int, StateOp> states;
  llvm::DenseMap<int, HyperOp> hypers;
  UnscaleOp unscale;
  ClipByGlobalNormOp clip;
  for (Operation &op : body) {
    if (auto s = dyn_cast<StateOp>(op)) {
      auto [it, inserted] = states.try_emplace(int(s.getKind()), s);
      if (!inserted)
        return s.emitOpError("duplicate '")
                   .append(kindName(s.getKind()),
                           "' state; each kind is declared once per step")
                   .attachNote(it->second.getLoc())
               << "first declared here";
      if (s.getPlacement() == Placement::gpu && !getGpuArch())
        return s.emitOpError("state '")
               << kindName(s.getKind())
               << "' is placed on gpu but the step has no gpu_arch (a "
                  "CPU-only compile): place it on cpu or set gpu_arch";
    } else if (auto h = dyn_cast<HyperOp>(op)) {
      auto [it, inserted] = hypers.try_emplace(int(h.getKind()), h);
      if (!inserted && it->second.getDefaultValue() != h.getDefaultValue())
        return h.emitOpError("conflicting defaults for hyperparameter '")
               << stringifyHyperKind(h.getKind())
               << "'; give the default once";
    } else if (auto u = dyn_cast<UnscaleOp>(op)) {
      if (unscale)
        return u.emitOpError("the step already unscales the gradient; "
                             "unscale it once");
      unscale = u;
      auto src = u.getGrad().getDefiningOp<StateOp>();
      if (!src || src.getKind() != StateKind::grad)
        return u.emitOpError("unscales the grad state itself: its operand "
                             "must be the 'grad' state");
    } else if (auto c = dyn_cast<ClipByGlobalNormOp>(op)) {
      if (clip)
        return c.emitOpError("the step already clips by the global norm; "
                             "one global norm per step")
                   .attachNote(clip.getLoc())
               << "first clip here";
      clip = c;
    } else if (auto a = dyn_cast<AdamOp>(op)) {
      auto m = a.getExpAvg().getDefiningOp<StateOp>();
      auto v = a.getExpAvgSq().getDefiningOp<StateOp>();
      if (!m || m.getKind() != StateKind::exp_avg)
        return a.emitOpError("third operand must be the 'exp_avg' state");
      if (!v || v.getKind() != StateKind::exp_avg_sq)
        return a.emitOpError("fourth operand must be the 'exp_avg_sq' state");
    }
  }

  auto get = [&](StateKind k) -> StateOp {
    auto it = states.find(int(k));
    return it == states.end() ? StateOp() : it->second;
  };
  StateOp param = get(StateKind::param), grad = get(StateKind::grad);
  StateOp master = get(StateKind::master);
  if (!param)
    return emitOpError("declares no 'param' state: add "
                       "`%p = zopt.state param : <type> on <placement>`");
  if (!grad)
    return emitOpError("declares no 'grad' state: add "
                       "`%g = zopt.state grad : <type> on <placement>`");
  // Gradients have the param's type (torch's .grad) or are f32 for a
  // 16-bit param: gradients accumulated in f32 (DeepSpeed's default bf16
  // layout, Megatron's main_grad). A narrower gradient loses what
  // accumulation adds.
  if (grad.getType() != param.getType() &&
      !(grad.getType().isF32() && storageBits(param.getType()) == 16))
    return grad.emitOpError("grad is ")
           << grad.getType() << " but param is " << param.getType()
           << "; gradients have the param's type (torch keeps .grad in the "
              "param's dtype) or are f32 for a bf16/f16 param (gradients "
              "accumulated in f32)";
  if (grad.getType().isF16() && !unscale && !(*this)->hasAttr("zopt.loss_scale"))
    return grad.emitOpError(
        "f16 gradients need loss scaling: add `%gs = zopt.unscale %g : f16` "
        "and use it in place of the gradient");

  // Master rules (DeepSpeed: fp32 master for fp16/bf16 params; bf16 master
  // only for the offloaded bf16 layout).
  if (master) {
    Type mt = master.getType(), pt = param.getType();
    if (mt.isF16())
      return master.emitOpError("master must be f32 or bf16; f16 cannot hold "
                                "small updates to large weights");
    if (storageBits(mt) < storageBits(pt) || (mt.isBF16() && pt.isF16()))
      return master.emitOpError("master (")
             << mt << ") has lower precision than the param (" << pt
             << "); a master must be at least as precise";
    if (mt == pt && master.getPlacement() == param.getPlacement())
      return master.emitOpError("master duplicates the ")
             << pt << " param on the same placement; drop the master and "
                      "update the param in place";
  }
  for (StateKind k : {StateKind::exp_avg_sq, StateKind::max_exp_avg_sq})
    if (StateOp s = get(k); s && s.getType().isF16())
      return s.emitOpError("'")
             << kindName(k)
             << "' cannot be f16: squared gradients under 6e-8 flush to zero "
                "and over 65504 overflow; store it as bf16 or f32";
  if (get(StateKind::max_exp_avg_sq) && !get(StateKind::exp_avg_sq))
    return get(StateKind::max_exp_avg_sq)
        .emitOpError("'max_exp_avg_sq' (amsgrad) needs an 'exp_avg_sq' state");

  // Optimizer states live together: the fused update runs where they are.
  StateOp firstOpt;
  for (auto &kv : states) {
    StateOp s = kv.second;
    if (!isOptimizerState(s.getKind()))
      continue;
    if (!firstOpt || int(s.getKind()) < int(firstOpt.getKind()))
      firstOpt = s;
  }
  for (auto &kv : states) {
    StateOp s = kv.second;
    if (isOptimizerState(s.getKind()) &&
        s.getPlacement() != firstOpt.getPlacement())
      return s.emitOpError("'")
             << kindName(s.getKind()) << "' is on "
             << stringifyPlacement(s.getPlacement()) << " but '"
             << kindName(firstOpt.getKind()) << "' on "
             << stringifyPlacement(firstOpt.getPlacement())
             << ": the fused update runs where the optimizer states live; "
                "place them together";
  }

  // Stores.
  YieldOp yield = getYield();
  if (!yield)
    return emitOpError("must end with zopt.yield");
  llvm::DenseMap<int, Value> written;
  for (auto [i, pair] :
       llvm::enumerate(llvm::zip(yield.getValues(), yield.getTargets()))) {
    auto [value, target] = pair;
    auto s = target.getDefiningOp<StateOp>();
    if (!s)
      return yield.emitOpError("target #")
             << i << " is not a zopt.state; values are stored into states";
    if (s.getKind() == StateKind::grad)
      return yield.emitOpError("stores into 'grad', which is read-only: the "
                               "gradient belongs to the user");
    if (!written.try_emplace(int(s.getKind()), value).second)
      return yield.emitOpError("stores into '")
             << kindName(s.getKind()) << "' twice; store each state once";
  }
  for (auto &kv : states) {
    StateOp s = kv.second;
    if (s.getKind() != StateKind::grad && !written.count(kv.first))
      return s.emitOpError("state '")
             << kindName(s.getKind())
             << "' is never written: yield its new value (an optimizer state "
                "that never changes is a mistake)";
  }
  if (master && written.lookup(int(StateKind::param)) !=
                    written.lookup(int(StateKind::master)))
    return yield.emitOpError(
        "with a master, the param is the rounded master: yield the master's "
        "new value into 'param' too");
  return success();
}
