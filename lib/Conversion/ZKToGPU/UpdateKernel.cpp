//===- UpdateKernel.cpp - the UPDATE kernel of a GPU step ----------------===//
//
// <step>_update (GPUKernels.h): ONE persistent grid-stride launch over the
// chunk work list; the body is the shared BodyEmitter (lib/Conversion/
// ZKCommon) at 16 bytes per access of the narrowest state (4 x f32 or 8 x
// 16-bit lanes) plus a scalar head and tail; inactive tensors and skipped
// steps are left alone; stochastic rounding keyed as abi.h says. With q8
// moments (abi.h "q8 moments") a chunk runs one q8 block per iteration, an
// element per thread, the block's absmax reduced in shared memory.
//
//===----------------------------------------------------------------------===//
#include "KernelIR.h"

#include "../ZKCommon/BodyEmitter.h"

#include "mlir/Dialect/Math/IR/Math.h"
#include "mlir/Dialect/MemRef/IR/MemRef.h"
#include "mlir/Dialect/Vector/IR/VectorOps.h"

using namespace mlir;
using namespace mlir::zopt;
using namespace mlir::zopt::gpu_kernels;

/// The elements of chunk `ch` of a step with q8 moments (abi.h "q8
/// moments"; the chunk starts at a block boundary of its tensor): per block
/// of ZOPT_Q8_BLOCK == ZOPT_GPU_BLOCK elements, thread t runs the body for
/// element b0 + t (decoding with the block's absmax), keeps its new moments
/// in registers, the block's new absmax is reduced in shared memory
/// (NaN-propagating max, exact, so any order gives the same bits), then
/// each thread encodes its element and thread 0 stores the absmax.
static void emitQ8Chunk(G &g, const Chunk &ch, Block &body, Value red,
                        function_ref<void(OpBuilder &, Location, BodyEmitter &,
                                          Value)> setSr) {
  static_assert(ZOPT_Q8_BLOCK == ZOPT_GPU_BLOCK, "one q8 block per CUDA block");
  OpBuilder &b = g.b;
  Location loc = g.loc;
  Type f32 = b.getF32Type(), i8 = b.getI8Type();
  struct Q8 {
    int64_t slot, absSlot;
    bool isUnsigned, stored;
  };
  SmallVector<Q8> qs;
  auto entry = [&](int64_t slot, int64_t a, bool uns) -> Q8 & {
    for (Q8 &q : qs)
      if (q.slot == slot)
        return q;
    qs.push_back({slot, a, uns, false});
    return qs.back();
  };
  body.walk([&](zk::LoadOp l) {
    if (auto a = l.getAbsmax())
      entry(l.getSlot(), *a, l.getQ8Unsigned());
  });
  body.walk([&](zk::StoreOp s) {
    if (auto a = s.getAbsmax())
      entry(s.getSlot(), *a, s.getQ8Unsigned()).stored = true;
  });
  Operation *gm = b.getInsertionBlock()->getParentOp();
  while (!isa<gpu::GPUModuleOp>(gm))
    gm = gm->getParentOp();
  Value tables[4];
  for (int t = 0; t < 4; ++t)
    tables[t] = q8TableAddress(b, loc, gm, Q8Table(t), /*addrSpace=*/1);
  Value B = g.i64(ZOPT_Q8_BLOCK);
  auto blocks = scf::ForOp::create(b, loc, ch.begin, ch.end, B);
  OpBuilder::InsertionGuard guard(b);
  b.setInsertionPoint(blocks.getBody()->getTerminator());
  Value b0 = blocks.getInductionVar();
  Value blk = arith::DivSIOp::create(b, loc, b0, B);
  Value i = g.add(b0, g.tid());
  Value in = arith::CmpIOp::create(b, loc, arith::CmpIPredicate::slt, i, ch.end);
  BodyEmitter e{b, loc, 1, ch.ptrs, ch.cs, {}};
  for (int t = 0; t < 4; ++t)
    e.q8Tables[t] = tables[t];
  e.q8Base = b0;
  for (Q8 &q : qs)
    e.q8Absmax[q.slot] = g.load(f32, g.gep(f32, ch.ptrs[q.absSlot], blk));
  // The body for this thread's element (when it has one); its new moments.
  SmallVector<Type> types;
  for (Q8 &q : qs)
    if (q.stored)
      types.push_back(f32);
  auto run = scf::IfOp::create(b, loc, types, in, /*withElse=*/true);
  {
    OpBuilder::InsertionGuard ig(b);
    b.setInsertionPointToStart(&run.getThenRegion().front());
    setSr(b, loc, e, i);
    e.emit(body, i);
    SmallVector<Value> xs;
    for (Q8 &q : qs)
      if (q.stored)
        for (auto &[slot, v] : e.q8Stored)
          if (slot == q.slot)
            xs.push_back(v);
    scf::YieldOp::create(b, loc, xs);
    b.setInsertionPointToStart(&run.getElseRegion().front());
    SmallVector<Value> zeros(types.size(),
                             arith::ConstantOp::create(b, loc, b.getF32FloatAttr(0)));
    scf::YieldOp::create(b, loc, zeros);
  }
  Value tx = gpu::ThreadIdOp::create(b, loc, gpu::Dimension::x);
  int64_t k = 0;
  for (Q8 &q : qs) {
    if (!q.stored)
      continue;
    Value x = run.getResult(k++);
    // The block's absmax: a tree of NaN-propagating maxima in shared memory.
    blockTreeReduce(b, loc, red, tx, math::AbsFOp::create(b, loc, x),
                    [](OpBuilder &ob, Location l, Value u, Value w) -> Value {
                      return arith::MaximumFOp::create(ob, l, u, w);
                    });
    Value a = memref::LoadOp::create(
        b, loc, red, ValueRange{arith::ConstantIndexOp::create(b, loc, 0)});
    gpu::BarrierOp::create(b, loc); // every thread read it before reuse
    auto store = scf::IfOp::create(b, loc, in, false);
    {
      OpBuilder::InsertionGuard ig(b);
      b.setInsertionPoint(store.thenBlock()->getTerminator());
      Value c = e.q8Encode(x, a, q.isUnsigned);
      LLVM::StoreOp::create(b, loc, c, g.gep(i8, ch.ptrs[q.slot], i));
      Value t0 = arith::CmpIOp::create(b, loc, arith::CmpIPredicate::eq, i, b0);
      auto first = scf::IfOp::create(b, loc, t0, false);
      b.setInsertionPoint(first.thenBlock()->getTerminator());
      LLVM::StoreOp::create(b, loc, a, g.gep(f32, ch.ptrs[q.absSlot], blk));
    }
  }
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
  // q8 moments (abi.h "q8 moments"): a block's absmax is reduced in shared
  // memory, one f32 per thread.
  bool q8 = false;
  k.getBody().walk([&](zk::StoreOp s) { q8 |= bool(s.getAbsmax()); });
  k.getBody().walk([&](zk::LoadOp l) { q8 |= bool(l.getAbsmax()); });
  auto wg = gpu::AddressSpaceAttr::get(ctx, gpu::AddressSpace::Workgroup);
  SmallVector<Type> workgroup;
  if (q8)
    workgroup.push_back(
        MemRefType::get({ZOPT_GPU_BLOCK}, gb.getF32Type(), AffineMap(), wg));
  auto fn = makeKernel(gb, loc, k.getSymName(), args, ZOPT_GPU_BLOCK,
                       workgroup);
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
  if (q8) {
    emitQ8Chunk(g, ch, body, fn.getWorkgroupAttributions()[0],
                [&](OpBuilder &ob, Location l, BodyEmitter &e, Value i) {
                  setSr(ob, l, e, i);
                });
    b.setInsertionPointToEnd(&entry);
    gpu::ReturnOp::create(b, loc);
    return;
  }
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
