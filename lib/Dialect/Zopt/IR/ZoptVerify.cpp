//===- ZoptVerify.cpp - the rules a zopt.step must satisfy ----------------===//
//
// Every rule here is listed, with its reason, in docs/Dialects/Zopt.md.
//
//===----------------------------------------------------------------------===//
#include "zopt/Dialect/Zopt/IR/ZoptOps.h"

#include "mlir/Interfaces/SideEffectInterfaces.h"
#include "llvm/ADT/DenseMap.h"
#include "llvm/ADT/STLExtras.h"
#include "llvm/ADT/SmallPtrSet.h"
#include "llvm/ADT/StringExtras.h"
#include "llvm/ADT/TypeSwitch.h"

using namespace mlir;
using namespace mlir::zopt;

static StringRef kindName(StateKind k) { return stringifyStateKind(k); }

//===----------------------------------------------------------------------===//
// Unknown attributes (every zopt op, through the KnownAttributesOnly trait)
//===----------------------------------------------------------------------===//

/// The attribute names a user may write on `op`: its inherent attributes,
/// without the ones its syntax spells differently (the symbol name, operand
/// segment sizes).
static SmallVector<StringRef> userAttributeNames(Operation *op) {
  SmallVector<StringRef> names;
  if (std::optional<RegisteredOperationName> info = op->getRegisteredInfo())
    for (StringAttr a : info->getAttributeNames())
      if (a.getValue() != "sym_name" && a.getValue() != "operandSegmentSizes" &&
          a.getValue() != "resultSegmentSizes")
        names.push_back(a.getValue());
  return names;
}

LogicalResult mlir::zopt::verifyKnownAttributes(Operation *op) {
  for (NamedAttribute attr : op->getDiscardableAttrs()) {
    StringRef name = attr.getName().strref();
    // Compiler-internal attributes set by the passes (zopt.slot,
    // zopt.device, zopt.max_norm, ...). A description cannot set them: the
    // driver refuses them in its input (verifyDescription).
    if (name.starts_with("zopt."))
      continue;
    SmallVector<StringRef> known = userAttributeNames(op);
    InFlightDiagnostic d = op->emitOpError("unknown attribute '") << name << "'";
    // The closest known name, if it is close: a typo or a prefix.
    StringRef best;
    unsigned bestDist = ~0u;
    for (StringRef k : known) {
      unsigned dist = name.edit_distance(k, /*AllowReplacements=*/true);
      if (k.starts_with(name) || name.starts_with(k))
        dist = std::min<unsigned>(dist, 1);
      if (dist < bestDist)
        bestDist = dist, best = k;
    }
    if (!best.empty() &&
        bestDist <= std::max<size_t>(2, std::max(name.size(), best.size()) / 3))
      d << "; did you mean '" << best << "'?";
    if (known.empty())
      d << " ('" << op->getName() << "' takes no attributes)";
    else
      d << " (attributes of '" << op->getName()
        << "': " << llvm::join(known, ", ") << ")";
    return d;
  }
  return success();
}

//===----------------------------------------------------------------------===//
// Roles: which state a value is a new value of
//===----------------------------------------------------------------------===//

/// A set of state kinds, one bit per StateKind.
using RoleMask = uint32_t;
static RoleMask bit(StateKind k) { return RoleMask(1) << unsigned(k); }

/// The states whose update each value of `body` is, following the "tied"
/// operand of each op (docs/Dialects/Zopt.md, "Roles"):
///   zopt.state S                        -> {S}
///   ema, ema_sq, max                    -> their first (running) operand
///   apply, decoupled_decay              -> their param operand
///   momentum                            -> its buffer operand
///   adam                                -> param, exp_avg, exp_avg_sq (per result)
///   l2_decay, nesterov, unscale, clip   -> their gradient operand
///   sign, adam_direction, hyper, global -> nothing (directions, scalars)
///   any other op (arith/math after decompose, casts, ops without a rule)
///                                       -> every operand's states
/// Linear in the number of ops.
static void computeRoles(Block &body, llvm::DenseMap<Value, RoleMask> &roles) {
  auto of = [&](Value v) { return roles.lookup(v); };
  for (Operation &op : body) {
    if (op.getNumResults() == 0)
      continue;
    llvm::TypeSwitch<Operation *>(&op)
        .Case([&](StateOp s) { roles[s.getResult()] = bit(s.getKind()); })
        .Case<EmaOp, EmaSqOp, MaxOp, ApplyOp, L2DecayOp, NesterovOp>(
            [&](auto o) { roles[o.getResult()] = of(o.getLhs()); })
        .Case([&](DecoupledDecayOp o) { roles[o.getResult()] = of(o.getParam()); })
        .Case([&](MomentumOp o) { roles[o.getResult()] = of(o.getBuf()); })
        .Case([&](UnscaleOp o) { roles[o.getResult()] = of(o.getGrad()); })
        .Case([&](ClipByGlobalNormOp o) { roles[o.getResult()] = of(o.getOperand()); })
        .Case([&](AdamOp o) {
          roles[o.getNewParam()] = of(o.getParam());
          roles[o.getNewExpAvg()] = of(o.getExpAvg());
          roles[o.getNewExpAvgSq()] = of(o.getExpAvgSq());
        })
        .Case<SignOp, AdamDirectionOp, HyperOp, GlobalOp>([](auto) {})
        .Default([&](Operation *o) {
          RoleMask m = 0;
          for (Value v : o->getOperands())
            m |= of(v);
          for (Value r : o->getResults())
            roles[r] = m;
        });
  }
}

/// Words for a role set: "an update of 'exp_avg' and 'exp_avg_sq'".
static std::string describeRoles(RoleMask m) {
  SmallVector<std::string> names;
  for (int k = 1; k <= int(StateKind::momentum_buffer); ++k)
    if (k != int(StateKind::grad) && (m & (RoleMask(1) << k)))
      names.push_back(("'" + kindName(StateKind(k)) + "'").str());
  if (!names.empty()) {
    std::string r = "an update of " + names.front();
    for (size_t i = 1; i < names.size(); ++i)
      r += (i + 1 == names.size() ? " and " : ", ") + names[i];
    return r;
  }
  if (m & bit(StateKind::grad))
    return "derived from the gradient only (a gradient is never stored)";
  return "not an update of any state (a direction, a hyperparameter or a "
         "constant)";
}

/// Why `op`'s result has the roles it has, for a note.
static std::string explainTie(Operation *op) {
  return llvm::TypeSwitch<Operation *, std::string>(op)
      .Case([](StateOp s) {
        return ("it is the '" + kindName(s.getKind()) + "' state itself").str();
      })
      .Case<EmaOp, EmaSqOp>([](auto o) {
        return ("'" + o->getName().getStringRef() +
                "' updates its first operand, the running average")
            .str();
      })
      .Case([](MaxOp o) {
        return std::string("'zopt.max' updates its first operand, the running "
                           "maximum");
      })
      .Case<ApplyOp, DecoupledDecayOp>([](auto o) {
        return ("'" + o->getName().getStringRef() +
                "' updates its first operand, the param (or master)")
            .str();
      })
      .Case([](MomentumOp) {
        return std::string(
            "'zopt.momentum' updates its first operand, the momentum buffer");
      })
      .Case([](AdamOp) {
        return std::string("'zopt.adam' returns the new param, exp_avg and "
                           "exp_avg_sq, in that order");
      })
      .Case<L2DecayOp, NesterovOp, UnscaleOp, ClipByGlobalNormOp>([](auto o) {
        return ("'" + o->getName().getStringRef() +
                "' computes a gradient from its first operand")
            .str();
      })
      .Case<SignOp, AdamDirectionOp>([](auto o) {
        return ("'" + o->getName().getStringRef() +
                "' computes an update direction: apply it to a state with "
                "zopt.apply")
            .str();
      })
      .Default([](Operation *o) {
        return ("'" + o->getName().getStringRef() +
                "' is an update of every state its operands are")
            .str();
      });
}

/// The states a value stored into `target` may be an update of.
static RoleMask allowedRoles(StateKind target, bool hasMaster) {
  RoleMask m = bit(target);
  if (target == StateKind::param && hasMaster)
    m |= bit(StateKind::master); // the low-precision copy of the master
  if (target == StateKind::master)
    m |= bit(StateKind::param);
  return m;
}

void mlir::zopt::collectLiveOps(Block &body,
                                llvm::SmallPtrSetImpl<Operation *> &live) {
  for (Operation &op : llvm::reverse(body)) {
    bool isLive = op.hasTrait<OpTrait::IsTerminator>() ||
                  !isMemoryEffectFree(&op) ||
                  llvm::any_of(op.getUsers(), [&](Operation *u) {
                    Operation *a = body.findAncestorOpInBlock(*u);
                    return a && live.contains(a);
                  });
    if (isLive)
      live.insert(&op);
  }
}

/// The CUDA architectures zopt compiles for: sm_70 and newer among those
/// LLVM 22's NVPTX backend knows (llc -march=nvptx64 -mcpu=help) that the
/// PTX ISA 8.0 convert-zk-to-gpu asks for (+ptx80) supports. sm_88 and
/// sm_100..sm_121 need PTX 8.6-9.0: LLVM stops with a fatal error ("PTX
/// version 8.0 does not support target 'sm_120'", found by the fuzzer), so
/// they are refused here until the GPU code generator picks the PTX version
/// per architecture.
static constexpr unsigned kGpuArchs[] = {70, 72, 75, 80, 86, 87, 89, 90};

bool mlir::zopt::isKnownGpuArch(StringRef arch) {
  unsigned sm = 0;
  if (!arch.consume_front("sm_") || arch.empty() || arch.front() == '0' ||
      arch.getAsInteger(10, sm))
    return false;
  return llvm::is_contained(kGpuArchs, sm);
}

std::string mlir::zopt::knownGpuArchs() {
  std::string s;
  for (unsigned sm : kGpuArchs)
    s += (s.empty() ? "sm_" : ", sm_") + std::to_string(sm);
  return s;
}

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
  if (auto arch = getGpuArch())
    if (!isKnownGpuArch(*arch))
      return emitOpError("gpu_arch must name a CUDA architecture sm_70 or "
                         "newer, like \"sm_90\" (got \"")
             << *arch << "\"; known: " << knownGpuArchs() << ")";

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
      // Two defaults that differ conflict. A declaration without a default
      // takes the slot's default from the others (the decompose phase adds
      // `zopt.hyper bias_correction` next to a user's declaration with a
      // default; a description must agree exactly, verifyDescription).
      auto [it, inserted] = hypers.try_emplace(int(h.getKind()), h);
      if (!inserted && !it->second.getDefaultValue())
        it->second = h;
      else if (!inserted && h.getDefaultValue() &&
               it->second.getDefaultValue() != h.getDefaultValue())
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
    } else if (auto mx = dyn_cast<MaxOp>(op)) {
      // max(x, x) is x: the canonicalizer folds it away, and a running
      // maximum stored from it would never change (found by the fuzzer: the
      // step then failed after decompose with "stores ... back unchanged").
      if (mx.getLhs() == mx.getRhs())
        return mx.emitOpError("takes the maximum of a value with itself, "
                              "which is that value: the running maximum "
                              "would never change (compare it with the new "
                              "second moment: zopt.max %vm, %v1)");
    } else if (auto a = dyn_cast<AdamOp>(op)) {
      auto m = a.getExpAvg().getDefiningOp<StateOp>();
      auto v = a.getExpAvgSq().getDefiningOp<StateOp>();
      if (!m || m.getKind() != StateKind::exp_avg)
        return a.emitOpError("third operand must be the 'exp_avg' state");
      if (!v || v.getKind() != StateKind::exp_avg_sq)
        return a.emitOpError("fourth operand must be the 'exp_avg_sq' state");
    }
  }

  // Step-level transformations must reach a stored value: a clip whose
  // result is never used would be dropped without a word.
  llvm::SmallPtrSet<Operation *, 32> live;
  collectLiveOps(body, live);
  {
    if (clip && !live.contains(clip))
      return clip.emitOpError("the clipped gradient is never used")
             << (clip.getResult().use_empty() ? "" : " by a stored value")
             << ": clipping would have no effect (use its result in place of "
                "the gradient)";
    if (unscale && !live.contains(unscale))
      return unscale.emitOpError("the unscaled gradient is never used")
             << (unscale.getResult().use_empty() ? "" : " by a stored value")
             << ": loss scaling would have no effect (use its result in "
                "place of the gradient)";
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
  // A step that ignores its gradient is a mistake (and the canonicalizer
  // would delete the unused grad state, failing the step after decompose).
  if (!live.contains(grad))
    return grad.emitOpError("the gradient never reaches a stored value: the "
                            "update does not depend on it");
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
  // A loss-scaled gradient is read through zopt.unscale only: a raw read
  // would be S times too large (and the plan divides every read of the
  // grad by the scale, so it would silently not be: the property test's
  // finding F1).
  if (unscale)
    for (OpOperand &use : grad.getResult().getUses())
      if (use.getOwner() != unscale.getOperation())
        return use.getOwner()
                   ->emitOpError("reads the loss-scaled gradient directly; "
                                 "read the unscaled value (the result of ")
                   .attachNote(unscale.getLoc())
               << "zopt.unscale here) instead";

  // ZeRO-3 keeps params sharded in runtime memory on the placement of the
  // update; with the params on the GPU and the optimizer states on the CPU
  // (offload) the runtime would have to shard device params across host
  // updates, which it does not do (ZeRO-Infinity): refused, not crashed.
  if (stage == 3 && param.getPlacement() == Placement::gpu)
    for (auto &kv : states)
      if (isOptimizerState(kv.second.getKind()) &&
          kv.second.getPlacement() == Placement::cpu)
        return emitOpError("zero_stage 3 with the params on the GPU and the "
                           "optimizer states on the CPU (offload) is not "
                           "supported: use zero_stage = 2 (ZeRO-Offload), or "
                           "keep every state on one placement");

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
    if (master.getRemainder()) {
      // docs/NUMERICS.md §9: the param is the master's high half.
      if (!pt.isBF16())
        return master.emitOpError("a remainder master needs a bf16 param "
                                  "(its high half); the param is ")
               << pt;
      if (master.getPlacement() != param.getPlacement())
        return master.emitOpError("a remainder master lives beside its "
                                  "param (the param is its high half); the "
                                  "param is on ")
               << stringifyPlacement(param.getPlacement())
               << ", the master on "
               << stringifyPlacement(master.getPlacement());
      if (param.getRounding() &&
          *param.getRounding() == Rounding::stochastic) {
        InFlightDiagnostic d = master.emitOpError(
            "a remainder master does not combine with a stochastically "
            "rounded param: drop 'rounding stochastic' from the param");
        d.attachNote(param.getLoc())
            << "the param is the master's high half rounded so that the "
               "remainder rebuilds the master exactly; a stochastic high "
               "half would be off by a random carry the 16-bit remainder "
               "cannot hold, and with an exact f32 master there is no "
               "lost update for stochastic rounding to recover";
        return d;
      }
    }
  }
  if (param.getKahan()) {
    // docs/NUMERICS.md §11: the compensation replaces the master.
    if (master) {
      InFlightDiagnostic d = master.emitOpError(
          "a Kahan-compensated param has no master: drop the master or "
          "'kahan' from the param");
      d.attachNote(param.getLoc())
          << "the compensation carries the rounding error of the param's "
             "stores into the next step in place of a master (2 bytes per "
             "param instead of 4); with a master the param is rounded from "
             "it and there is no error to carry";
      return d;
    }
    if (param.getRounding() && *param.getRounding() == Rounding::stochastic) {
      InFlightDiagnostic d = param.emitOpError(
          "a Kahan-compensated param does not combine with stochastic "
          "rounding: drop 'rounding stochastic' or 'kahan'");
      d.attachNote() << "the compensation keeps the rounding error of each "
                        "store and adds it back at the next, so no update is "
                        "lost to rounding; a stochastic store would only add "
                        "noise that the compensation then cancels";
      return d;
    }
    for (auto &kv : states)
      if (isOptimizerState(kv.second.getKind()) &&
          kv.second.getPlacement() != param.getPlacement())
        return param.emitOpError("a Kahan-compensated param is updated "
                                 "beside its compensation, with the "
                                 "optimizer states; the param is on ")
               << stringifyPlacement(param.getPlacement()) << ", '"
               << kindName(kv.second.getKind()) << "' on "
               << stringifyPlacement(kv.second.getPlacement());
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

  // Roles: a value stored into a state is an update of that state
  // (docs/Dialects/Zopt.md, "Roles").
  llvm::DenseMap<Value, RoleMask> roles;
  computeRoles(body, roles);
  auto targetKind = [](Value t) { return t.getDefiningOp<StateOp>().getKind(); };
  for (auto [i, pair] :
       llvm::enumerate(llvm::zip(yield.getValues(), yield.getTargets()))) {
    auto [value, target] = pair;
    StateKind k = targetKind(target);
    if (value == target)
      return yield.emitOpError("stores '")
             << kindName(k)
             << "' back unchanged (value #" << i
             << "): yield its new value (a state that never changes is a "
                "mistake)";
    RoleMask r = roles.lookup(value);
    if (r & allowedRoles(k, bool(master)))
      continue;
    InFlightDiagnostic d = yield.emitOpError("value #")
                           << i << " stored into '" << kindName(k)
                           << "' is not an update of '" << kindName(k)
                           << "': it is " << describeRoles(r);
    // Two values swapped: each is the other target's update.
    for (auto [j, other] :
         llvm::enumerate(llvm::zip(yield.getValues(), yield.getTargets()))) {
      StateKind kj = targetKind(std::get<1>(other));
      if (j != i && (r & allowedRoles(kj, bool(master))) &&
          (roles.lookup(std::get<0>(other)) & allowedRoles(k, bool(master)))) {
        d << "; did you swap the values stored into '" << kindName(k)
          << "' and '" << kindName(kj) << "'?";
        break;
      }
    }
    if (Operation *def = value.getDefiningOp())
      d.attachNote(def->getLoc())
          << "value #" << i << " is computed here: " << explainTie(def);
    return d;
  }
  return success();
}
