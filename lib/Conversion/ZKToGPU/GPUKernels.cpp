//===- GPUKernels.cpp - what the CUDA kernel builders share ---------------===//
//
// The IR helpers the kernel builders of convert-zk-to-gpu share (KernelIR.h;
// GPUKernels.h says which kernels and their launch ABI; one builder per
// file, KernelIR.h lists them). The update is ONE persistent grid-stride launch
// over a chunk work list; the kernel body is the shared BodyEmitter
// (lib/Conversion/ZKCommon) at 16 bytes per access of the narrowest state
// (4 x f32 or 8 x 16-bit lanes) plus a scalar head and tail. SUMSQ is a
// two-stage f64 reduction whose last block evaluates the step's zk.control
// (norm, clip coefficient, skip) on the device; FINISH evaluates it again
// for the step counts and the loss scaler, which it keeps there.
//
//===----------------------------------------------------------------------===//
#include "KernelIR.h"

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

KernelInfo gpu_kernels::analyze(zk::KernelOp k) {
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
    // A remainder master: two 16-bit halves, its slot and the param's.
    Type i16 = IntegerType::get(k.getContext(), 16);
    // A q8 moment: 8-bit codes and its absmax's slot (f32, per block).
    Type i8 = IntegerType::get(k.getContext(), 8);
    Type f32 = Float32Type::get(k.getContext());
    if (auto l = dyn_cast<zk::LoadOp>(op)) {
      if (auto h = l.getRemainderOf())
        use(*h, i16);
      if (auto a = l.getAbsmax())
        use(*a, f32);
      use(l.getSlot(), l.getRemainderOf() ? i16 : l.getAbsmax() ? i8 : l.getType());
    }
    if (auto s = dyn_cast<zk::StoreOp>(op)) {
      if (auto h = s.getRemainderOf())
        use(*h, i16);
      if (auto a = s.getAbsmax())
        use(*a, f32);
      if (auto c = s.getKahan()) // a Kahan param's compensation (bf16)
        use(*c, s.getStorage());
      use(s.getSlot(), s.getStorage());
    }
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

void gpu_kernels::blockTreeReduce(
    OpBuilder &b, Location loc, Value red, Value tx, Value value,
    function_ref<Value(OpBuilder &, Location, Value, Value)> combine) {
  memref::StoreOp::create(b, loc, value, red, ValueRange{tx});
  gpu::BarrierOp::create(b, loc);
  for (int64_t stride = ZOPT_GPU_BLOCK / 2; stride > 0; stride /= 2) {
    Value c = arith::ConstantIndexOp::create(b, loc, stride);
    Value lt = arith::CmpIOp::create(b, loc, arith::CmpIPredicate::ult, tx, c);
    auto lower = scf::IfOp::create(b, loc, lt, false);
    {
      OpBuilder::InsertionGuard ig(b);
      b.setInsertionPoint(lower.thenBlock()->getTerminator());
      Value other = arith::AddIOp::create(b, loc, tx, c);
      Value x = memref::LoadOp::create(b, loc, red, ValueRange{tx});
      Value y = memref::LoadOp::create(b, loc, red, ValueRange{other});
      memref::StoreOp::create(b, loc, combine(b, loc, x, y), red, ValueRange{tx});
    }
    gpu::BarrierOp::create(b, loc);
  }
}

Chunk gpu_kernels::loadChunk(G &g, const Step &st, const KernelInfo &info,
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
ValueRange gpu_kernels::forChunkElements(
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

gpu::GPUFuncOp gpu_kernels::makeKernel(OpBuilder &gb, Location loc, StringRef name,
                                 ArrayRef<Type> args, int32_t blockSize,
                                 ArrayRef<Type> workgroup) {
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
void gpu_kernels::emitPrepareForRow(G &g, const Step &st, Value hypers,
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

static Value fmix32(G &g, Value h) { return emitFmix32(g.b, g.loc, h); }

/// zopt_sr_key (abi.h) without its last step: fmix32(k ^ index_hi) of the
/// result is the key. seed, t: i64; tensor: i32.
Value gpu_kernels::srKeyPartial(G &g, Value seed, Value t, Value tensor) {
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
scf::ForOp gpu_kernels::forChunks(G &g, Value numChunks, ValueRange iter) {
  return scf::ForOp::create(g.b, g.loc, g.bid(), numChunks, g.gdim(), iter);
}
