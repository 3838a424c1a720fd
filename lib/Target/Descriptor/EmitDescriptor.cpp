//===- EmitDescriptor.cpp - abi.h's zopt_step_descriptor ------------------===//
//
// lib/Target/Descriptor/ owns the one writer of the step descriptor the
// runtime reads (runtime/include/zopt/abi.h, zopt_step_descriptor): the
// zk.descriptor made by zopt-fuse, the kernel tables the conversions
// recorded on it and the step program made by zopt-plan become one exported
// constant, with its checksum, after every kernel is converted.
//
//===----------------------------------------------------------------------===//
#include "zopt/Target/Passes.h"

#include "zopt/Dialect/Program/IR/ProgramOps.h"
#include "zopt/Dialect/ZK/IR/ZKOps.h"
#include "zopt/Dialect/Zopt/IR/ZoptOps.h"
#include "zopt/abi.h"

#include <cstring>

namespace mlir::zopt {
#define GEN_PASS_DEF_ZOPTEMITDESCRIPTOR
#include "zopt/Target/Passes.h.inc"
} // namespace mlir::zopt

using namespace mlir;
using namespace mlir::zopt;

namespace {

static void copyName(char *dst, StringRef s) {
  std::memset(dst, 0, ZOPT_NAME_LEN);
  std::memcpy(dst, s.data(), std::min<size_t>(s.size(), ZOPT_NAME_LEN - 1));
}

/// The rules that relate the step program to the step it runs (the ones the
/// zprog verifier cannot check alone; docs/Dialects/Program.md, "Against
/// the step"): the runtime would refuse the program at finalize, or run it
/// and leave wrong values.
static LogicalResult checkProgram(zprog::ProgramOp prog, zk::DescriptorOp d) {
  ArrayRef<int32_t> kinds = d.getStateKinds(), dtypes = d.getStateDtypes(),
                    places = d.getStatePlacements(), sflags = d.getStateFlags();
  auto index = [&](StateKind k) -> int {
    for (auto [i, kind] : llvm::enumerate(kinds))
      if (kind == int32_t(k))
        return int(i);
    return -1;
  };
  auto partitioned = [&](StateKind k) {
    int i = index(k);
    return i >= 0 && (sflags[i] & ZOPT_STATE_PARTITIONED);
  };
  bool anyPartitioned = llvm::any_of(
      sflags, [](int32_t f) { return (f & ZOPT_STATE_PARTITIONED) != 0; });
  zprog::UpdateOp update = prog.getUpdate();
  const Placement device = update.getOn();
  auto dtypeName = [](int32_t code) {
    return code == ZOPT_DTYPE_F32    ? "f32"
           : code == ZOPT_DTYPE_BF16 ? "bf16"
           : code == ZOPT_DTYPE_F16  ? "f16"
                                     : "?";
  };
  // A state the op moves: the step has it, stored as the op's type.
  auto moved = [&](Operation *op, StateKind k, Type t) -> FailureOr<int> {
    int i = index(k);
    if (i < 0)
      return op->emitOpError("names a state the step does not have");
    if (int32_t(dtypeCode(t)) != dtypes[i])
      return op->emitOpError("moves the ")
             << stringifyStateKind(k) << " as " << t
             << ", but the step stores it as " << dtypeName(dtypes[i]);
    return i;
  };
  bool norm = false, gathersParam = false;
  for (Operation &op : prog.getBody().front()) {
    if (auto c = dyn_cast<zprog::CopyOp>(op)) {
      FailureOr<int> i = moved(c, c.getState(), c.getType());
      if (failed(i))
        return failure();
      Placement home = c.getDst() == device ? c.getSrc() : c.getDst();
      if (int32_t(home) != places[*i])
        return c.emitOpError("copies the ")
               << stringifyStateKind(c.getState()) << " "
               << (c.getDst() == device ? "from " : "to ")
               << stringifyPlacement(home) << ", but the step keeps it on "
               << stringifyPlacement(Placement(places[*i]));
    } else if (auto r = dyn_cast<zprog::ReduceScatterOp>(op)) {
      if (failed(moved(r, r.getState(), r.getType())))
        return failure();
    } else if (auto g = dyn_cast<zprog::AllGatherOp>(op)) {
      if (failed(moved(g, g.getState(), g.getType())))
        return failure();
      if (partitioned(g.getState()))
        return g.emitOpError("gathers the ")
               << stringifyStateKind(g.getState())
               << ", which the step keeps sharded across ranks (ZeRO-3 "
                  "params are gathered on request)";
      gathersParam |= g.getState() == StateKind::param;
    } else if (auto np = dyn_cast<zprog::NormPartialsOp>(op)) {
      if (!(d.getFlags() & ZOPT_FLAG_SUMSQ))
        return np.emitOpError("needs the step's sum-of-squares kernel, and "
                              "the step has none");
      if (np.getRange() == zprog::Range::all && anyPartitioned)
        return np.emitOpError("covers every element, but the step shards "
                              "states across ranks: use 'owned'");
    } else if (isa<zprog::NormOp>(op)) {
      norm = true;
    } else if (auto u = dyn_cast<zprog::UpdateOp>(op)) {
      if (u.getRange() == zprog::Range::all && anyPartitioned)
        return u.emitOpError("covers every element, but the step shards "
                             "states across ranks: use 'owned'");
    }
  }
  if ((d.getFlags() & (ZOPT_FLAG_CLIP | ZOPT_FLAG_LOSS_SCALE)) && !norm)
    return prog.emitOpError(
        "takes no norm, but the step clips or scales the loss: the clip "
        "coefficient and the non-finite skip need zprog.norm_partials and "
        "zprog.norm");
  if (update.getRange() == zprog::Range::owned &&
      !partitioned(StateKind::param) && !gathersParam)
    return update.emitOpError(
        "updates only this rank's shards of the param, which every rank "
        "holds whole, and no zprog.all_gather of the param follows: the "
        "other ranks' copies would go stale");
  return success();
}

/// The zprog.program of the module (made by zopt-plan) into the
/// descriptor's program table (abi.h "The step program"); erases it.
static LogicalResult lowerProgram(ModuleOp m, zk::DescriptorOp d,
                                  zopt_step_descriptor &desc) {
  auto progs = llvm::to_vector(m.getOps<zprog::ProgramOp>());
  if (progs.size() != 1)
    return m.emitError("expected exactly one zprog.program (made by "
                       "zopt-plan), found ")
           << progs.size();
  zprog::ProgramOp prog = progs.front();
  if (failed(checkProgram(prog, d)))
    return failure();
  // Collectives run where the update does (offloaded steps: on the host
  // staging the grads were copied to).
  const Placement device = prog.getUpdate().getOn();
  auto slotOf = [&](StateKind k) {
    return uint32_t(llvm::find(d.getStateKinds(), int32_t(k)) -
                    d.getStateKinds().begin());
  };
  for (Operation &op : prog.getBody().front()) {
    if (desc.num_program >= ZOPT_MAX_PROGRAM)
      return op.emitOpError("the program has more than ")
             << ZOPT_MAX_PROGRAM << " ops";
    zopt_program_op &p = desc.program[desc.num_program++];
    std::memset(&p, 0, sizeof p);
    auto at = [&](Placement pl) { p.src = p.dst = uint32_t(pl); };
    if (auto c = dyn_cast<zprog::CopyOp>(op)) {
      p.code = ZOPT_OP_COPY;
      p.state = slotOf(c.getState());
      p.dtype = dtypeCode(c.getType());
      p.src = uint32_t(c.getSrc());
      p.dst = uint32_t(c.getDst());
      p.flags = c.getUnlessSkipped() ? ZOPT_OPF_UNLESS_SKIPPED : 0;
    } else if (auto r = dyn_cast<zprog::ReduceScatterOp>(op)) {
      p.code = ZOPT_OP_REDUCE_SCATTER;
      p.state = slotOf(r.getState());
      p.dtype = dtypeCode(r.getType());
      p.accum = dtypeCode(r.getAccumulate());
      at(device);
    } else if (auto g = dyn_cast<zprog::AllGatherOp>(op)) {
      p.code = ZOPT_OP_ALL_GATHER;
      p.state = slotOf(g.getState());
      p.dtype = dtypeCode(g.getType());
      p.flags = g.getUnlessSkipped() ? ZOPT_OPF_UNLESS_SKIPPED : 0;
      at(device);
    } else if (auto np = dyn_cast<zprog::NormPartialsOp>(op)) {
      p.code = ZOPT_OP_NORM_PARTIALS;
      p.range = uint32_t(np.getRange());
      at(np.getOn());
    } else if (isa<zprog::NormOp>(op)) {
      p.code = ZOPT_OP_NORM;
      at(device);
    } else if (auto pr = dyn_cast<zprog::PrepareOp>(op)) {
      p.code = ZOPT_OP_PREPARE;
      at(pr.getOn());
    } else if (auto u = dyn_cast<zprog::UpdateOp>(op)) {
      p.code = ZOPT_OP_UPDATE;
      p.range = uint32_t(u.getRange());
      at(u.getOn());
    } else if (auto f = dyn_cast<zprog::FinishOp>(op)) {
      p.code = ZOPT_OP_FINISH;
      at(f.getOn());
    } else {
      return op.emitOpError("is not a step-program op");
    }
  }
  prog.erase();
  return success();
}

/// The kernel table: the CPU functions (convert-zk-to-cpu), then the GPU
/// kernels and one image per architecture (convert-zk-to-gpu), in the order
/// they were recorded (abi.h "Kernels", "GPU kernels").
static LogicalResult lowerKernels(zk::DescriptorOp d,
                                  zopt_step_descriptor &desc) {
  ArrayAttr cpu = d.getCpuKernelsAttr();
  if (!cpu)
    return d.emitOpError("has no CPU kernel table: zopt-emit-descriptor runs "
                         "after convert-zk-to-cpu");
  auto add = [&](uint32_t role, uint32_t isa, uint32_t device,
                 StringRef sym) -> LogicalResult {
    if (desc.num_kernels >= ZOPT_MAX_KERNELS)
      return d.emitError("too many kernels for the descriptor");
    zopt_kernel_desc &kd = desc.kernels[desc.num_kernels++];
    kd.role = role;
    kd.isa = isa;
    kd.device = device;
    copyName(kd.symbol, sym);
    return success();
  };
  auto code = [](Attribute a) {
    return uint32_t(cast<IntegerAttr>(a).getInt());
  };
  auto name = [](Attribute a) { return cast<StringAttr>(a).getValue(); };
  for (Attribute a : cpu) {
    auto e = cast<ArrayAttr>(a);
    if (failed(add(code(e[0]), code(e[1]), ZOPT_PLACE_CPU, name(e[2]))))
      return failure();
  }
  if (ArrayAttr ks = d.getGpuKernelsAttr())
    for (Attribute a : ks) {
      auto e = cast<ArrayAttr>(a);
      if (failed(add(code(e[0]), ZOPT_ISA_NONE, ZOPT_PLACE_GPU, name(e[1]))))
        return failure();
    }
  if (ArrayAttr images = d.getGpuImagesAttr())
    for (Attribute a : images) {
      auto e = cast<ArrayAttr>(a);
      if (failed(add(ZOPT_KERNEL_GPU_IMAGE, code(e[0]), ZOPT_PLACE_GPU,
                     name(e[1]))))
        return failure();
    }
  return success();
}

struct ZoptEmitDescriptor
    : public mlir::zopt::impl::ZoptEmitDescriptorBase<ZoptEmitDescriptor> {
  void runOnOperation() override {
    ModuleOp m = getOperation();
    auto descs = llvm::to_vector(m.getOps<zk::DescriptorOp>());
    if (descs.size() != 1) {
      m.emitError("expected exactly one zk.descriptor");
      return signalPassFailure();
    }
    zk::DescriptorOp d = descs.front();

    zopt_step_descriptor desc;
    std::memset(&desc, 0, sizeof(desc));
    std::memcpy(desc.magic, ZOPT_DESC_MAGIC, 8);
    desc.abi_version = ZOPT_ABI_VERSION;
    desc.size = sizeof(desc);
    copyName(desc.name, d.getName());
    desc.zero_stage = d.getZeroStage();
    desc.align = d.getAlign();
    desc.flags = d.getFlags();
    desc.max_norm = d.getMaxNorm().convertToDouble();
    desc.num_states = d.getStateKinds().size();
    desc.num_hypers = d.getHyperKinds().size();
    desc.num_coeffs = d.getNumCoeffs();
    for (unsigned i = 0; i < desc.num_states; ++i)
      desc.states[i] = {uint32_t(d.getStateKinds()[i]),
                        uint32_t(d.getStateDtypes()[i]),
                        uint32_t(d.getStatePlacements()[i]),
                        uint32_t(d.getStateRoundings()[i]),
                        uint32_t(d.getStateInits()[i]),
                        uint32_t(d.getStateAccess()[i]),
                        uint32_t(d.getStateFlags()[i]),
                        0u};
    for (unsigned i = 0; i < desc.num_hypers; ++i) {
      zopt_hyper_desc &h = desc.hypers[i];
      h.kind = d.getHyperKinds()[i];
      h.default_value = d.getHyperDefaults()[i];
      h.min_value = d.getHyperMins()[i];
      h.max_value = d.getHyperMaxs()[i];
      h.max_exclusive = d.getHyperMaxExclusive()[i];
    }
    if (failed(lowerKernels(d, desc)) || failed(lowerProgram(m, d, desc)))
      return signalPassFailure();
    desc.checksum = zopt_desc_checksum(&desc);

    OpBuilder mb = OpBuilder::atBlockEnd(m.getBody());
    auto arrTy = LLVM::LLVMArrayType::get(IntegerType::get(&getContext(), 8),
                                          sizeof(desc));
    LLVM::GlobalOp::create(
        mb, d.getLoc(), arrTy, /*isConstant=*/true, LLVM::Linkage::External,
        ZOPT_DESC_SYMBOL,
        mb.getStringAttr(StringRef(reinterpret_cast<const char *>(&desc),
                                   sizeof(desc))),
        /*alignment=*/8);
    d.erase();
  }
};

} // namespace
