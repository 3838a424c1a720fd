//===- ConvertZKToGPU.cpp - zk kernels into one CUDA module ---------------===//
//
// When the step's optimizer states live on the GPU, every zk.kernel and the
// zk.prepare body go into one `gpu.module @<step>_gpu` (targets: one
// #nvvm.target per requested SM) with the kernels of abi.h's "GPU kernels"
// section:
//
//   <step>_prepare_gpu(hypers, globals, num_groups, coeffs)
//   <step>_sumsq(states, segs, num_segments, coeffs, partials, sg,
//                hypers, globals, num_groups)          (if a sumsq kernel)
//   <step>_update(states, segs, num_segments, coeffs, sg)
//   <step>_finish(globals, num_groups, sg, scaler)
//
// The update is ONE persistent grid-stride launch over a segment table; the
// kernel body is the shared BodyEmitter at 16 bytes per access of the
// narrowest state (4 x f32 or 8 x 16-bit lanes) plus a scalar tail. The
// kernel table entries are recorded on the zk.descriptor (zopt.gpu_*
// attributes) for convert-zk-to-cpu, which writes the descriptor; the
// fatbinaries are embedded by zopt-embed-gpu-binaries after
// gpu-module-to-binary.
//
//===----------------------------------------------------------------------===//
#include "BodyEmitter.h"
#include "zopt/Transforms/Passes.h"
#include "zopt/abi.h"

#include "mlir/AsmParser/AsmParser.h"
#include "mlir/Dialect/GPU/IR/GPUDialect.h"
#include "mlir/Dialect/LLVMIR/NVVMDialect.h"
#include "mlir/Dialect/Math/IR/Math.h"
#include "mlir/Dialect/MemRef/IR/MemRef.h"

#include <cstddef>

namespace mlir::zopt {
#define GEN_PASS_DEF_CONVERTZKTOGPU
#define GEN_PASS_DEF_ZOPTEMBEDGPUBINARIES
#define GEN_PASS_DEF_ZOPTGPUPRECISESQRT
#include "zopt/Transforms/Passes.h.inc"
} // namespace mlir::zopt

using namespace mlir;
using namespace mlir::zopt;

namespace {

/// IR helpers for kernel code over i64 indices and opaque pointers.
struct G {
  OpBuilder &b;
  Location loc;
  Type ptr() { return LLVM::LLVMPointerType::get(b.getContext()); }
  Value i64(int64_t v) {
    return arith::ConstantOp::create(b, loc, b.getI64IntegerAttr(v));
  }
  Value i32(int64_t v) {
    return arith::ConstantOp::create(b, loc, b.getI32IntegerAttr(v));
  }
  Value f64(double v) {
    return arith::ConstantOp::create(b, loc, b.getF64FloatAttr(v));
  }
  /// Pointers into device memory: the global address space, so that
  /// accesses are ld/st.global rather than generic.
  Type gptr() { return LLVM::LLVMPointerType::get(b.getContext(), 1); }
  Value toGlobal(Value p) {
    return LLVM::AddrSpaceCastOp::create(b, loc, gptr(), p);
  }
  Value gep(Type elem, Value base, Value idx) {
    return LLVM::GEPOp::create(b, loc, base.getType(), elem, base,
                               ValueRange{idx});
  }
  Value gepc(Type elem, Value base, int64_t idx) {
    return LLVM::GEPOp::create(b, loc, base.getType(), elem, base,
                               ArrayRef<LLVM::GEPArg>{int32_t(idx)});
  }
  Value load(Type t, Value p) { return LLVM::LoadOp::create(b, loc, t, p); }
  Value add(Value x, Value y) { return arith::AddIOp::create(b, loc, x, y); }
  Value mul(Value x, Value y) { return arith::MulIOp::create(b, loc, x, y); }
  Value toI64(Value index) {
    return arith::IndexCastOp::create(b, loc, b.getI64Type(), index);
  }
  Value tid() { return toI64(gpu::ThreadIdOp::create(b, loc, gpu::Dimension::x)); }
  Value bdim() { return toI64(gpu::BlockDimOp::create(b, loc, gpu::Dimension::x)); }
  Value bid() { return toI64(gpu::BlockIdOp::create(b, loc, gpu::Dimension::x)); }
  Value gdim() { return toI64(gpu::GridDimOp::create(b, loc, gpu::Dimension::x)); }
  /// Global thread index and thread count of the grid.
  std::pair<Value, Value> grid() {
    return {add(mul(bid(), bdim()), tid()), mul(gdim(), bdim())};
  }
  Value splat(Value s, int lanes) {
    auto vt = VectorType::get({lanes}, s.getType());
    Value v = LLVM::PoisonOp::create(b, loc, vt);
    v = LLVM::InsertElementOp::create(b, loc, v, s, i32(0));
    return LLVM::ShuffleVectorOp::create(b, loc, v, v,
                                         SmallVector<int32_t>(lanes, 0));
  }
};

/// Layout of zopt_gpu_step_globals, in units of the field's type.
constexpr int64_t kSgClip = offsetof(zopt_gpu_step_globals, clip_coef) / 8;
constexpr int64_t kSgSumsq = offsetof(zopt_gpu_step_globals, sumsq) / 8;
constexpr int64_t kSgNorm = offsetof(zopt_gpu_step_globals, norm) / 8;
constexpr int64_t kSgNonfinite = offsetof(zopt_gpu_step_globals, nonfinite) / 4;
constexpr int64_t kSgSkip = offsetof(zopt_gpu_step_globals, skip) / 4;
constexpr int64_t kSgDone = offsetof(zopt_gpu_step_globals, blocks_done) / 4;
constexpr int64_t kSgApplied = offsetof(zopt_gpu_step_globals, steps_applied) / 4;
/// Layout of zopt_gpu_scaler, in units of the field's type.
constexpr int64_t kScScale = offsetof(zopt_gpu_scaler, scale) / 8;
constexpr int64_t kScGrowth = offsetof(zopt_gpu_scaler, growth_factor) / 8;
constexpr int64_t kScBackoff = offsetof(zopt_gpu_scaler, backoff_factor) / 8;
constexpr int64_t kScMin = offsetof(zopt_gpu_scaler, min_scale) / 8;
constexpr int64_t kScInterval = offsetof(zopt_gpu_scaler, growth_interval) / 8;
constexpr int64_t kScGood = offsetof(zopt_gpu_scaler, good_steps) / 8;
constexpr int64_t kScLast = offsetof(zopt_gpu_scaler, last_scale) / 8;
constexpr int64_t kScDynamic = offsetof(zopt_gpu_scaler, dynamic) / 4;
constexpr int64_t kScDivisor = offsetof(zopt_gpu_scaler, grad_divisor) / 8;
static_assert(sizeof(zopt_gpu_scaler) == 72, "scaler layout");
static_assert(sizeof(zopt_gpu_segment) == 16, "segment layout");

struct KernelInfo {
  SmallVector<int64_t> slots; // used state slots
  int64_t numCoeffs = 0;      // 1 + the highest coefficient index used
  int lanes = 4;              // 16 bytes of the narrowest state
};

static KernelInfo analyze(zk::KernelOp k) {
  KernelInfo info;
  int minBytes = 4;
  auto use = [&](int64_t slot, Type t) {
    if (!llvm::is_contained(info.slots, slot))
      info.slots.push_back(slot);
    minBytes = std::min<int>(minBytes, t.getIntOrFloatBitWidth() / 8);
  };
  for (Operation &op : k.getBody().front()) {
    if (auto l = dyn_cast<zk::LoadOp>(op))
      use(l.getSlot(), l.getType());
    if (auto s = dyn_cast<zk::StoreOp>(op))
      use(s.getSlot(), s.getStorage());
    if (auto c = dyn_cast<zk::CoeffOp>(op))
      info.numCoeffs = std::max<int64_t>(info.numCoeffs, c.getIndex() + 1);
  }
  info.lanes = 16 / minBytes;
  return info;
}

struct Step {
  std::string name;
  int64_t numStates, numHypers, numCoeffs;
  uint32_t flags;
  double maxNorm;
  zk::PrepareOp prepare;
};

/// Per segment: n, group, the state pointers, the coefficient row and
/// whether the 16-byte vector path applies.
struct Segment {
  Value n;
  Value group; // i64
  SmallVector<Value> ptrs;
  SmallVector<Value> cs, cv;
  Value nVec; // elements done by the vector loop
};

static Segment loadSegment(G &g, const Step &st, const KernelInfo &info,
                           Value states, Value segs, Value coeffs, Value s) {
  OpBuilder &b = g.b;
  Segment seg;
  seg.n = g.load(b.getI64Type(), g.gep(b.getI64Type(), segs, g.mul(s, g.i64(2))));
  Value group = g.load(
      b.getI32Type(),
      g.gep(b.getI32Type(), segs, g.add(g.mul(s, g.i64(4)), g.i64(2))));
  group = arith::ExtUIOp::create(b, g.loc, b.getI64Type(), group);
  seg.group = group;
  seg.ptrs.assign(st.numStates, Value());
  Value row = g.mul(s, g.i64(st.numStates));
  Value misalign = g.i64(0);
  for (int64_t slot : info.slots) {
    Value generic =
        g.load(g.ptr(), g.gep(g.ptr(), states, g.add(row, g.i64(slot))));
    seg.ptrs[slot] = g.toGlobal(generic);
    Value bits = LLVM::PtrToIntOp::create(b, g.loc, b.getI64Type(), generic);
    misalign = arith::OrIOp::create(b, g.loc, misalign, bits);
  }
  Value crow = g.gep(b.getF32Type(), coeffs, g.mul(group, g.i64(st.numCoeffs)));
  for (int64_t c = 0; c < info.numCoeffs; ++c) {
    seg.cs.push_back(g.load(b.getF32Type(), g.gepc(b.getF32Type(), crow, c)));
    seg.cv.push_back(g.splat(seg.cs.back(), info.lanes));
  }
  Value aligned = arith::CmpIOp::create(
      b, g.loc, arith::CmpIPredicate::eq,
      arith::AndIOp::create(b, g.loc, misalign, g.i64(15)), g.i64(0));
  Value full = arith::SubIOp::create(
      b, g.loc, seg.n, arith::RemSIOp::create(b, g.loc, seg.n, g.i64(info.lanes)));
  seg.nVec = arith::SelectOp::create(b, g.loc, aligned, full, g.i64(0));
  return seg;
}

static gpu::GPUFuncOp makeKernel(OpBuilder &gb, Location loc, StringRef name,
                                 ArrayRef<Type> args,
                                 ArrayRef<Type> workgroup = {}) {
  auto fn = gpu::GPUFuncOp::create(
      gb, loc, name, FunctionType::get(gb.getContext(), args, {}), workgroup);
  fn->setAttr(gpu::GPUDialect::getKernelFuncAttrName(), gb.getUnitAttr());
  return fn;
}

/// The prepare body for group `grp` (i64), writing row `grp` of `coeffs`;
/// `clip` (f64) replaces the CLIP_COEF global when set.
static void emitPrepareForGroup(G &g, const Step &st, Value hypers,
                                Value globals, Value coeffs, Value grp,
                                Value clip) {
  OpBuilder &b = g.b;
  Type f64 = b.getF64Type(), f32 = b.getF32Type();
  Value hrow = g.gep(f64, hypers, g.mul(grp, g.i64(st.numHypers)));
  Value grow = g.gep(f64, globals, g.mul(grp, g.i64(ZOPT_NUM_GLOBALS)));
  Value crow = g.gep(f32, coeffs, g.mul(grp, g.i64(st.numCoeffs)));
  emitPrepareBody(
      b, g.loc, st.prepare,
      [&](int64_t i) { return g.load(f64, g.gepc(f64, hrow, i)); },
      [&](int64_t i) {
        if (clip && i == ZOPT_GLOBAL_CLIP_COEF)
          return clip;
        return g.load(f64, g.gepc(f64, grow, i));
      },
      [&](int64_t i, Value v) {
        LLVM::StoreOp::create(b, g.loc, v, g.gepc(f32, crow, i));
      });
}

static void buildPrepareKernel(OpBuilder &gb, Location loc, const Step &st) {
  OpBuilder::InsertionGuard guard(gb);
  MLIRContext *ctx = gb.getContext();
  Type ptr = LLVM::LLVMPointerType::get(ctx), i64 = gb.getI64Type();
  auto fn = makeKernel(gb, loc, st.name + "_prepare_gpu", {ptr, ptr, i64, ptr});
  Block &entry = fn.getBody().front();
  OpBuilder b = OpBuilder::atBlockEnd(&entry);
  G g{b, loc};
  auto [gtid, nthr] = g.grid();
  auto loop = scf::ForOp::create(b, loc, gtid, entry.getArgument(2), nthr);
  {
    OpBuilder::InsertionGuard ig(b);
    b.setInsertionPoint(loop.getBody()->getTerminator());
    emitPrepareForGroup(g, st, g.toGlobal(entry.getArgument(0)),
                        g.toGlobal(entry.getArgument(1)),
                        g.toGlobal(entry.getArgument(3)), loop.getInductionVar(),
                        Value());
  }
  gpu::ReturnOp::create(b, loc);
}

static Value fmix32(G &g, Value h) { return emitFmix32(g.b, g.loc, h); }

/// zopt_sr_key (abi.h) without its last step: fmix32(k ^ index_hi) of the
/// result is the key. seed, t: i64; tensor: i32.
static Value srKeyPartial(G &g, Value seed, Value t, Value tensor) {
  OpBuilder &b = g.b;
  Type i32 = b.getI32Type();
  auto lo = [&](Value v) { return arith::TruncIOp::create(b, g.loc, i32, v); };
  auto hi = [&](Value v) {
    return lo(arith::ShRUIOp::create(b, g.loc, v, g.i64(32)));
  };
  auto x = [&](Value a, Value c) { return arith::XOrIOp::create(b, g.loc, a, c); };
  auto add = [&](Value a, uint32_t c) {
    return arith::AddIOp::create(b, g.loc, a, g.i32(int32_t(c)));
  };
  Value k = fmix32(g, x(lo(seed), fmix32(g, add(hi(seed), 0x9E3779B9u))));
  k = fmix32(g, x(x(k, lo(t)), fmix32(g, add(hi(t), 0x7F4A7C15u))));
  return fmix32(g, x(k, tensor));
}

static void buildUpdateKernel(OpBuilder &gb, zk::KernelOp k, const Step &st) {
  OpBuilder::InsertionGuard guard(gb);
  Location loc = k.getLoc();
  MLIRContext *ctx = gb.getContext();
  Type ptr = LLVM::LLVMPointerType::get(ctx), i64 = gb.getI64Type();
  KernelInfo info = analyze(k);
  // Stochastic rounding (abi.h): the device globals (the group's step t)
  // and the seed follow the five ABI arguments.
  bool sr = false;
  k.getBody().walk([&](zk::StoreOp s) {
    sr |= s.getRounding() == ZOPT_ROUND_STOCHASTIC;
  });
  SmallVector<Type> args = {ptr, ptr, i64, ptr, ptr};
  if (sr)
    args.append({ptr, i64});
  auto fn = makeKernel(gb, loc, k.getSymName(), args);
  Block &entry = fn.getBody().front();
  Value states = entry.getArgument(0), segs = entry.getArgument(1),
        nseg = entry.getArgument(2), coeffs = entry.getArgument(3),
        sg = entry.getArgument(4);
  OpBuilder b = OpBuilder::atBlockEnd(&entry);
  G g{b, loc};
  Block &body = k.getBody().front();
  Value sgGeneric = sg;
  states = g.toGlobal(states);
  segs = g.toGlobal(segs);
  coeffs = g.toGlobal(coeffs);
  sg = g.toGlobal(sg);

  // skip = sg ? sg->skip : 0
  Value sgNull = LLVM::ICmpOp::create(b, loc, LLVM::ICmpPredicate::eq, sgGeneric,
                                      LLVM::ZeroOp::create(b, loc, ptr));
  auto skipIf = scf::IfOp::create(
      b, loc, sgNull,
      [&](OpBuilder &tb, Location l) {
        scf::YieldOp::create(tb, l, ValueRange{g.i32(0)});
      },
      [&](OpBuilder &eb, Location l) {
        G ge{eb, l};
        Value v = ge.load(eb.getI32Type(), ge.gepc(eb.getI32Type(), sg, kSgSkip));
        scf::YieldOp::create(eb, l, ValueRange{v});
      });
  Value run = arith::CmpIOp::create(b, loc, arith::CmpIPredicate::eq,
                                    skipIf.getResult(0), g.i32(0));
  auto runIf = scf::IfOp::create(b, loc, run, /*withElse=*/false);
  b.setInsertionPoint(runIf.thenBlock()->getTerminator());
  auto [gtid, nthr] = g.grid();
  Value L = g.i64(info.lanes);
  auto segLoop = scf::ForOp::create(b, loc, g.i64(0), nseg, g.i64(1));
  b.setInsertionPoint(segLoop.getBody()->getTerminator());
  Segment seg = loadSegment(g, st, info, states, segs, coeffs,
                            segLoop.getInductionVar());
  Type i32 = b.getI32Type();
  Value srPartial;
  if (sr) {
    // Per segment: t of its group (device globals) and its tensor index.
    Value globals = g.toGlobal(entry.getArgument(5));
    Value tD = g.load(b.getF64Type(),
                      g.gep(b.getF64Type(), globals,
                            g.add(g.mul(seg.group, g.i64(ZOPT_NUM_GLOBALS)),
                                  g.i64(ZOPT_GLOBAL_STEP))));
    Value t = arith::FPToUIOp::create(b, loc, b.getI64Type(), tD);
    Value tensor = g.load(
        i32, g.gep(i32, segs, g.add(g.mul(segLoop.getInductionVar(), g.i64(4)),
                                   g.i64(3))));
    srPartial = srKeyPartial(g, entry.getArgument(6), t, tensor);
  }
  // The key and i32 index of element i (vectors never straddle 2^32).
  auto setSr = [&](BodyEmitter &e, Value i) {
    if (!sr)
      return;
    Value hi = arith::TruncIOp::create(
        b, loc, i32, arith::ShRUIOp::create(b, loc, i, g.i64(32)));
    e.srKey = fmix32(g, arith::XOrIOp::create(b, loc, srPartial, hi));
    Value lo = arith::TruncIOp::create(b, loc, i32, i);
    if (e.lanes == 1) {
      e.srIndex = lo;
      return;
    }
    SmallVector<int32_t> iota(e.lanes);
    for (int j = 0; j < e.lanes; ++j)
      iota[j] = j;
    auto vt = VectorType::get({e.lanes}, i32);
    e.srIndex = arith::AddIOp::create(
        b, loc, vector::BroadcastOp::create(b, loc, vt, lo),
        arith::ConstantOp::create(b, loc, DenseIntElementsAttr::get(vt, iota)));
  };
  auto vl = scf::ForOp::create(b, loc, g.mul(gtid, L), seg.nVec, g.mul(nthr, L));
  {
    OpBuilder::InsertionGuard ig(b);
    b.setInsertionPoint(vl.getBody()->getTerminator());
    BodyEmitter e{b, loc, info.lanes, seg.ptrs, seg.cs, seg.cv};
    e.vecAlign = 16;
    setSr(e, vl.getInductionVar());
    e.emit(body, vl.getInductionVar());
  }
  auto sl = scf::ForOp::create(b, loc, g.add(seg.nVec, gtid), seg.n, nthr);
  {
    OpBuilder::InsertionGuard ig(b);
    b.setInsertionPoint(sl.getBody()->getTerminator());
    BodyEmitter e{b, loc, 1, seg.ptrs, seg.cs, {}};
    setSr(e, sl.getInductionVar());
    e.emit(body, sl.getInductionVar());
  }
  b.setInsertionPointToEnd(&entry);
  gpu::ReturnOp::create(b, loc);
}

static void buildSumsqKernel(OpBuilder &gb, zk::KernelOp k, const Step &st) {
  OpBuilder::InsertionGuard guard(gb);
  Location loc = k.getLoc();
  MLIRContext *ctx = gb.getContext();
  Type ptr = LLVM::LLVMPointerType::get(ctx), i64 = gb.getI64Type(),
       f64 = gb.getF64Type(), i32 = gb.getI32Type();
  KernelInfo info = analyze(k);
  auto wg = gpu::AddressSpaceAttr::get(ctx, gpu::AddressSpace::Workgroup);
  auto redTy = MemRefType::get({ZOPT_GPU_BLOCK}, f64, AffineMap(), wg);
  auto flagTy = MemRefType::get({1}, i32, AffineMap(), wg);
  auto fn = makeKernel(gb, loc, k.getSymName(),
                       {ptr, ptr, i64, ptr, ptr, ptr, ptr, ptr, i64},
                       {redTy, flagTy});
  Block &entry = fn.getBody().front();
  Value states = entry.getArgument(0), segs = entry.getArgument(1),
        nseg = entry.getArgument(2), coeffs = entry.getArgument(3),
        partials = entry.getArgument(4), sg = entry.getArgument(5),
        hypers = entry.getArgument(6), globals = entry.getArgument(7),
        ngroups = entry.getArgument(8);
  Value red = fn.getWorkgroupAttributions()[0],
        flag = fn.getWorkgroupAttributions()[1];
  OpBuilder b = OpBuilder::atBlockEnd(&entry);
  G g{b, loc};
  Block &body = k.getBody().front();
  for (Value *v : {&states, &segs, &coeffs, &partials, &sg, &hypers, &globals})
    *v = g.toGlobal(*v);
  auto [gtidB, nthrB] = g.grid();
  Value gtid = gtidB, nthr = nthrB;
  Value L = g.i64(info.lanes);

  // Stage 1: this thread's sum of squares, in f64.
  auto segLoop = scf::ForOp::create(
      b, loc, g.i64(0), nseg, g.i64(1), ValueRange{g.f64(0.0)},
      [&](OpBuilder &lb, Location l, Value s, ValueRange iter) {
        G gl{lb, l};
        Segment seg = loadSegment(gl, st, info, states, segs, coeffs, s);
        auto vl = scf::ForOp::create(
            lb, l, gl.mul(gtid, L), seg.nVec, gl.mul(nthr, L), iter,
            [&](OpBuilder &vb, Location vl2, Value iv, ValueRange acc) {
              BodyEmitter e{vb, vl2, info.lanes, seg.ptrs, seg.cs, seg.cv};
              e.vecAlign = 16;
              Value sq = e.emit(body, iv);
              Value a = acc[0];
              G gv{vb, vl2};
              for (int i = 0; i < info.lanes; ++i)
                a = arith::AddFOp::create(
                    vb, vl2, a,
                    LLVM::ExtractElementOp::create(vb, vl2, sq, gv.i32(i)));
              scf::YieldOp::create(vb, vl2, ValueRange{a});
            });
        auto sl = scf::ForOp::create(
            lb, l, gl.add(seg.nVec, gtid), seg.n, nthr, vl.getResults(),
            [&](OpBuilder &sb, Location sl2, Value iv, ValueRange acc) {
              BodyEmitter e{sb, sl2, 1, seg.ptrs, seg.cs, {}};
              Value sq = e.emit(body, iv);
              scf::YieldOp::create(
                  sb, sl2, ValueRange{arith::AddFOp::create(sb, sl2, acc[0], sq)});
            });
        scf::YieldOp::create(lb, l, sl.getResults());
      });

  // Block tree reduction in shared memory (blockDim.x == ZOPT_GPU_BLOCK).
  Value tx = gpu::ThreadIdOp::create(b, loc, gpu::Dimension::x);
  memref::StoreOp::create(b, loc, segLoop.getResult(0), red, ValueRange{tx});
  gpu::BarrierOp::create(b, loc);
  for (int64_t stride = ZOPT_GPU_BLOCK / 2; stride > 0; stride /= 2) {
    Value c = arith::ConstantIndexOp::create(b, loc, stride);
    Value lt = arith::CmpIOp::create(b, loc, arith::CmpIPredicate::ult, tx, c);
    auto i = scf::IfOp::create(b, loc, lt, false);
    {
      OpBuilder::InsertionGuard ig(b);
      b.setInsertionPoint(i.thenBlock()->getTerminator());
      Value other = arith::AddIOp::create(b, loc, tx, c);
      Value x = memref::LoadOp::create(b, loc, red, ValueRange{tx});
      Value y = memref::LoadOp::create(b, loc, red, ValueRange{other});
      memref::StoreOp::create(b, loc, arith::AddFOp::create(b, loc, x, y), red,
                              ValueRange{tx});
    }
    gpu::BarrierOp::create(b, loc);
  }

  // Stage 2: thread 0 publishes the partial; the last block finishes.
  Value zeroIdx = arith::ConstantIndexOp::create(b, loc, 0);
  Value isT0 = arith::CmpIOp::create(b, loc, arith::CmpIPredicate::eq, tx, zeroIdx);
  auto t0 = scf::IfOp::create(b, loc, isT0, false);
  {
    OpBuilder::InsertionGuard ig(b);
    b.setInsertionPoint(t0.thenBlock()->getTerminator());
    Value total = memref::LoadOp::create(b, loc, red, ValueRange{zeroIdx});
    LLVM::StoreOp::create(b, loc, total, g.gep(f64, partials, g.bid()));
    NVVM::MembarOp::create(b, loc, NVVM::MemScopeKind::GPU);
    Value old = LLVM::AtomicRMWOp::create(
        b, loc, LLVM::AtomicBinOp::add, g.gepc(i32, sg, kSgDone), g.i32(1),
        LLVM::AtomicOrdering::acq_rel);
    Value last = arith::CmpIOp::create(
        b, loc, arith::CmpIPredicate::eq, old,
        arith::TruncIOp::create(b, loc, i32,
                                arith::SubIOp::create(b, loc, g.gdim(), g.i64(1))));
    memref::StoreOp::create(b, loc, arith::ExtUIOp::create(b, loc, i32, last),
                            flag, ValueRange{zeroIdx});
  }
  gpu::BarrierOp::create(b, loc);
  Value isLast = arith::CmpIOp::create(
      b, loc, arith::CmpIPredicate::ne,
      memref::LoadOp::create(b, loc, flag, ValueRange{zeroIdx}), g.i32(0));
  auto lastIf = scf::IfOp::create(b, loc, isLast, false);
  b.setInsertionPoint(lastIf.thenBlock()->getTerminator());
  auto fin = scf::IfOp::create(b, loc, isT0, false);
  {
    OpBuilder::InsertionGuard ig(b);
    b.setInsertionPoint(fin.thenBlock()->getTerminator());
    NVVM::MembarOp::create(b, loc, NVVM::MemScopeKind::GPU);
    auto sum = scf::ForOp::create(
        b, loc, g.i64(0), g.gdim(), g.i64(1), ValueRange{g.f64(0.0)},
        [&](OpBuilder &lb, Location l, Value i, ValueRange acc) {
          G gl{lb, l};
          Value p = LLVM::LoadOp::create(lb, l, f64, gl.gep(f64, partials, i),
                                         /*alignment=*/8, /*isVolatile=*/true);
          scf::YieldOp::create(lb, l,
                               ValueRange{arith::AddFOp::create(lb, l, acc[0], p)});
        });
    Value s = sum.getResult(0);
    Value norm = math::SqrtOp::create(b, loc, s);
    Value clip = g.f64(1.0);
    if (st.flags & ZOPT_FLAG_CLIP) {
      Value q = arith::DivFOp::create(
          b, loc, g.f64(st.maxNorm), arith::AddFOp::create(b, loc, norm, g.f64(1e-6)));
      Value lt1 = arith::CmpFOp::create(b, loc, arith::CmpFPredicate::OLT, q,
                                        g.f64(1.0));
      clip = arith::SelectOp::create(b, loc, lt1, q, g.f64(1.0));
    }
    Value nan = arith::CmpFOp::create(b, loc, arith::CmpFPredicate::UNO, s, s);
    Value inf = arith::CmpFOp::create(b, loc, arith::CmpFPredicate::OEQ, s,
                                      g.f64(std::numeric_limits<double>::infinity()));
    Value nonfinite = arith::ExtUIOp::create(
        b, loc, i32, arith::OrIOp::create(b, loc, nan, inf));
    // A non-finite norm skips the whole step, as on the CPU.
    Value skip = nonfinite;
    LLVM::StoreOp::create(b, loc, s, g.gepc(f64, sg, kSgSumsq));
    LLVM::StoreOp::create(b, loc, norm, g.gepc(f64, sg, kSgNorm));
    LLVM::StoreOp::create(b, loc, clip, g.gepc(f64, sg, kSgClip));
    LLVM::StoreOp::create(b, loc, nonfinite, g.gepc(i32, sg, kSgNonfinite));
    LLVM::StoreOp::create(b, loc, skip, g.gepc(i32, sg, kSgSkip));
    LLVM::StoreOp::create(b, loc, g.i32(0), g.gepc(i32, sg, kSgDone));
    memref::StoreOp::create(b, loc, clip, red, ValueRange{zeroIdx});
  }
  gpu::BarrierOp::create(b, loc);
  // The coefficient table again, with the device's clip coefficient.
  Value clip = memref::LoadOp::create(b, loc, red, ValueRange{zeroIdx});
  auto gl = scf::ForOp::create(b, loc, g.toI64(tx), ngroups, g.bdim());
  {
    OpBuilder::InsertionGuard ig(b);
    b.setInsertionPoint(gl.getBody()->getTerminator());
    emitPrepareForGroup(g, st, hypers, globals, coeffs, gl.getInductionVar(),
                        clip);
  }
  b.setInsertionPointToEnd(&entry);
  gpu::ReturnOp::create(b, loc);
}

/// FINISH: the step's bookkeeping on the device (abi.h): step counts, the
/// dynamic loss scaler and 1/S in the globals table. Thread 0 of block 0.
static void buildFinishKernel(OpBuilder &gb, Location loc, const Step &st) {
  OpBuilder::InsertionGuard guard(gb);
  MLIRContext *ctx = gb.getContext();
  Type ptr = LLVM::LLVMPointerType::get(ctx), i64 = gb.getI64Type(),
       f64 = gb.getF64Type(), i32 = gb.getI32Type();
  auto fn = makeKernel(gb, loc, st.name + "_finish", {ptr, i64, ptr, ptr});
  Block &entry = fn.getBody().front();
  Value globals = entry.getArgument(0), ngroups = entry.getArgument(1),
        sgGeneric = entry.getArgument(2), scGeneric = entry.getArgument(3);
  OpBuilder b = OpBuilder::atBlockEnd(&entry);
  G g{b, loc};
  globals = g.toGlobal(globals);
  Value sg = g.toGlobal(sgGeneric), sc = g.toGlobal(scGeneric);
  auto isNull = [&](Value p) {
    return LLVM::ICmpOp::create(b, loc, LLVM::ICmpPredicate::eq, p,
                                LLVM::ZeroOp::create(b, loc, ptr));
  };
  Value first = arith::AndIOp::create(
      b, loc,
      arith::CmpIOp::create(b, loc, arith::CmpIPredicate::eq, g.tid(), g.i64(0)),
      arith::CmpIOp::create(b, loc, arith::CmpIPredicate::eq, g.bid(), g.i64(0)));
  auto t0 = scf::IfOp::create(b, loc, first, /*withElse=*/false);
  b.setInsertionPoint(t0.thenBlock()->getTerminator());

  // skip = sg ? sg->skip : 0
  Value sgNull = isNull(sgGeneric);
  auto skipIf = scf::IfOp::create(
      b, loc, sgNull,
      [&](OpBuilder &tb, Location l) {
        scf::YieldOp::create(tb, l, ValueRange{G{tb, l}.i32(0)});
      },
      [&](OpBuilder &eb, Location l) {
        G ge{eb, l};
        scf::YieldOp::create(
            eb, l, ValueRange{ge.load(i32, ge.gepc(i32, sg, kSgSkip))});
      });
  Value skip = arith::CmpIOp::create(b, loc, arith::CmpIPredicate::ne,
                                     skipIf.getResult(0), g.i32(0));
  Value applied = arith::XOrIOp::create(
      b, loc, skip, arith::ConstantOp::create(b, loc, b.getBoolAttr(true)));
  auto stepIf = scf::IfOp::create(b, loc, applied, /*withElse=*/false);
  {
    OpBuilder::InsertionGuard ig(b);
    b.setInsertionPoint(stepIf.thenBlock()->getTerminator());
    auto loop = scf::ForOp::create(b, loc, g.i64(0), ngroups, g.i64(1));
    {
      OpBuilder::InsertionGuard lg(b);
      b.setInsertionPoint(loop.getBody()->getTerminator());
      Value p = g.gep(f64, globals,
                      g.add(g.mul(loop.getInductionVar(), g.i64(ZOPT_NUM_GLOBALS)),
                            g.i64(ZOPT_GLOBAL_STEP)));
      LLVM::StoreOp::create(
          b, loc, arith::AddFOp::create(b, loc, g.load(f64, p), g.f64(1.0)), p);
    }
    auto cnt = scf::IfOp::create(
        b, loc,
        arith::XOrIOp::create(b, loc, sgNull,
                              arith::ConstantOp::create(b, loc, b.getBoolAttr(true))),
        /*withElse=*/false);
    b.setInsertionPoint(cnt.thenBlock()->getTerminator());
    Value p = g.gepc(i32, sg, kSgApplied);
    LLVM::StoreOp::create(b, loc, g.add(g.load(i32, p), g.i32(1)), p);
  }

  if (st.flags & ZOPT_FLAG_LOSS_SCALE) {
    auto scIf = scf::IfOp::create(
        b, loc,
        arith::XOrIOp::create(b, loc, isNull(scGeneric),
                              arith::ConstantOp::create(b, loc, b.getBoolAttr(true))),
        /*withElse=*/false);
    b.setInsertionPoint(scIf.thenBlock()->getTerminator());
    auto fld = [&](Type t, int64_t i) { return g.gepc(t, sc, i); };
    Value scale = g.load(f64, fld(f64, kScScale));
    LLVM::StoreOp::create(b, loc, scale, fld(f64, kScLast));
    Value good = g.load(i64, fld(i64, kScGood));
    Value dynamic = arith::CmpIOp::create(b, loc, arith::CmpIPredicate::ne,
                                          g.load(i32, fld(i32, kScDynamic)),
                                          g.i32(0));
    // Skipped: back off, never below min_scale.
    Value minS = g.load(f64, fld(f64, kScMin));
    Value backed = arith::MulFOp::create(b, loc, scale,
                                         g.load(f64, fld(f64, kScBackoff)));
    Value backedC = arith::SelectOp::create(
        b, loc,
        arith::CmpFOp::create(b, loc, arith::CmpFPredicate::OLT, backed, minS),
        minS, backed);
    // Applied: grow after growth_interval good steps, if the result is finite.
    Value good1 = g.add(good, g.i64(1));
    Value grow = arith::CmpIOp::create(b, loc, arith::CmpIPredicate::sge, good1,
                                       g.load(i64, fld(i64, kScInterval)));
    Value grown = arith::MulFOp::create(b, loc, scale,
                                        g.load(f64, fld(f64, kScGrowth)));
    Value finite = arith::CmpFOp::create(
        b, loc, arith::CmpFPredicate::OLT, math::AbsFOp::create(b, loc, grown),
        g.f64(std::numeric_limits<double>::infinity()));
    Value applyScale = arith::SelectOp::create(
        b, loc, arith::AndIOp::create(b, loc, grow, finite), grown, scale);
    Value applyGood = arith::SelectOp::create(b, loc, grow, g.i64(0), good1);
    Value newScale = arith::SelectOp::create(b, loc, skip, backedC, applyScale);
    Value newGood = arith::SelectOp::create(b, loc, skip, g.i64(0), applyGood);
    newScale = arith::SelectOp::create(b, loc, dynamic, newScale, scale);
    newGood = arith::SelectOp::create(b, loc, dynamic, newGood, good);
    LLVM::StoreOp::create(b, loc, newScale, fld(f64, kScScale));
    LLVM::StoreOp::create(b, loc, newGood, fld(i64, kScGood));
    // GRAD_SCALE = 1 / (S * D) (abi.h).
    Value inv = arith::DivFOp::create(
        b, loc, g.f64(1.0),
        arith::MulFOp::create(b, loc, newScale, g.load(f64, fld(f64, kScDivisor))));
    auto loop = scf::ForOp::create(b, loc, g.i64(0), ngroups, g.i64(1));
    b.setInsertionPoint(loop.getBody()->getTerminator());
    LLVM::StoreOp::create(
        b, loc, inv,
        g.gep(f64, globals,
              g.add(g.mul(loop.getInductionVar(), g.i64(ZOPT_NUM_GLOBALS)),
                    g.i64(ZOPT_GLOBAL_GRAD_SCALE))));
  }
  b.setInsertionPointToEnd(&entry);
  gpu::ReturnOp::create(b, loc);
}

struct ConvertZKToGPU
    : public mlir::zopt::impl::ConvertZKToGPUBase<ConvertZKToGPU> {
  using Base::Base;
  void runOnOperation() override {
    ModuleOp m = getOperation();
    MLIRContext *ctx = &getContext();
    auto descs = llvm::to_vector(m.getOps<zk::DescriptorOp>());
    auto preps = llvm::to_vector(m.getOps<zk::PrepareOp>());
    if (descs.size() != 1 || preps.size() != 1) {
      m.emitError("expected exactly one zk.descriptor and one zk.prepare");
      return signalPassFailure();
    }
    zk::DescriptorOp d = descs.front();
    // The update runs where the optimizer states live (the plan made them
    // agree); with only param/grad, where the param is.
    ArrayRef<int32_t> kinds = d.getStateKinds(), places = d.getStatePlacements();
    int32_t device = 0;
    for (auto [k, p] : llvm::zip(kinds, places))
      if (k != ZOPT_STATE_PARAM && k != ZOPT_STATE_GRAD)
        device = p;
    if (!device)
      for (auto [k, p] : llvm::zip(kinds, places))
        if (k == ZOPT_STATE_PARAM)
          device = p;
    if (device != ZOPT_PLACE_GPU)
      return; // a CPU step: convert-zk-to-cpu does everything
    if (chips.empty()) {
      d.emitError("the optimizer states are on the GPU but no GPU "
                  "architecture was given (gpu_arch / --gpu)");
      return signalPassFailure();
    }

    Step st{d.getName().str(),    int64_t(kinds.size()),
            int64_t(d.getHyperKinds().size()), int64_t(d.getNumCoeffs()),
            uint32_t(d.getFlags()), d.getMaxNorm().convertToDouble(),
            preps.front()};
    SmallVector<Attribute> targets, images;
    for (const std::string &chip : chips) {
      int sm = 0;
      if (!StringRef(chip).starts_with("sm_") ||
          StringRef(chip).drop_front(3).take_while(llvm::isDigit).getAsInteger(10, sm) ||
          sm < 70) {
        d.emitError("unknown GPU architecture '") << chip
            << "'; expected sm_70 or newer, e.g. sm_80, sm_90";
        return signalPassFailure();
      }
      Attribute t = parseAttribute(
          ("#nvvm.target<O = 3, chip = \"" + chip + "\", features = \"" +
           features + "\">"),
          ctx);
      if (!t) {
        d.emitError("cannot make an NVVM target for '") << chip << "'";
        return signalPassFailure();
      }
      targets.push_back(t);
      images.push_back(ArrayAttr::get(
          ctx, {IntegerAttr::get(IntegerType::get(ctx, 32), sm),
                StringAttr::get(ctx, st.name + "_gpu_" + chip)}));
    }

    m->setAttr(gpu::GPUDialect::getContainerModuleAttrName(),
               UnitAttr::get(ctx));
    OpBuilder mb = OpBuilder::atBlockEnd(m.getBody());
    auto gm = gpu::GPUModuleOp::create(mb, d.getLoc(), st.name + "_gpu",
                                       ArrayAttr::get(ctx, targets));
    OpBuilder gb = OpBuilder::atBlockEnd(gm.getBody());
    SmallVector<Attribute> entries;
    auto entry = [&](zopt_kernel_role role, StringRef sym) {
      entries.push_back(ArrayAttr::get(
          ctx, {IntegerAttr::get(IntegerType::get(ctx, 32), role),
                StringAttr::get(ctx, sym)}));
    };
    buildPrepareKernel(gb, d.getLoc(), st);
    entry(ZOPT_KERNEL_PREPARE, st.name + "_prepare_gpu");
    for (auto k : llvm::make_early_inc_range(m.getOps<zk::KernelOp>())) {
      if (k.getRole() == zk::KernelRole::sumsq) {
        buildSumsqKernel(gb, k, st);
        entry(ZOPT_KERNEL_SUMSQ, k.getSymName());
      } else {
        buildUpdateKernel(gb, k, st);
        entry(ZOPT_KERNEL_UPDATE, k.getSymName());
      }
      k.erase();
    }
    buildFinishKernel(gb, d.getLoc(), st);
    entry(ZOPT_KERNEL_FINISH, st.name + "_finish");
    d->setAttr("zopt.gpu_kernels", ArrayAttr::get(ctx, entries));
    d->setAttr("zopt.gpu_images", ArrayAttr::get(ctx, images));
  }
};

/// Replaces each gpu.binary by exported byte arrays `<name>_<chip>` (one per
/// object) and `const uint64_t <name>_<chip>_size`.
struct ZoptEmbedGPUBinaries
    : public mlir::zopt::impl::ZoptEmbedGPUBinariesBase<ZoptEmbedGPUBinaries> {
  void runOnOperation() override {
    ModuleOp m = getOperation();
    MLIRContext *ctx = &getContext();
    OpBuilder mb = OpBuilder::atBlockEnd(m.getBody());
    for (auto bin : llvm::make_early_inc_range(m.getOps<gpu::BinaryOp>())) {
      for (Attribute a : bin.getObjects()) {
        auto obj = cast<gpu::ObjectAttr>(a);
        auto t = dyn_cast<NVVM::NVVMTargetAttr>(obj.getTarget());
        if (!t) {
          bin.emitError("only NVVM targets can be embedded");
          return signalPassFailure();
        }
        std::string sym = (bin.getSymName() + "_" + t.getChip()).str();
        StringRef bytes = obj.getObject().getValue();
        auto arr = LLVM::LLVMArrayType::get(IntegerType::get(ctx, 8), bytes.size());
        LLVM::GlobalOp::create(mb, bin.getLoc(), arr, /*isConstant=*/true,
                               LLVM::Linkage::External, sym,
                               mb.getStringAttr(bytes), /*alignment=*/16);
        LLVM::GlobalOp::create(mb, bin.getLoc(), mb.getI64Type(), true,
                               LLVM::Linkage::External, sym + "_size",
                               mb.getI64IntegerAttr(bytes.size()), 8);
      }
      bin.erase();
    }
    m->removeAttr(gpu::GPUDialect::getContainerModuleAttrName());
  }
};

/// libdevice's __nv_sqrtf is sqrt.approx unless __CUDA_PREC_SQRT is
/// reflected on; the CPU kernels use the IEEE square root. Calls to
/// __nv_sqrtf/__nv_sqrt become llvm.intr.sqrt (sqrt.rn.f32/f64).
struct ZoptGPUPreciseSqrt
    : public mlir::zopt::impl::ZoptGPUPreciseSqrtBase<ZoptGPUPreciseSqrt> {
  void runOnOperation() override {
    Operation *m = getOperation();
    SmallVector<LLVM::CallOp> calls;
    m->walk([&](LLVM::CallOp c) {
      if (auto callee = c.getCallee();
          callee && (*callee == "__nv_sqrtf" || *callee == "__nv_sqrt"))
        calls.push_back(c);
    });
    for (LLVM::CallOp c : calls) {
      OpBuilder b(c);
      c.getResult().replaceAllUsesWith(
          LLVM::SqrtOp::create(b, c.getLoc(), c.getArgOperands()[0]).getResult());
      c.erase();
    }
    m->walk([](LLVM::LLVMFuncOp f) {
      if (f.isExternal() &&
          (f.getName() == "__nv_sqrtf" || f.getName() == "__nv_sqrt") &&
          f.symbolKnownUseEmpty(f->getParentOp()))
        f.erase();
    });
  }
};

} // namespace
