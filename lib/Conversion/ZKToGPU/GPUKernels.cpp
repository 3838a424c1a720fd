//===- GPUKernels.cpp - the CUDA kernels of a GPU step --------------------===//
//
// The kernel builders of convert-zk-to-gpu (GPUKernels.h says which kernels
// and their launch ABI). The update is ONE persistent grid-stride launch
// over a chunk work list; the kernel body is the shared BodyEmitter
// (lib/Conversion/ZKCommon) at 16 bytes per access of the narrowest state
// (4 x f32 or 8 x 16-bit lanes) plus a scalar head and tail. SUMSQ is a
// two-stage f64 reduction whose last block evaluates the step's zk.control
// (norm, clip coefficient, skip) on the device; FINISH evaluates it again
// for the step counts and the loss scaler, which it keeps there.
//
//===----------------------------------------------------------------------===//
#include "GPUKernels.h"

#include "../ZKCommon/BodyEmitter.h"
#include "zopt/abi.h"

#include "mlir/Dialect/GPU/IR/GPUDialect.h"
#include "mlir/Dialect/LLVMIR/NVVMDialect.h"
#include "mlir/Dialect/Math/IR/Math.h"
#include "mlir/Dialect/MemRef/IR/MemRef.h"
#include "mlir/Dialect/SCF/IR/SCF.h"

#include <cstddef>
#include <limits>

using namespace mlir;
using namespace mlir::zopt;
using namespace mlir::zopt::gpu_kernels;

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

static_assert(sizeof(zopt_gpu_chunk) == 16, "chunk layout");

struct KernelInfo {
  SmallVector<int64_t> slots; // used state slots
  SmallVector<int> bytes;     // element bytes of each used slot
  int64_t numCoeffs = 0;      // 1 + the highest coefficient index used
  int lanes = 4;              // 16 bytes of the narrowest state
  int anchor = 0;             // index into `slots` of a narrowest state
};

static KernelInfo analyze(zk::KernelOp k) {
  KernelInfo info;
  int minBytes = 4;
  auto use = [&](int64_t slot, Type t) {
    int bytes = t.getIntOrFloatBitWidth() / 8;
    if (!llvm::is_contained(info.slots, slot)) {
      info.slots.push_back(slot);
      info.bytes.push_back(bytes);
    }
    minBytes = std::min<int>(minBytes, bytes);
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
  for (size_t i = 0; i < info.slots.size(); ++i)
    if (info.bytes[i] == minBytes) {
      info.anchor = int(i);
      break;
    }
  return info;
}

/// One entry of the work list (abi.h zopt_gpu_chunk): elements
/// [begin, end) of segment `seg`, its state pointers and coefficient row,
/// and where the 16-byte vector part [vecBegin, vecEnd) lies: the scalar
/// head [begin, vecBegin) brings every used pointer to a 16-byte boundary
/// at the same element (when one exists; else the whole chunk is scalar),
/// the vector part is a multiple of `lanes` long, the rest is a scalar tail.
struct Chunk {
  Value seg, begin, end, vecBegin, vecEnd; // i64
  Value group;                             // i64
  SmallVector<Value> ptrs;
  SmallVector<Value> cs, cv;
};

} // namespace


static Chunk loadChunk(G &g, const Step &st, const KernelInfo &info,
                       Value states, Value segs, Value chunks, Value coeffs,
                       Value c) {
  OpBuilder &b = g.b;
  Location loc = g.loc;
  Type i64 = b.getI64Type(), i32 = b.getI32Type();
  Chunk ch;
  auto zext = [&](Value v) { return arith::ExtUIOp::create(b, loc, i64, v); };
  ch.begin = g.load(i64, g.gep(i64, chunks, g.mul(c, g.i64(2))));
  ch.seg = zext(g.load(i32, g.gep(i32, chunks, g.add(g.mul(c, g.i64(4)), g.i64(2)))));
  Value n = zext(g.load(i32, g.gep(i32, chunks, g.add(g.mul(c, g.i64(4)), g.i64(3)))));
  ch.end = g.add(ch.begin, n);
  ch.group = zext(g.load(i32, g.gep(i32, segs, g.add(g.mul(ch.seg, g.i64(4)), g.i64(2)))));
  ch.ptrs.assign(st.numStates, Value());
  Value row = g.mul(ch.seg, g.i64(st.numStates));
  SmallVector<Value> addrs; // byte address of element `begin`, per used slot
  for (auto [slot, bytes] : llvm::zip(info.slots, info.bytes)) {
    Value generic =
        g.load(g.ptr(), g.gep(g.ptr(), states, g.add(row, g.i64(slot))));
    ch.ptrs[slot] = g.toGlobal(generic);
    Value base = LLVM::PtrToIntOp::create(b, loc, i64, generic);
    addrs.push_back(g.add(base, g.mul(ch.begin, g.i64(bytes))));
  }
  // The coefficient table has one row per segment (tensor): its group's
  // hyperparameters at the tensor's own step count.
  Value crow = g.gep(b.getF32Type(), coeffs, g.mul(ch.seg, g.i64(st.numCoeffs)));
  for (int64_t k = 0; k < info.numCoeffs; ++k) {
    ch.cs.push_back(g.load(b.getF32Type(), g.gepc(b.getF32Type(), crow, k)));
    ch.cv.push_back(g.splat(ch.cs.back(), info.lanes));
  }
  // The head h: the elements before the narrowest state's pointer reaches a
  // 16-byte boundary; every other used pointer must reach one at the same
  // element (their strides divide 16 bytes into fewer lanes, so h is the
  // only candidate below `lanes`).
  auto andi = [&](Value x, int64_t m) {
    return arith::AndIOp::create(b, loc, x, g.i64(m)).getResult();
  };
  auto eq0 = [&](Value x) {
    return arith::CmpIOp::create(b, loc, arith::CmpIPredicate::eq, x, g.i64(0))
        .getResult();
  };
  const int ea = info.bytes[info.anchor];
  Value mis = andi(addrs[info.anchor], 15);
  Value ok = eq0(andi(mis, ea - 1)); // element-aligned pointer
  Value h = arith::DivUIOp::create(b, loc, andi(arith::SubIOp::create(b, loc, g.i64(16), mis), 15),
                                   g.i64(ea));
  for (auto [addr, bytes] : llvm::zip(addrs, info.bytes))
    ok = arith::AndIOp::create(
        b, loc, ok, eq0(andi(g.add(addr, g.mul(h, g.i64(bytes))), 15)));
  h = arith::SelectOp::create(b, loc, ok, arith::MinUIOp::create(b, loc, h, n), n);
  ch.vecBegin = g.add(ch.begin, h);
  Value rest = arith::SubIOp::create(b, loc, n, h);
  Value nv = arith::SubIOp::create(b, loc, rest, andi(rest, info.lanes - 1));
  ch.vecEnd = g.add(ch.vecBegin, nv);
  return ch;
}

/// Emits `scalar(i)` for every scalar element of chunk `ch` (head and tail,
/// numbered j = 0, 1, ...: element begin + j in the head, else
/// vecEnd + j - h) taken by this thread (j = tid, tid + blockDim, ...), and
/// `vector(i)` for every vector of it (i = vecBegin + lanes * (tid + k *
/// blockDim)). `iter` is carried through both loops.
static ValueRange forChunkElements(
    G &g, const Chunk &ch, int lanes, ValueRange iter,
    function_ref<SmallVector<Value>(OpBuilder &, Location, Value, ValueRange)> vector,
    function_ref<SmallVector<Value>(OpBuilder &, Location, Value, ValueRange)> scalar) {
  OpBuilder &b = g.b;
  Location loc = g.loc;
  Value tid = g.tid(), bd = g.bdim();
  Value L = g.i64(lanes);
  auto vl = scf::ForOp::create(
      b, loc, g.add(ch.vecBegin, g.mul(tid, L)), ch.vecEnd, g.mul(bd, L), iter,
      [&](OpBuilder &vb, Location l, Value i, ValueRange acc) {
        scf::YieldOp::create(vb, l, vector(vb, l, i, acc));
      });
  Value h = arith::SubIOp::create(b, loc, ch.vecBegin, ch.begin);
  Value nScalar = g.add(h, arith::SubIOp::create(b, loc, ch.end, ch.vecEnd));
  auto sl = scf::ForOp::create(
      b, loc, tid, nScalar, bd, vl.getResults(),
      [&](OpBuilder &sb, Location l, Value j, ValueRange acc) {
        G gs{sb, l};
        Value inHead = arith::CmpIOp::create(sb, l, arith::CmpIPredicate::ult, j, h);
        Value i = arith::SelectOp::create(
            sb, l, inHead, gs.add(ch.begin, j),
            gs.add(ch.vecEnd, arith::SubIOp::create(sb, l, j, h)));
        scf::YieldOp::create(sb, l, scalar(sb, l, i, acc));
      });
  return sl.getResults();
}

static gpu::GPUFuncOp makeKernel(OpBuilder &gb, Location loc, StringRef name,
                                 ArrayRef<Type> args, int32_t blockSize,
                                 ArrayRef<Type> workgroup = {}) {
  auto fn = gpu::GPUFuncOp::create(
      gb, loc, name, FunctionType::get(gb.getContext(), args, {}), workgroup);
  fn->setAttr(gpu::GPUDialect::getKernelFuncAttrName(), gb.getUnitAttr());
  // .reqntid: the runtime launches every kernel with exactly this block
  // size (abi.h), and ptxas allocates registers for it. (known_block_size
  // would lower to .maxntid, an upper bound only.)
  fn->setAttr(NVVM::NVVMDialect::getReqntidAttrName(),
              gb.getDenseI32ArrayAttr({blockSize, 1, 1}));
  return fn;
}

/// The prepare body for row `row` (i64: segment `row`, one per tensor):
/// its group's hyperparameters and globals, but the tensor's own step t
/// (tensorT[row]) for the STEP global; writes row `row` of `coeffs`.
/// `clip` (f64) replaces the CLIP_COEF global when set.
static void emitPrepareForRow(G &g, const Step &st, Value hypers,
                              Value globals, Value segs, Value tensorT,
                              Value coeffs, Value row, Value clip) {
  OpBuilder &b = g.b;
  Type f64 = b.getF64Type(), f32 = b.getF32Type(), i32 = b.getI32Type();
  Value grp = arith::ExtUIOp::create(
      b, g.loc, b.getI64Type(),
      g.load(i32, g.gep(i32, segs, g.add(g.mul(row, g.i64(4)), g.i64(2)))));
  Value hrow = g.gep(f64, hypers, g.mul(grp, g.i64(st.numHypers)));
  Value grow = g.gep(f64, globals, g.mul(grp, g.i64(ZOPT_NUM_GLOBALS)));
  Value crow = g.gep(f32, coeffs, g.mul(row, g.i64(st.numCoeffs)));
  emitPrepareBody(
      b, g.loc, st.prepare,
      [&](int64_t i) { return g.load(f64, g.gepc(f64, hrow, i)); },
      [&](int64_t i) {
        if (clip && i == ZOPT_GLOBAL_CLIP_COEF)
          return clip;
        if (i == ZOPT_GLOBAL_STEP)
          return g.load(f64, g.gep(f64, tensorT, row));
        return g.load(f64, g.gepc(f64, grow, i));
      },
      [&](int64_t i, Value v) {
        LLVM::StoreOp::create(b, g.loc, v, g.gepc(f32, crow, i));
      });
}

void gpu_kernels::buildPrepareKernel(OpBuilder &gb, Location loc,
                                     const Step &st) {
  OpBuilder::InsertionGuard guard(gb);
  MLIRContext *ctx = gb.getContext();
  Type ptr = LLVM::LLVMPointerType::get(ctx), i64 = gb.getI64Type();
  // (hypers, globals, segs, tensor_t, num_rows, coeffs)
  auto fn = makeKernel(gb, loc, st.name + "_prepare_gpu",
                       {ptr, ptr, ptr, ptr, i64, ptr}, ZOPT_GPU_PREPARE_BLOCK);
  Block &entry = fn.getBody().front();
  OpBuilder b = OpBuilder::atBlockEnd(&entry);
  G g{b, loc};
  auto [gtid, nthr] = g.grid();
  auto loop = scf::ForOp::create(b, loc, gtid, entry.getArgument(4), nthr);
  {
    OpBuilder::InsertionGuard ig(b);
    b.setInsertionPoint(loop.getBody()->getTerminator());
    emitPrepareForRow(g, st, g.toGlobal(entry.getArgument(0)),
                      g.toGlobal(entry.getArgument(1)),
                      g.toGlobal(entry.getArgument(2)),
                      g.toGlobal(entry.getArgument(3)),
                      g.toGlobal(entry.getArgument(5)), loop.getInductionVar(),
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

/// The outer loop of the chunked kernels: chunk c = blockIdx.x,
/// blockIdx.x + gridDim.x, ... (abi.h: block b takes these chunks).
static scf::ForOp forChunks(G &g, Value numChunks, ValueRange iter = {}) {
  return scf::ForOp::create(g.b, g.loc, g.bid(), numChunks, g.gdim(), iter);
}

void gpu_kernels::buildUpdateKernel(OpBuilder &gb, zk::KernelOp k,
                                    const Step &st) {
  OpBuilder::InsertionGuard guard(gb);
  Location loc = k.getLoc();
  MLIRContext *ctx = gb.getContext();
  Type ptr = LLVM::LLVMPointerType::get(ctx), i64 = gb.getI64Type();
  KernelInfo info = analyze(k);
  // (states, segs, chunks, num_chunks, coeffs, sg, active); stochastic
  // rounding (abi.h): the tensors' step t (tensor_t) and the seed follow.
  bool sr = false;
  k.getBody().walk([&](zk::StoreOp s) {
    sr |= s.getRounding() == ZOPT_ROUND_STOCHASTIC;
  });
  SmallVector<Type> args = {ptr, ptr, ptr, i64, ptr, ptr, ptr};
  if (sr)
    args.append({ptr, i64});
  auto fn = makeKernel(gb, loc, k.getSymName(), args, ZOPT_GPU_BLOCK);
  Block &entry = fn.getBody().front();
  Value states = entry.getArgument(0), segs = entry.getArgument(1),
        chunks = entry.getArgument(2), nchunks = entry.getArgument(3),
        coeffs = entry.getArgument(4), sg = entry.getArgument(5),
        active = entry.getArgument(6);
  OpBuilder b = OpBuilder::atBlockEnd(&entry);
  G g{b, loc};
  Block &body = k.getBody().front();
  Value sgGeneric = sg;
  active = g.toGlobal(active);
  states = g.toGlobal(states);
  segs = g.toGlobal(segs);
  chunks = g.toGlobal(chunks);
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
  auto chunkLoop = forChunks(g, nchunks);
  b.setInsertionPoint(chunkLoop.getBody()->getTerminator());
  Chunk ch = loadChunk(g, st, info, states, segs, chunks, coeffs,
                       chunkLoop.getInductionVar());
  // A tensor not updated this step (active[seg] == 0) is left as it is.
  Value isActive = arith::CmpIOp::create(
      b, loc, arith::CmpIPredicate::ne,
      g.load(b.getI8Type(), g.gep(b.getI8Type(), active, ch.seg)),
      arith::ConstantOp::create(b, loc, b.getI8IntegerAttr(0)));
  auto activeIf = scf::IfOp::create(b, loc, isActive, /*withElse=*/false);
  b.setInsertionPoint(activeIf.thenBlock()->getTerminator());
  Type i32 = b.getI32Type();
  Value srPartial;
  if (sr) {
    // Per chunk: its tensor's step t (tensor_t) and its tensor index.
    Value tensorT = g.toGlobal(entry.getArgument(7));
    Value tD = g.load(b.getF64Type(), g.gep(b.getF64Type(), tensorT, ch.seg));
    Value t = arith::FPToUIOp::create(b, loc, b.getI64Type(), tD);
    Value tensor = g.load(
        i32, g.gep(i32, segs, g.add(g.mul(ch.seg, g.i64(4)), g.i64(3))));
    srPartial = srKeyPartial(g, entry.getArgument(8), t, tensor);
  }
  // The key and i32 index of element i (a chunk, hence a vector, never
  // straddles a multiple of 2^32 elements: abi.h).
  auto setSr = [&](OpBuilder &ob, Location l, BodyEmitter &e, Value i) {
    if (!sr)
      return;
    G go{ob, l};
    Value hi = arith::TruncIOp::create(
        ob, l, i32, arith::ShRUIOp::create(ob, l, i, go.i64(32)));
    e.srKey = emitFmix32(ob, l, arith::XOrIOp::create(ob, l, srPartial, hi));
    Value lo = arith::TruncIOp::create(ob, l, i32, i);
    if (e.lanes == 1) {
      e.srIndex = lo;
      return;
    }
    SmallVector<int32_t> iota(e.lanes);
    for (int j = 0; j < e.lanes; ++j)
      iota[j] = j;
    auto vt = VectorType::get({e.lanes}, i32);
    e.srIndex = arith::AddIOp::create(
        ob, l, vector::BroadcastOp::create(ob, l, vt, lo),
        arith::ConstantOp::create(ob, l, DenseIntElementsAttr::get(vt, iota)));
  };
  forChunkElements(
      g, ch, info.lanes, {},
      [&](OpBuilder &vb, Location l, Value i, ValueRange) {
        BodyEmitter e{vb, l, info.lanes, ch.ptrs, ch.cs, ch.cv};
        e.vecAlign = 16;
        setSr(vb, l, e, i);
        e.emit(body, i);
        return SmallVector<Value>{};
      },
      [&](OpBuilder &sb, Location l, Value i, ValueRange) {
        BodyEmitter e{sb, l, 1, ch.ptrs, ch.cs, {}};
        setSr(sb, l, e, i);
        e.emit(body, i);
        return SmallVector<Value>{};
      });
  b.setInsertionPointToEnd(&entry);
  gpu::ReturnOp::create(b, loc);
}

/// INIT (abi.h): every state initialized from the param (the master) gets
/// the param's values, converted as the host's convert() does (widening
/// exactly; narrowing to nearest even), over the work list at finalize.
void gpu_kernels::buildInitKernel(OpBuilder &gb, Location loc,
                                  const Step &st) {
  OpBuilder::InsertionGuard guard(gb);
  MLIRContext *ctx = gb.getContext();
  Type ptr = LLVM::LLVMPointerType::get(ctx), i64 = gb.getI64Type(),
       i32 = gb.getI32Type(), i16 = gb.getI16Type(), f32 = gb.getF32Type(),
       f16 = gb.getF16Type();
  auto fn = makeKernel(gb, loc, st.name + "_init_gpu", {ptr, ptr, ptr, i64},
                       ZOPT_GPU_BLOCK);
  Block &entry = fn.getBody().front();
  OpBuilder b = OpBuilder::atBlockEnd(&entry);
  G g{b, loc};
  int64_t param = -1;
  SmallVector<int64_t> targets;
  for (int64_t k = 0; k < st.numStates; ++k) {
    if (st.kinds[k] == ZOPT_STATE_PARAM)
      param = k;
    if (st.inits[k] == ZOPT_INIT_FROM_PARAM)
      targets.push_back(k);
  }
  auto memType = [&](int32_t dt) { return dt == ZOPT_DTYPE_F32 ? f32 : dt == ZOPT_DTYPE_F16 ? f16 : i16; };
  if (param >= 0 && !targets.empty()) {
    Value states = g.toGlobal(entry.getArgument(0)),
          chunks = g.toGlobal(entry.getArgument(2));
    auto chunkLoop = forChunks(g, entry.getArgument(3));
    b.setInsertionPoint(chunkLoop.getBody()->getTerminator());
    Value c = chunkLoop.getInductionVar();
    auto zext = [&](Value v) { return arith::ExtUIOp::create(b, loc, i64, v); };
    Value begin = g.load(i64, g.gep(i64, chunks, g.mul(c, g.i64(2))));
    Value seg = zext(g.load(i32, g.gep(i32, chunks, g.add(g.mul(c, g.i64(4)), g.i64(2)))));
    Value n = zext(g.load(i32, g.gep(i32, chunks, g.add(g.mul(c, g.i64(4)), g.i64(3)))));
    Value row = g.mul(seg, g.i64(st.numStates));
    auto slotPtr = [&](int64_t k) {
      return g.toGlobal(g.load(g.ptr(), g.gep(g.ptr(), states, g.add(row, g.i64(k)))));
    };
    Value src = slotPtr(param);
    SmallVector<Value> dst;
    for (int64_t k : targets)
      dst.push_back(slotPtr(k));
    auto loop = scf::ForOp::create(b, loc, g.add(begin, g.tid()), g.add(begin, n), g.bdim());
    b.setInsertionPoint(loop.getBody()->getTerminator());
    Value i = loop.getInductionVar();
    int32_t pdt = st.dtypes[param];
    Value x = g.load(memType(pdt), g.gep(memType(pdt), src, i));
    SmallVector<Value> noCoeffs;
    BodyEmitter e{b, loc, 1, {}, noCoeffs, {}};
    Value f = pdt == ZOPT_DTYPE_F32   ? x
              : pdt == ZOPT_DTYPE_F16 ? arith::ExtFOp::create(b, loc, f32, x).getResult()
                                      : e.bf16BitsToF32(x);
    for (auto [k, p] : llvm::zip(targets, dst)) {
      int32_t dt = st.dtypes[k];
      Value v = dt == pdt                ? x
                : dt == ZOPT_DTYPE_F32   ? f
                : dt == ZOPT_DTYPE_F16   ? arith::TruncFOp::create(b, loc, f16, f).getResult()
                                         : e.f32ToBf16BitsInt(f);
      LLVM::StoreOp::create(b, loc, v, g.gep(memType(dt), p, i));
    }
  }
  b.setInsertionPointToEnd(&entry);
  gpu::ReturnOp::create(b, loc);
}

LogicalResult gpu_kernels::buildSumsqKernel(OpBuilder &gb, zk::KernelOp k,
                                            const Step &st) {
  OpBuilder::InsertionGuard guard(gb);
  Location loc = k.getLoc();
  MLIRContext *ctx = gb.getContext();
  Type ptr = LLVM::LLVMPointerType::get(ctx), i64 = gb.getI64Type(),
       f64 = gb.getF64Type(), i32 = gb.getI32Type();
  KernelInfo info = analyze(k);
  auto wg = gpu::AddressSpaceAttr::get(ctx, gpu::AddressSpace::Workgroup);
  auto redTy = MemRefType::get({ZOPT_GPU_BLOCK}, f64, AffineMap(), wg);
  auto flagTy = MemRefType::get({1}, i32, AffineMap(), wg);
  // (states, segs, chunks, num_chunks, coeffs, partials, sg, hypers,
  //  globals, num_rows, tensor_t, active)
  auto fn = makeKernel(gb, loc, k.getSymName(),
                       {ptr, ptr, ptr, i64, ptr, ptr, ptr, ptr, ptr, i64, ptr, ptr},
                       ZOPT_GPU_BLOCK, {redTy, flagTy});
  Block &entry = fn.getBody().front();
  Value states = entry.getArgument(0), segs = entry.getArgument(1),
        chunks = entry.getArgument(2), nchunks = entry.getArgument(3),
        coeffs = entry.getArgument(4), partials = entry.getArgument(5),
        sg = entry.getArgument(6), hypers = entry.getArgument(7),
        globals = entry.getArgument(8), nrows = entry.getArgument(9),
        tensorT = entry.getArgument(10), active = entry.getArgument(11);
  Value red = fn.getWorkgroupAttributions()[0],
        flag = fn.getWorkgroupAttributions()[1];
  OpBuilder b = OpBuilder::atBlockEnd(&entry);
  G g{b, loc};
  Block &body = k.getBody().front();
  for (Value *v : {&states, &segs, &chunks, &coeffs, &partials, &sg, &hypers, &globals, &tensorT, &active})
    *v = g.toGlobal(*v);

  // Stage 1: this thread's sum of squares over its elements of the block's
  // chunks, in f64 (a fixed order for a fixed grid and work list).
  auto chunkLoop = scf::ForOp::create(
      b, loc, g.bid(), nchunks, g.gdim(), ValueRange{g.f64(0.0)},
      [&](OpBuilder &cb, Location cl, Value c, ValueRange iter) {
        G gc{cb, cl};
        Chunk ch = loadChunk(gc, st, info, states, segs, chunks, coeffs, c);
        // A tensor not updated this step adds nothing (+0.0 changes no sum).
        Value isActive = arith::CmpIOp::create(
            cb, cl, arith::CmpIPredicate::ne,
            gc.load(cb.getI8Type(), gc.gep(cb.getI8Type(), active, ch.seg)),
            arith::ConstantOp::create(cb, cl, cb.getI8IntegerAttr(0)));
        auto activeIf = scf::IfOp::create(cb, cl, TypeRange{f64}, isActive,
                                          /*withElse=*/true);
        scf::YieldOp::create(cb, cl, activeIf.getResults());
        OpBuilder::InsertionGuard aig(cb);
        cb.setInsertionPointToStart(&activeIf.getElseRegion().front());
        scf::YieldOp::create(cb, cl, iter);
        cb.setInsertionPointToStart(&activeIf.getThenRegion().front());
        ValueRange r = forChunkElements(
            gc, ch, info.lanes, iter,
            [&](OpBuilder &vb, Location l, Value i, ValueRange acc) {
              BodyEmitter e{vb, l, info.lanes, ch.ptrs, ch.cs, ch.cv};
              e.vecAlign = 16;
              Value sq = e.emit(body, i);
              Value a = acc[0];
              G gv{vb, l};
              for (int j = 0; j < info.lanes; ++j)
                a = arith::AddFOp::create(
                    vb, l, a, LLVM::ExtractElementOp::create(vb, l, sq, gv.i32(j)));
              return SmallVector<Value>{a};
            },
            [&](OpBuilder &sb, Location l, Value i, ValueRange acc) {
              BodyEmitter e{sb, l, 1, ch.ptrs, ch.cs, {}};
              Value sq = e.emit(body, i);
              return SmallVector<Value>{arith::AddFOp::create(sb, l, acc[0], sq)};
            });
        scf::YieldOp::create(cb, cl, r);
      });
  Value total = chunkLoop.getResult(0);

  // Block tree reduction in shared memory (blockDim.x == ZOPT_GPU_BLOCK).
  Value tx = gpu::ThreadIdOp::create(b, loc, gpu::Dimension::x);
  memref::StoreOp::create(b, loc, total, red, ValueRange{tx});
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
    // Release: the partial must be visible device-wide before the counter
    // says this block is done. The atomic below is written acq_rel, but
    // NVPTX lowers it to a relaxed `atom.global.add.u32` (no .acq_rel
    // qualifier, no fence): this membar.gl is what orders the store before
    // it, as __threadfence() does in CUDA's threadFenceReduction sample.
    // Do not remove it (nor the one after the atomic in the last block).
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
    // Acquire: the last block saw every other block's increment (relaxed,
    // see above); this membar.gl orders its reads of the partials after it,
    // and the reads are volatile (ld.volatile: not served from a stale L1).
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
    // The step's control (zk.control: the same IR as the host CONTROL) on
    // this sum, with the compiled max_norm: norm, clip coefficient, skip.
    using F = zk::ControlField;
    Value norm, clip, skip1;
    if (failed(emitControlBody(
            b, loc, st.control, {F::norm, F::clip_coef, F::skip},
            [&](F f) -> Value {
              if (f == F::sumsq)
                return s;
              if (f == F::max_norm)
                return g.f64(st.maxNorm);
              return Value(); // the scaler is FINISH's
            },
            [&](F f, Value v) {
              (f == F::norm ? norm : f == F::clip_coef ? clip : skip1) = v;
            })))
      return failure();
    Value nonfinite = arith::ExtUIOp::create(b, loc, i32, skip1);
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
  auto gl = scf::ForOp::create(b, loc, g.toI64(tx), nrows, g.bdim());
  {
    OpBuilder::InsertionGuard ig(b);
    b.setInsertionPoint(gl.getBody()->getTerminator());
    emitPrepareForRow(g, st, hypers, globals, segs, tensorT, coeffs,
                      gl.getInductionVar(), clip);
  }
  b.setInsertionPointToEnd(&entry);
  gpu::ReturnOp::create(b, loc);
  return success();
}

/// FINISH: the step's bookkeeping on the device (abi.h): step counts, the
/// dynamic loss scaler and 1/S in the globals table. One block: its threads
/// share the per-tensor and per-group counts; thread 0 the scaler.
LogicalResult gpu_kernels::buildFinishKernel(OpBuilder &gb, Location loc,
                                             const Step &st) {
  OpBuilder::InsertionGuard guard(gb);
  MLIRContext *ctx = gb.getContext();
  Type ptr = LLVM::LLVMPointerType::get(ctx), i64 = gb.getI64Type(),
       f64 = gb.getF64Type(), i32 = gb.getI32Type(), i8 = gb.getI8Type();
  // (globals, num_groups, sg, sc, tensor_t, active, num_rows)
  auto fn = makeKernel(gb, loc, st.name + "_finish",
                       {ptr, i64, ptr, ptr, ptr, ptr, i64}, ZOPT_GPU_FINISH_BLOCK);
  Block &entry = fn.getBody().front();
  Value globals = entry.getArgument(0), ngroups = entry.getArgument(1),
        sgGeneric = entry.getArgument(2), scGeneric = entry.getArgument(3),
        tensorT = entry.getArgument(4), active = entry.getArgument(5),
        nrows = entry.getArgument(6);
  OpBuilder b = OpBuilder::atBlockEnd(&entry);
  G g{b, loc};
  globals = g.toGlobal(globals);
  tensorT = g.toGlobal(tensorT);
  active = g.toGlobal(active);
  Value sg = g.toGlobal(sgGeneric), sc = g.toGlobal(scGeneric);
  auto isNull = [&](Value p) {
    return LLVM::ICmpOp::create(b, loc, LLVM::ICmpPredicate::eq, p,
                                LLVM::ZeroOp::create(b, loc, ptr));
  };
  auto notI1 = [&](Value v) {
    return arith::XOrIOp::create(b, loc, v,
                                 arith::ConstantOp::create(b, loc, b.getBoolAttr(true)));
  };
  Value tid = g.tid(), bdim = g.bdim();
  Value first = arith::AndIOp::create(
      b, loc, arith::CmpIOp::create(b, loc, arith::CmpIPredicate::eq, tid, g.i64(0)),
      arith::CmpIOp::create(b, loc, arith::CmpIPredicate::eq, g.bid(), g.i64(0)));
  auto isActive = [&](Value idx) {
    return arith::CmpIOp::create(b, loc, arith::CmpIPredicate::ne,
                                 g.load(i8, g.gep(i8, active, idx)),
                                 arith::ConstantOp::create(b, loc, b.getI8IntegerAttr(0)));
  };

  // The step's control (zk.control: the same IR as the host CONTROL) on
  // sumsq = sg ? sg->sumsq : 0 (no SUMSQ: never skipped) and the scaler.
  using F = zk::ControlField;
  Value sgNull = isNull(sgGeneric);
  auto sumsq = [&]() -> Value {
    auto r = scf::IfOp::create(
        b, loc, sgNull,
        [&](OpBuilder &tb, Location l) {
          scf::YieldOp::create(tb, l, ValueRange{G{tb, l}.f64(0.0)});
        },
        [&](OpBuilder &eb, Location l) {
          G ge{eb, l};
          scf::YieldOp::create(
              eb, l, ValueRange{ge.load(f64, ge.gepc(f64, sg, kSgSumsq))});
        });
    return r.getResult(0);
  };
  Value applied;
  if (failed(emitControlBody(
          b, loc, st.control, {F::advance},
          [&](F f) -> Value {
            if (f == F::sumsq)
              return sumsq();
            if (f == F::max_norm)
              return g.f64(st.maxNorm);
            return Value(); // counts do not depend on the scaler
          },
          [&](F, Value v) { applied = v; })))
    return failure();
  // When it advances: every updated tensor's t (tensor_t) and every group
  // with an updated tensor (active[num_rows + g]) its STEP global, the
  // block's threads striding over them; thread 0 counts the step.
  auto stepIf = scf::IfOp::create(b, loc, applied, /*withElse=*/false);
  {
    OpBuilder::InsertionGuard ig(b);
    b.setInsertionPoint(stepIf.thenBlock()->getTerminator());
    auto rows = scf::ForOp::create(b, loc, tid, nrows, bdim);
    {
      OpBuilder::InsertionGuard lg(b);
      b.setInsertionPoint(rows.getBody()->getTerminator());
      Value r = rows.getInductionVar();
      auto upd = scf::IfOp::create(b, loc, isActive(r), /*withElse=*/false);
      b.setInsertionPoint(upd.thenBlock()->getTerminator());
      Value p = g.gep(f64, tensorT, r);
      LLVM::StoreOp::create(
          b, loc, arith::AddFOp::create(b, loc, g.load(f64, p), g.f64(1.0)), p);
    }
    auto groups = scf::ForOp::create(b, loc, tid, ngroups, bdim);
    {
      OpBuilder::InsertionGuard lg(b);
      b.setInsertionPoint(groups.getBody()->getTerminator());
      Value gi = groups.getInductionVar();
      auto upd = scf::IfOp::create(b, loc, isActive(g.add(nrows, gi)), /*withElse=*/false);
      b.setInsertionPoint(upd.thenBlock()->getTerminator());
      Value p = g.gep(f64, globals,
                      g.add(g.mul(gi, g.i64(ZOPT_NUM_GLOBALS)), g.i64(ZOPT_GLOBAL_STEP)));
      LLVM::StoreOp::create(
          b, loc, arith::AddFOp::create(b, loc, g.load(f64, p), g.f64(1.0)), p);
    }
    auto cnt = scf::IfOp::create(b, loc, arith::AndIOp::create(b, loc, first, notI1(sgNull)),
                                 /*withElse=*/false);
    b.setInsertionPoint(cnt.thenBlock()->getTerminator());
    Value p = g.gepc(i32, sg, kSgApplied);
    LLVM::StoreOp::create(b, loc, g.add(g.load(i32, p), g.i32(1)), p);
  }

  if (st.flags & ZOPT_FLAG_LOSS_SCALE) {
    // sc is the same pointer for every thread: a uniform branch (the
    // barrier inside is reached by all or none).
    auto scIf = scf::IfOp::create(b, loc, notI1(isNull(scGeneric)), /*withElse=*/false);
    b.setInsertionPoint(scIf.thenBlock()->getTerminator());
    auto fld = [&](Type t, int64_t i) { return g.gepc(t, sc, i); };
    auto t0 = scf::IfOp::create(b, loc, first, /*withElse=*/false);
    {
      OpBuilder::InsertionGuard ig(b);
      b.setInsertionPoint(t0.thenBlock()->getTerminator());
      LLVM::StoreOp::create(b, loc, g.load(f64, fld(f64, kScScale)),
                            fld(f64, kScLast));
      Value newScale, newGood;
      if (failed(emitControlBody(
              b, loc, st.control, {F::new_scale, F::new_good_steps},
              [&](F f) -> Value {
                switch (f) {
                case F::sumsq: return sumsq();
                case F::max_norm: return g.f64(st.maxNorm);
                case F::scale: return g.load(f64, fld(f64, kScScale));
                case F::growth_factor: return g.load(f64, fld(f64, kScGrowth));
                case F::backoff_factor: return g.load(f64, fld(f64, kScBackoff));
                case F::min_scale: return g.load(f64, fld(f64, kScMin));
                case F::growth_interval: return g.load(i64, fld(i64, kScInterval));
                case F::good_steps: return g.load(i64, fld(i64, kScGood));
                case F::dynamic:
                  return arith::CmpIOp::create(b, loc, arith::CmpIPredicate::ne,
                                               g.load(i32, fld(i32, kScDynamic)),
                                               g.i32(0));
                default: return Value();
                }
              },
              [&](F f, Value v) { (f == F::new_scale ? newScale : newGood) = v; })))
        return failure();
      LLVM::StoreOp::create(b, loc, newScale, fld(f64, kScScale));
      LLVM::StoreOp::create(b, loc, newGood, fld(i64, kScGood));
    }
    gpu::BarrierOp::create(b, loc);
    // GRAD_SCALE = 1 / (S * D) (abi.h), with each group's sign kept: a
    // maximizing group's (ZOPT_GROUP_MAXIMIZE) is negative, as the host
    // wrote it.
    Value inv = arith::DivFOp::create(
        b, loc, g.f64(1.0),
        arith::MulFOp::create(b, loc, g.load(f64, fld(f64, kScScale)),
                              g.load(f64, fld(f64, kScDivisor))));
    auto loop = scf::ForOp::create(b, loc, tid, ngroups, bdim);
    b.setInsertionPoint(loop.getBody()->getTerminator());
    Value at = g.gep(f64, globals,
                     g.add(g.mul(loop.getInductionVar(), g.i64(ZOPT_NUM_GLOBALS)),
                           g.i64(ZOPT_GLOBAL_GRAD_SCALE)));
    Value negative = arith::CmpFOp::create(b, loc, arith::CmpFPredicate::OLT,
                                           g.load(f64, at), g.f64(0.0));
    Value signedInv = arith::SelectOp::create(
        b, loc, negative, arith::NegFOp::create(b, loc, inv), inv);
    LLVM::StoreOp::create(b, loc, signedInv, at);
  }
  b.setInsertionPointToEnd(&entry);
  gpu::ReturnOp::create(b, loc);
  return success();
}
