//===- Fuse.cpp - a step into a descriptor, a prepare and fused kernels ---===//
//
// Uniformity: a value is *varying* when it depends on a zopt.state (it
// differs per element), otherwise *uniform* (one value per group and step).
// Uniform values that varying math consumes become coefficient slots: the
// prepare function computes them in f64 from the hyperparameters and
// globals and stores them as f32; the kernels read them with zk.coeff.
//
//===----------------------------------------------------------------------===//
#include "Builders.h"
#include "zopt/Dialect/Zopt/Transforms/Passes.h"
#include "zopt/abi.h"

#include "mlir/IR/IRMapping.h"
#include "llvm/ADT/MapVector.h"
#include "llvm/ADT/SetVector.h"

#include <set>

namespace mlir::zopt {
#define GEN_PASS_DEF_ZOPTFUSE
#include "zopt/Dialect/Zopt/Transforms/Passes.h.inc"
} // namespace mlir::zopt

using namespace mlir;
using namespace mlir::zopt;

namespace {

static int64_t slotOf(StateOp s) {
  return cast<IntegerAttr>(s->getAttr("zopt.slot")).getInt();
}

struct StepFuser {
  StepOp step;
  unsigned &numCoeffs;
  Block &body;
  llvm::DenseSet<Operation *> varying;
  llvm::MapVector<Value, int64_t> coeffs; // uniform value -> slot
  SmallVector<int> hyperKinds;            // descriptor order
  ReduceSumSqOp reduce;
  bool stochastic = false; // some state rounds stochastically
  /// q8 moments (abi.h "q8 moments") -> the slot of their absmax: after
  /// every zopt.state's slot, exp_avg's first.
  llvm::DenseMap<Operation *, int64_t> absmaxSlot;
  // The slot of a Kahan param's compensation (after the absmax slots), or -1.
  int64_t kahanSlot = -1;

  StepFuser(StepOp step, unsigned &numCoeffs)
      : step(step), numCoeffs(numCoeffs), body(step.getBody().front()) {}

  bool isVarying(Value v) {
    Operation *d = v.getDefiningOp();
    return d && varying.contains(d);
  }

  LogicalResult analyze() {
    for (Operation &op : body) {
      if (isa<YieldOp>(op))
        continue;
      if (auto r = dyn_cast<ReduceSumSqOp>(op)) {
        reduce = r;
        continue;
      }
      if (auto s = dyn_cast<StateOp>(op)) {
        if (s.getRounding() && *s.getRounding() == Rounding::stochastic) {
          // abi.h "Stochastic rounding": bf16 stores (CPU and GPU kernels).
          if (!s.getType().isBF16())
            return s.emitOpError("stochastic rounding is implemented for bf16 "
                                 "states; this state is ")
                   << s.getType() << " (use nearest_even)";
          stochastic = true;
        }
        varying.insert(&op);
        continue;
      }
      if (op.getNumRegions())
        return op.emitOpError("regions are not supported inside a zopt.step");
      if (llvm::any_of(op.getOperands(), [&](Value v) { return isVarying(v); }))
        varying.insert(&op);
    }
    // Coefficients: uniform, non-constant operands of varying ops.
    for (Operation &op : body) {
      if (!varying.contains(&op) && !isa<YieldOp, ReduceSumSqOp>(op))
        continue;
      for (Value v : op.getOperands()) {
        if (isVarying(v) || v.getDefiningOp<arith::ConstantOp>())
          continue;
        if (!v.getType().isF32())
          return op.emitOpError("uses the per-group value ")
                 << v << " of type " << v.getType()
                 << " per element; per-element math is f32 (truncate it)";
        if (!coeffs.count(v)) {
          if (coeffs.size() >= ZOPT_MAX_COEFFS)
            return op.emitOpError("needs more than ")
                   << ZOPT_MAX_COEFFS << " per-group coefficients";
          coeffs.insert({v, int64_t(coeffs.size())});
        }
      }
    }
    std::set<int> kinds;
    for (Operation &op : body)
      if (auto h = dyn_cast<HyperOp>(op))
        kinds.insert(int(h.getKind()));
    hyperKinds.assign(kinds.begin(), kinds.end());
    numCoeffs += coeffs.size();
    return success();
  }

  /// The descriptor's ZOPT_FLAG_* bits.
  int64_t descriptorFlags() {
    int64_t flags = 0;
    if (step->getAttrOfType<FloatAttr>("zopt.max_norm"))
      flags |= ZOPT_FLAG_CLIP;
    if (step->hasAttr("zopt.loss_scale"))
      flags |= ZOPT_FLAG_LOSS_SCALE;
    if (reduce)
      flags |= ZOPT_FLAG_SUMSQ;
    if (stochastic)
      flags |= ZOPT_FLAG_STOCHASTIC;
    // The rule, as zopt-decompose found it (zopt.nesterov and
    // zopt.decoupled_decay ops); always stated.
    flags |= ZOPT_FLAG_RULE_STATED;
    if (step->hasAttr("zopt.nesterov"))
      flags |= ZOPT_FLAG_NESTEROV;
    if (step->hasAttr("zopt.decoupled_decay"))
      flags |= ZOPT_FLAG_DECOUPLED_DECAY;
    return flags;
  }

  void buildDescriptor(OpBuilder &b) {
    SmallVector<int32_t> kinds, dtypes, places, rounds, inits, access, sflags;
    llvm::DenseSet<StringRef> partitioned;
    if (auto parts = step->getAttrOfType<ArrayAttr>("zopt.partitioned"))
      for (Attribute a : parts)
        partitioned.insert(cast<StringAttr>(a).getValue());
    SmallVector<StateOp> states(body.getOps<StateOp>());
    llvm::sort(states, [](StateOp x, StateOp y) { return slotOf(x) < slotOf(y); });
    YieldOp yield = step.getYield();
    llvm::DenseSet<Value> targets(yield.getTargets().begin(),
                                  yield.getTargets().end());
    StateOp remMaster = remainderMaster();
    for (StateOp s : states) {
      kinds.push_back(int(s.getKind()));
      // A remainder master is stored as its int16 low half (abi.h).
      dtypes.push_back(s == remMaster ? ZOPT_DTYPE_I16
                                      : dtypeCode(s.getType()));
      places.push_back(int(s.getPlacement()));
      rounds.push_back(s.getRounding() ? int(*s.getRounding())
                                       : ZOPT_ROUND_NEAREST_EVEN);
      inits.push_back(s.getKind() == StateKind::param ||
                              s.getKind() == StateKind::grad
                          ? ZOPT_INIT_USER
                      : s.getKind() == StateKind::master ? ZOPT_INIT_FROM_PARAM
                                                         : ZOPT_INIT_ZERO);
      auto readsOf = [&](StateOp x) {
        return x && llvm::any_of(x->getUses(), [&](OpOperand &u) {
                 return !isa<YieldOp>(u.getOwner()) ||
                        u.getOperandNumber() < yield.getValues().size();
               });
      };
      // Reading a remainder master reads the param, its high half.
      bool read = readsOf(s) || (remMaster && s.getKind() == StateKind::param &&
                                 readsOf(remMaster));
      access.push_back((read ? ZOPT_ACCESS_READ : 0) |
                       (targets.contains(s.getResult()) ? ZOPT_ACCESS_WRITE : 0));
      sflags.push_back(partitioned.contains(stringifyStateKind(s.getKind()))
                           ? ZOPT_STATE_PARTITIONED
                           : 0);
      if (s.getQ8())
        dtypes.back() = ZOPT_DTYPE_Q8;
    }
    // Each q8 moment's absmax: one f32 per block, beside its moment.
    for (StateOp s : states) {
      auto it = absmaxSlot.find(s);
      if (it == absmaxSlot.end())
        continue;
      size_t i = llvm::find(states, s) - states.begin();
      assert(int64_t(kinds.size()) == it->second && "absmax slots in order");
      kinds.push_back(s.getKind() == StateKind::exp_avg
                          ? ZOPT_STATE_EXP_AVG_ABSMAX
                          : ZOPT_STATE_EXP_AVG_SQ_ABSMAX);
      dtypes.push_back(ZOPT_DTYPE_F32);
      places.push_back(places[i]);
      rounds.push_back(ZOPT_ROUND_NEAREST_EVEN);
      inits.push_back(ZOPT_INIT_ZERO);
      access.push_back(access[i]);
      sflags.push_back(sflags[i] | ZOPT_STATE_PER_BLOCK);
    }
    // A Kahan param's compensation: bf16, zero at first, beside the param,
    // partitioned as the optimizer states (abi.h "Kahan-compensated params").
    if (kahanSlot >= 0) {
      StateOp param = step.getState(StateKind::param);
      assert(int64_t(kinds.size()) == kahanSlot && "the compensation last");
      kinds.push_back(ZOPT_STATE_KAHAN_COMP);
      dtypes.push_back(ZOPT_DTYPE_BF16);
      places.push_back(int(param.getPlacement()));
      rounds.push_back(ZOPT_ROUND_NEAREST_EVEN);
      inits.push_back(ZOPT_INIT_ZERO);
      access.push_back(ZOPT_ACCESS_READ | ZOPT_ACCESS_WRITE);
      sflags.push_back(step.getZeroStage() >= 1 ? ZOPT_STATE_PARTITIONED : 0);
    }
    SmallVector<double> defs, mins, maxs;
    SmallVector<int32_t> excl;
    for (int k : hyperKinds) {
      HyperInfo info = getHyperInfo(HyperKind(k));
      double def = info.defaultValue;
      for (HyperOp h : body.getOps<HyperOp>())
        if (int(h.getKind()) == k && h.getDefaultValue())
          def = h.getDefaultValue()->convertToDouble();
      defs.push_back(def);
      mins.push_back(info.minValue);
      maxs.push_back(info.maxValue);
      excl.push_back(info.maxExclusive);
    }
    int64_t flags = descriptorFlags();
    double maxNorm = 0.0;
    if (auto mn = step->getAttrOfType<FloatAttr>("zopt.max_norm"))
      maxNorm = mn.getValueAsDouble();
    zk::DescriptorOp::create(
        b, step.getLoc(), b.getStringAttr(step.getSymName()),
        b.getI64IntegerAttr(step.getZeroStage()),
        b.getI64IntegerAttr(step.getAlign()), b.getI64IntegerAttr(flags),
        b.getF64FloatAttr(maxNorm), b.getI64IntegerAttr(coeffs.size()),
        b.getDenseI32ArrayAttr(kinds), b.getDenseI32ArrayAttr(dtypes),
        b.getDenseI32ArrayAttr(places), b.getDenseI32ArrayAttr(rounds),
        b.getDenseI32ArrayAttr(inits), b.getDenseI32ArrayAttr(access),
        b.getDenseI32ArrayAttr(sflags),
        b.getDenseI32ArrayAttr(hyperKinds), b.getDenseF64ArrayAttr(defs),
        b.getDenseF64ArrayAttr(mins), b.getDenseF64ArrayAttr(maxs),
        b.getDenseI32ArrayAttr(excl), /*cpu_kernels=*/nullptr,
        /*gpu_kernels=*/nullptr, /*gpu_images=*/nullptr);
  }

  /// Numbers the q8 moments' absmax slots (absmaxSlot).
  void assignAbsmaxSlots() {
    int64_t next = llvm::range_size(body.getOps<StateOp>());
    for (StateKind k : {StateKind::exp_avg, StateKind::exp_avg_sq})
      if (StateOp s = step.getState(k); s && s.getQ8())
        absmaxSlot[s] = next++;
    if (step.getState(StateKind::param).getKahan())
      kahanSlot = next++;
  }

  /// The `remainder` master (abi.h "Remainder masters"), or null.
  StateOp remainderMaster() {
    StateOp m = step.getState(StateKind::master);
    return m && m.getRemainder() ? m : StateOp();
  }

  /// The uniform ops needed to compute the coefficients, in body order.
  void buildPrepare(OpBuilder &b) {
    auto prep = zk::PrepareOp::create(b, step.getLoc(),
                                      (step.getSymName() + "_prepare").str());
    Block *blk = new Block();
    prep.getBody().push_back(blk);
    OpBuilder pb = OpBuilder::atBlockEnd(blk);
    llvm::SetVector<Operation *> needed;
    SmallVector<Value> work;
    for (auto &kv : coeffs)
      work.push_back(kv.first);
    while (!work.empty()) {
      Operation *d = work.pop_back_val().getDefiningOp();
      if (!d || !needed.insert(d))
        continue;
      for (Value v : d->getOperands())
        work.push_back(v);
    }
    IRMapping map;
    for (Operation &op : body) {
      if (!needed.contains(&op))
        continue;
      if (auto h = dyn_cast<HyperOp>(op)) {
        int64_t idx = llvm::find(hyperKinds, int(h.getKind())) - hyperKinds.begin();
        map.map(h.getResult(), zk::HyperOp::create(pb, h.getLoc(), pb.getF64Type(), idx));
      } else if (auto g = dyn_cast<GlobalOp>(op)) {
        map.map(g.getResult(),
                zk::GlobalOp::create(pb, g.getLoc(), pb.getF64Type(),
                                     uint64_t(g.getKind())));
      } else {
        pb.clone(op, map);
      }
    }
    for (auto &kv : coeffs)
      zk::SetCoeffOp::create(pb, step.getLoc(), uint64_t(kv.second),
                             map.lookup(kv.first));
  }

  /// Clones `ops` (varying ops in body order) into a kernel body.
  zk::KernelOp buildKernel(OpBuilder &b, StringRef suffix, zk::KernelRole role,
                           const llvm::SetVector<Operation *> &ops) {
    auto k = zk::KernelOp::create(b, step.getLoc(),
                                  (step.getSymName() + suffix).str(), role);
    Block *blk = new Block();
    k.getBody().push_back(blk);
    OpBuilder kb = OpBuilder::atBlockEnd(blk);
    IRMapping map;
    StateOp remMaster = remainderMaster();
    StateOp param = step.getState(StateKind::param);
    auto mapOperands = [&](Operation &op) {
      for (Value v : op.getOperands()) {
        if (map.contains(v))
          continue;
        if (auto it = coeffs.find(v); it != coeffs.end())
          map.map(v, zk::CoeffOp::create(kb, op.getLoc(), kb.getF32Type(),
                                              uint64_t(it->second)));
        else if (auto c = v.getDefiningOp<arith::ConstantOp>())
          map.map(v, kb.clone(*c)->getResult(0));
      }
    };
    for (Operation &op : body) {
      if (!ops.contains(&op))
        continue;
      if (auto s = dyn_cast<StateOp>(op)) {
        IntegerAttr hi = s == remMaster ? kb.getI64IntegerAttr(slotOf(param))
                                        : IntegerAttr();
        auto l = zk::LoadOp::create(kb, s.getLoc(), s.getType(),
                                    kb.getI64IntegerAttr(slotOf(s)), hi,
                                    IntegerAttr(), UnitAttr());
        if (auto it = absmaxSlot.find(s); it != absmaxSlot.end()) {
          l.setAbsmaxAttr(kb.getI64IntegerAttr(it->second));
          l.setQ8Unsigned(s.getKind() == StateKind::exp_avg_sq);
        }
        map.map(s.getResult(), l);
        continue;
      }
      mapOperands(op);
      if (auto r = dyn_cast<ReduceSumSqOp>(op)) {
        zk::AccumulateOp::create(kb, r.getLoc(), map.lookup(r.getOperand()));
        continue;
      }
      if (auto y = dyn_cast<YieldOp>(op)) {
        for (auto [v, t] : llvm::zip(y.getValues(), y.getTargets())) {
          auto s = t.getDefiningOp<StateOp>();
          // The master's store writes the param (its high half); the
          // verifier made the param receive the master's value.
          if (remMaster && s == param)
            continue;
          int32_t rounding = s.getRounding() ? int(*s.getRounding())
                                             : ZOPT_ROUND_NEAREST_EVEN;
          bool rem = s == remMaster;
          if (s == param && kahanSlot >= 0) {
            // The param's store adds the update with its compensation.
            zk::StoreOp::create(
                kb, y.getLoc(), kb.getI64IntegerAttr(slotOf(s)), map.lookup(v),
                TypeAttr::get(s.getType()), kb.getI32IntegerAttr(rounding),
                IntegerAttr(), IntegerAttr(), UnitAttr(),
                kb.getI64IntegerAttr(kahanSlot));
            continue;
          }
          auto q8 = absmaxSlot.find(s);
          bool isQ8 = q8 != absmaxSlot.end();
          auto st = zk::StoreOp::create(
              kb, y.getLoc(), kb.getI64IntegerAttr(slotOf(s)), map.lookup(v),
              TypeAttr::get(rem    ? kb.getI16Type()
                            : isQ8 ? kb.getI8Type()
                                   : s.getType()),
              kb.getI32IntegerAttr(rounding),
              rem ? kb.getI64IntegerAttr(slotOf(param)) : IntegerAttr(),
              IntegerAttr(), UnitAttr(), IntegerAttr());
          if (isQ8) {
            st.setAbsmaxAttr(kb.getI64IntegerAttr(q8->second));
            st.setQ8Unsigned(s.getKind() == StateKind::exp_avg_sq);
          }
        }
        continue;
      }
      kb.clone(op, map);
    }
    return k;
  }

  /// Varying ops (and the states they read) that `roots` depend on.
  llvm::SetVector<Operation *> sliceOf(ArrayRef<Operation *> roots) {
    llvm::SetVector<Operation *> s;
    SmallVector<Operation *> work(roots.begin(), roots.end());
    while (!work.empty()) {
      Operation *op = work.pop_back_val();
      if (!s.insert(op))
        continue;
      for (Value v : op->getOperands())
        if (Operation *d = v.getDefiningOp(); d && varying.contains(d))
          work.push_back(d);
    }
    return s;
  }

  LogicalResult run() {
    if (failed(analyze()))
      return failure();
    OpBuilder b(step);
    assignAbsmaxSlots();
    buildDescriptor(b);
    buildPrepare(b);
    buildControl(b, step.getLoc(), step.getSymName(), descriptorFlags());
    buildKernel(b, "_update", zk::KernelRole::update,
                sliceOf({step.getYield().getOperation()}));
    if (reduce)
      buildKernel(b, "_sumsq", zk::KernelRole::sumsq,
                  sliceOf({reduce.getOperation()}));
    step.erase();
    return success();
  }
};

struct ZoptFuse : public mlir::zopt::impl::ZoptFuseBase<ZoptFuse> {
  void runOnOperation() override {
    ModuleOp m = getOperation();
    auto steps = llvm::to_vector(m.getOps<StepOp>());
    if (steps.size() != 1) {
      m.emitError("a step.so holds exactly one zopt.step (found ")
          << steps.size() << ")";
      return signalPassFailure();
    }
    unsigned n = 0;
    if (failed(StepFuser(steps.front(), n).run()))
      return signalPassFailure();
    numCoeffs += n;
  }
};

} // namespace
