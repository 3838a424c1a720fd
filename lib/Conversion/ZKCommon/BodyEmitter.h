//===- BodyEmitter.h - zk kernel bodies at a vector width -------*- C++ -*-===//
//
// lib/Conversion/ZKCommon/ owns the kernel-body emission both lowerings of
// zk share (ZKToCPU, ZKToGPU; as MLIR's lib/Conversion/GPUCommon/).
//
// Shared by the CPU and GPU code generators: clones the per-element body of a
// zk.kernel at `lanes` lanes (1: scalar). bf16 is carried as the f32 it
// exactly widens to; narrowing to bf16 rounds to nearest even in integer
// arithmetic (bit-exact, NaN-preserving), so both devices round identically.
// In split order (splitBf16) a store checks its vector for a NaN once and
// branches to that form only then; otherwise it rounds without the NaN
// select (on AVX-512: add 0x8000, clear the lsb on a tie; VPTERNLOGD packs).
// Two CPU refinements, both bit-identical to that:
//  - packHalves: 16-bit vectors are widened and narrowed by shuffles (one
//    interleave with zero in, one pick of the high halves out: VPERMI2W on
//    AVX-512) instead of zero-extend + shift and shift + truncate;
//  - nativeBf16: bf16 stores use the hardware conversion (VCVTNEPS2BF16,
//    round to nearest even, NaN -> quiet NaN exactly as the integer form),
//    except that it flushes subnormal inputs to zero: a vector holding any
//    subnormal takes the integer form instead.
// A remainder master (zk.load/zk.store with remainder_of) is joined from
// and split into its two 16-bit halves here, for both devices, and a
// Kahan-compensated param's store (zk.store with kahan) is done here. A q8 moment
// (zk.load/zk.store with absmax, abi.h "q8 moments") is decoded and encoded
// here (q8Decode, q8Encode in Q8Encode.cpp, the tables as module
// constants); the block loop
// around the body (absmax in, the block's new absmax reduced, codes out)
// is the lowering's: the body stores a q8 moment's new f32 value into the
// caller's block buffer and reports it (q8Stored).
// Also the f64 zk.prepare body, with the sources of hyperparameters and
// globals and the sink of coefficients left to the caller.
//
//===----------------------------------------------------------------------===//
#ifndef ZOPT_LIB_CONVERSION_ZKCOMMON_BODYEMITTER_H
#define ZOPT_LIB_CONVERSION_ZKCOMMON_BODYEMITTER_H

#include "mlir/Dialect/Arith/IR/Arith.h"
#include "mlir/Dialect/LLVMIR/LLVMDialect.h"
#include "mlir/Dialect/SCF/IR/SCF.h"
#include "mlir/Dialect/Vector/IR/VectorOps.h"
#include "mlir/IR/Builders.h"
#include "zopt/Dialect/ZK/IR/ZKOps.h"
#include "zopt/abi.h"

#include <map>

namespace mlir::zopt {

/// zopt_fmix32 (abi.h) on an i32 scalar or vector: the one emitter of the
/// stochastic-rounding hash for the CPU and GPU code generators.
Value emitFmix32(OpBuilder &b, Location loc, Value h);

/// The q8 tables of zopt/q8_maps.h (abi.h "q8 moments"); the Padded
/// thresholds (257 entries: -inf, the 255 thresholds, +inf) let the CPU
/// encode look up T[c - 1] and T[c] for every code c without range checks.
enum class Q8Table {
  SignedMap,
  UnsignedMap,
  SignedThresholds,
  UnsignedThresholds,
  SignedThresholdsPadded,
  UnsignedThresholdsPadded
};
/// The address of q8 table `t`, an internal constant global of the module
/// (or gpu.module) `symbolTable`, created on first use, in address space
/// `addrSpace`.
Value q8TableAddress(OpBuilder &b, Location loc, Operation *symbolTable,
                     Q8Table t, unsigned addrSpace = 0);

/// The vector registers `parts` (a power of two of them, of one type)
/// concatenated in order into one vector.
Value concatVectors(OpBuilder &b, Location loc, SmallVector<Value> parts);

/// Builds code for one kernel body at one width.
struct BodyEmitter {
  OpBuilder &b;
  Location loc;
  int lanes; // 1: scalar
  ArrayRef<Value> statePtrs;  // indexed by slot (null when unused)
  ArrayRef<Value> coeffScalars;
  SmallVector<Value> coeffVecs;
  /// Alignment in bytes of vector loads/stores (0: the element's own, as
  /// for unaligned CPU pointers). Scalar accesses always use the element's.
  int vecAlign = 0;
  /// 16-bit <-> 32-bit lanes by shuffles (CPU vectors; see the header).
  bool packHalves = false;
  /// bf16 stores through the hardware conversion (needs +avx512bf16).
  bool nativeBf16 = false;
  /// AVX-512 (mask registers, VPTERNLOG): split-order bf16 stores round
  /// and pack with them (f32ToBf16RoundedFinite, splitToBf16Bits).
  bool avx512 = false;
  /// Table lookups (q8) through VGATHERDPS: 512 (AVX-512, 16 lanes a
  /// register) or 256 (AVX2, 8 lanes); 0: LLVM's generic gather.
  int x86Gather = 0;
  /// Kernels whose every load (SUMSQ) or every load and store (UPDATE) is
  /// bf16: a bf16 vector is widened by a shift and a mask of its 32-bit
  /// words instead of shuffles, so lane j holds element splitElement(j)
  /// (the even elements, then the odd ones); a bf16 store puts them back
  /// the same way (splitToBf16Bits). Only lane-wise work may follow: SUMSQ's
  /// caller undoes the order of its sum; an UPDATE's stochastic rounding
  /// needs srIndex in split order too.
  bool splitBf16 = false;
  /// Stochastic rounding (abi.h): the call's key (i32) and the element
  /// index (i32, at `lanes` lanes) of the element(s) being emitted.
  Value srKey, srIndex;
  /// Where stores go, by slot (CPU UPDATE kernels: the `out` pointer table;
  /// empty: statePtrs, i.e. in place).
  ArrayRef<Value> storePtrs;
  /// A vector<lanes x i1>: loads read only the set lanes (the others are
  /// zero), for a tail shorter than a vector.
  Value loadMask;
  /// The same for stores (an UPDATE's masked tail): only the set lanes are
  /// written. Masks are in element order (memory), split order or not.
  Value storeMask;
  /// q8 moments (zk.load/zk.store with absmax): by slot, the block's
  /// absmax (f32 scalar) its loads decode with, and the block buffer (f32,
  /// indexed by element - q8Base) its stores write (none: the value stays
  /// in a register, GPU); q8Tables[Q8Table] the tables' addresses (the
  /// Padded ones null where not emitted: the GPU). Each q8
  /// store of emit() appends (slot, value) to q8Stored.
  std::map<int64_t, Value> q8Absmax, q8Buf;
  Value q8Base;
  Value q8Tables[6];
  SmallVector<std::pair<int64_t, Value>> q8Stored;

  int64_t alignFor(int elemAlign) {
    return (lanes > 1 && vecAlign) ? vecAlign : elemAlign;
  }

  Type vec(Type t) {
    if (lanes == 1)
      return t;
    return VectorType::get({lanes}, t);
  }
  Value splatConst(arith::ConstantOp c);
  Value intCst(Type elem, int64_t v);
  Value elemPtr(int64_t slot, Type memElem, Value i, bool store = false);
  /// A load of `t` values at `p`: masked (zero-filled) under loadMask.
  Value loadAt(Type t, Value p, int64_t align);
  /// A store of `v` at `p`: masked under storeMask.
  void storeAt(Value v, Value p, int64_t align);
  /// For the sum of squares of values narrower than f64: contract (FMA).
  arith::FastMathFlagsAttr accumulateFastmath() {
    return arith::FastMathFlagsAttr::get(b.getContext(),
                                         arith::FastMathFlags::contract);
  }
  /// The element that lane j of a split bf16 vector holds (splitBf16).
  static int64_t splitElement(int64_t j, int64_t lanes) {
    return j < lanes / 2 ? 2 * j : 2 * (j - lanes / 2) + 1;
  }
  /// bf16 bits (element order) -> f32 in split order (splitBf16): each
  /// 32-bit word holds elements 2k (low half) and 2k+1 (high half); the
  /// even one is the word shifted left by 16, the odd one the word with its
  /// low half cleared. No shuffle of 16-bit lanes (VPERMT2W) is needed.
  Value bf16SplitToF32(Value bits16);
  /// bf16 bits -> f32 (exact).
  Value bf16BitsToF32(Value bits16);
  /// The high 16 bits of each i32 lane.
  Value high16(Value v32);
  /// f32 -> bf16 bits in integer arithmetic: round to nearest even; a NaN
  /// keeps its sign and payload and becomes quiet.
  Value f32ToBf16BitsInt(Value x);
  /// The same before the narrowing: i32 lanes whose high half is the bf16.
  Value f32ToBf16RoundedInt(Value x);
  /// f32ToBf16RoundedInt without its NaN select: right for every value
  /// but a NaN (whose payload the rounding's carry may change).
  Value f32ToBf16RoundedFinite(Value x);
  /// f32 in split order -> bf16 bits in element order, rounded to nearest
  /// even (splitBf16 stores): f32ToBf16RoundedFinite, and the NaN-exact
  /// f32ToBf16RoundedInt behind a branch taken only where the vector holds
  /// a NaN. The same bits either way.
  Value splitRoundedRne(Value x);
  /// i32 lanes in split order, the bf16 in each high half -> the bf16
  /// bits in element order (splitBf16).
  Value splitToBf16Bits(Value rounded32);
  /// f32 -> bf16 bits, round to nearest even; NaN stays a (quiet) NaN.
  Value f32ToBf16Bits(Value x);
  /// f32 -> bf16 bits, stochastically (abi.h "Stochastic rounding"):
  /// (bits + zopt_sr_bits(key, slot, index)) >> 16; NaN as nearest-even.
  Value f32ToBf16BitsStochastic(Value x, int64_t slot);
  /// The same before the narrowing (i32 lanes, the bf16 in the high half).
  Value f32ToBf16RoundedStochastic(Value x, int64_t slot);

  /// A remainder master (abi.h "Remainder masters"): the f32 rebuilt from
  /// the bf16 param's bits (high half) and the int16 remainder, exactly.
  Value remainderJoin(Value hi16, Value lo16);
  /// The new f32 master split into {param bits, remainder} (abi.h).
  std::pair<Value, Value> remainderSplit(Value x);

  /// Loads `idx` (i32 at `lanes` lanes) of the f32 table at `table`
  /// (a gather for vectors).
  Value tableLookup(Value table, Value idx);
  /// q8 decode (abi.h): map[code] * absmax; `codes` i8, `absmax` an f32
  /// scalar.
  Value q8Decode(Value codes, Value absmax, bool isUnsigned);
  /// q8 encode (abi.h zopt_q8_encode) of `x` (f32) in a block with absmax
  /// `absmax` (f32 scalar): the i8 codes.
  Value q8Encode(Value x, Value absmax, bool isUnsigned);

  /// A Kahan-compensated param's store (abi.h "Kahan-compensated params"):
  /// the param (slot pSlot) and compensation (slot cSlot) at index `i`
  /// loaded, and their new bf16 bits for the new f32 value `v` (in split
  /// order too, splitBf16: widened and narrowed as bf16 loads and stores
  /// are there).
  std::pair<Value, Value> kahanStore(int64_t pSlot, int64_t cSlot, Value i,
                                     Value v);

  /// Emits the body for the element(s) at index `i`; returns the value to
  /// accumulate (sumsq kernels) or null.
  Value emit(Block &body, Value i);
};

/// Emits the f64 body of `p` at `b`: `hyper(i)` / `global(i)` give the f64
/// values of zk.hyper / zk.global, `setCoeff(i, v)` receives each f32
/// coefficient.
void emitPrepareBody(OpBuilder &b, Location loc, zk::PrepareOp p,
                     llvm::function_ref<Value(int64_t)> hyper,
                     llvm::function_ref<Value(int64_t)> global,
                     llvm::function_ref<void(int64_t, Value)> setCoeff);

/// Emits at `b` what the outputs `want` of the zk.control `c` need (the
/// backward slice of their zk.control_out, in body order): `in(f)` gives
/// the value of input field f (asked only for the inputs that slice
/// reads; a null Value: not available here, and the emission fails),
/// `out(f, v)` receives each wanted output. The CPU lowering asks for every
/// output; the GPU kernels for the ones they apply.
LogicalResult emitControlBody(OpBuilder &b, Location loc, zk::ControlOp c,
                     ArrayRef<zk::ControlField> want,
                     llvm::function_ref<Value(zk::ControlField)> in,
                     llvm::function_ref<void(zk::ControlField, Value)> out);

/// Loads element `idx` of type `result` from `base` viewed as `elem`s.
Value loadPtrAt(OpBuilder &b, Location loc, Value base, int64_t idx,
                Type elem, Type result);

} // namespace mlir::zopt

#endif
