//===- KernelIR.h - what the GPU kernel builders share ----------*- C++ -*-===//
//
// The IR helpers of convert-zk-to-gpu's kernel builders (GPUKernels.h),
// defined in GPUKernels.cpp: kernel code over i64 indices and global
// pointers (G), the device structs' layouts (abi.h), a kernel's used
// states and lanes (KernelInfo), one work-list chunk with its scalar head,
// vector middle and scalar tail (Chunk, loadChunk, forChunkElements), the
// kernel function (makeKernel), a coefficient row (emitPrepareForRow) and
// the stochastic-rounding key. Each builder has a file of its own:
// PrepareKernel.cpp, UpdateKernel.cpp, InitKernel.cpp, SumsqKernel.cpp,
// FinishKernel.cpp.
//
//===----------------------------------------------------------------------===//
#ifndef ZOPT_LIB_CONVERSION_ZKTOGPU_KERNELIR_H
#define ZOPT_LIB_CONVERSION_ZKTOGPU_KERNELIR_H

#include "GPUKernels.h"

#include "zopt/abi.h"

#include "mlir/Dialect/Arith/IR/Arith.h"
#include "mlir/Dialect/GPU/IR/GPUDialect.h"
#include "mlir/Dialect/LLVMIR/LLVMDialect.h"
#include "mlir/Dialect/SCF/IR/SCF.h"

#include <cstddef>

namespace mlir::zopt::gpu_kernels {

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
inline constexpr int64_t kSgClip = offsetof(zopt_gpu_step_globals, clip_coef) / 8;
inline constexpr int64_t kSgSumsq = offsetof(zopt_gpu_step_globals, sumsq) / 8;
inline constexpr int64_t kSgNorm = offsetof(zopt_gpu_step_globals, norm) / 8;
inline constexpr int64_t kSgNonfinite = offsetof(zopt_gpu_step_globals, nonfinite) / 4;
inline constexpr int64_t kSgSkip = offsetof(zopt_gpu_step_globals, skip) / 4;
inline constexpr int64_t kSgDone = offsetof(zopt_gpu_step_globals, blocks_done) / 4;
inline constexpr int64_t kSgApplied = offsetof(zopt_gpu_step_globals, steps_applied) / 4;
inline constexpr int64_t kSgMaxNorm = offsetof(zopt_gpu_step_globals, max_norm) / 8;
/// Layout of zopt_gpu_scaler, in units of the field's type.
inline constexpr int64_t kScScale = offsetof(zopt_gpu_scaler, scale) / 8;
inline constexpr int64_t kScGrowth = offsetof(zopt_gpu_scaler, growth_factor) / 8;
inline constexpr int64_t kScBackoff = offsetof(zopt_gpu_scaler, backoff_factor) / 8;
inline constexpr int64_t kScMin = offsetof(zopt_gpu_scaler, min_scale) / 8;
inline constexpr int64_t kScInterval = offsetof(zopt_gpu_scaler, growth_interval) / 8;
inline constexpr int64_t kScGood = offsetof(zopt_gpu_scaler, good_steps) / 8;
inline constexpr int64_t kScLast = offsetof(zopt_gpu_scaler, last_scale) / 8;
inline constexpr int64_t kScDynamic = offsetof(zopt_gpu_scaler, dynamic) / 4;
inline constexpr int64_t kScDivisor = offsetof(zopt_gpu_scaler, grad_divisor) / 8;
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

KernelInfo analyze(zk::KernelOp k);

/// A block's tree reduction in shared memory (blockDim.x ==
/// ZOPT_GPU_BLOCK): each thread stores `value` at red[tx], then halving
/// strides combine red[tx] and red[tx + stride] into red[tx] (`combine`:
/// the sum of SUMSQ, q8's NaN-propagating max), a barrier after each;
/// red[0] holds the block's result (not read here).
void blockTreeReduce(OpBuilder &b, Location loc, Value red, Value tx, Value value,
                     function_ref<Value(OpBuilder &, Location, Value, Value)> combine);

/// Loads chunk `c` of the work list: its segment, range, state pointers
/// and coefficient row, and its head / vector / tail split.
Chunk loadChunk(G &g, const Step &st, const KernelInfo &info, Value states,
                Value segs, Value chunks, Value coeffs, Value c);

/// Emits `scalar(i)` for every scalar element of chunk `ch` (head and tail,
/// numbered j = 0, 1, ...: element begin + j in the head, else
/// vecEnd + j - h) taken by this thread (j = tid, tid + blockDim, ...), and
/// `vector(i)` for every vector of it (i = vecBegin + lanes * (tid + k *
/// blockDim)). `iter` is carried through both loops.
ValueRange forChunkElements(
    G &g, const Chunk &ch, int lanes, ValueRange iter,
    function_ref<SmallVector<Value>(OpBuilder &, Location, Value, ValueRange)> vector,
    function_ref<SmallVector<Value>(OpBuilder &, Location, Value, ValueRange)> scalar);

/// A kernel `name` with `args` and block size `blockSize` (.reqntid), and
/// `workgroup` attributions.
gpu::GPUFuncOp makeKernel(OpBuilder &gb, Location loc, StringRef name,
                          ArrayRef<Type> args, int32_t blockSize,
                          ArrayRef<Type> workgroup = {});

/// The prepare body for row `row` (i64: segment `row`, one per tensor):
/// its group's hyperparameters and globals, but the tensor's own step t
/// (tensorT[row]) for the STEP global; writes row `row` of `coeffs`.
/// `clip` (f64) replaces the CLIP_COEF global when set.
void emitPrepareForRow(G &g, const Step &st, Value hypers, Value globals,
                       Value segs, Value tensorT, Value coeffs, Value row,
                       Value clip);

/// zopt_sr_key (abi.h) without its last step: fmix32(k ^ index_hi) of the
/// result is the key. seed, t: i64; tensor: i32.
Value srKeyPartial(G &g, Value seed, Value t, Value tensor);

/// The outer loop of the chunked kernels: chunk c = blockIdx.x,
/// blockIdx.x + gridDim.x, ... (abi.h: block b takes these chunks).
scf::ForOp forChunks(G &g, Value numChunks, ValueRange iter = {});

} // namespace mlir::zopt::gpu_kernels

#endif
