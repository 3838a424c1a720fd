//===- Q8Encode.cpp - the q8 encode of kernel bodies ----------------------===//
//
// BodyEmitter::q8Encode (BodyEmitter.h): the code of each element of a q8
// block (docs/NUMERICS.md §10, abi.h zopt_q8_encode, the definition), and
// the in-register lookups of small tables it uses on x86 vectors.
//
//===----------------------------------------------------------------------===//
#include "BodyEmitter.h"

#include "mlir/Dialect/Math/IR/Math.h"

#include <cmath>
#include <cstring>
#include <limits>

using namespace mlir;
using namespace mlir::zopt;

/// Lane j of the result: vals[idx[j] mod 32] on x86 vectors (x86Gather !=
/// 0), from constant registers, no memory access: at most 8 entries, one
/// VPERMD per register (AVX-512: 16 lanes, AVX2: 8), or on AVX-512 at most
/// 32, one VPERMI2D (two table registers). `vals` are i32 (or f32 bits);
/// entries past vals.size() read 0.
static Value registerLookup(BodyEmitter &e, ArrayRef<uint32_t> vals,
                            Value idx) {
  OpBuilder &b = e.b;
  Location loc = e.loc;
  MLIRContext *ctx = b.getContext();
  const int w = e.x86Gather / 32;
  const bool two = vals.size() > 8;
  assert(vals.size() <= (w == 16 ? 32u : 8u) && e.lanes % w == 0 &&
         "a register's table");
  Type i32 = b.getI32Type();
  auto wTy = VectorType::get({w}, i32);
  SmallVector<int32_t> padded(two ? 32 : w, 0);
  for (auto [k, v] : llvm::enumerate(vals))
    padded[k] = int32_t(v);
  auto reg = [&](int from) -> Value {
    return arith::ConstantOp::create(
        b, loc,
        DenseElementsAttr::get(wTy, ArrayRef<int32_t>(padded).slice(from, w)));
  };
  Value table = reg(0), tableHi = two ? reg(16) : Value();
  const char *name = two       ? "llvm.x86.avx512.vpermi2var.d.512"
                     : w == 16 ? "llvm.x86.avx512.permvar.si.512"
                               : "llvm.x86.avx2.permd";
  SmallVector<Value> parts;
  for (int h = 0; h < e.lanes; h += w) {
    Value ix = vector::ExtractStridedSliceOp::create(
        b, loc, idx, ArrayRef<int64_t>{h}, ArrayRef<int64_t>{w},
        ArrayRef<int64_t>{1});
    // The one-register intrinsics take (table, index); VPERMI2D (low
    // table, index, high table).
    SmallVector<Value> ops = two ? SmallVector<Value>{table, ix, tableHi}
                                 : SmallVector<Value>{table, ix};
    parts.push_back(LLVM::CallIntrinsicOp::create(
                        b, loc, wTy, StringAttr::get(ctx, name), ops)
                        .getResult(0));
  }
  return concatVectors(b, loc, std::move(parts));
}

static uint32_t bitsOf(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

Value BodyEmitter::q8Encode(Value x, Value absmax, bool isUnsigned) {
  Type f32 = b.getF32Type(), i32 = b.getI32Type();
  auto fcst = [&](float v) -> Value {
    if (lanes == 1)
      return arith::ConstantOp::create(b, loc, b.getF32FloatAttr(v));
    return arith::ConstantOp::create(
        b, loc, DenseElementsAttr::get(cast<ShapedType>(vec(f32)),
                                       b.getF32FloatAttr(v)));
  };
  Value a = lanes > 1 ? Value(vector::BroadcastOp::create(b, loc, vec(f32),
                                                          absmax))
                      : absmax;
  // absmax 0 (a block of zeros) or not finite: the zero code (below); r is
  // then taken as 0 so that every table index stays in range.
  Value valid = arith::AndIOp::create(
      b, loc,
      arith::CmpFOp::create(b, loc, arith::CmpFPredicate::OGT, a, fcst(0.0f)),
      arith::CmpFOp::create(b, loc, arith::CmpFPredicate::OLE, a,
                            fcst(std::numeric_limits<float>::max())));
  Value r = arith::SelectOp::create(b, loc, valid,
                                    arith::DivFOp::create(b, loc, x, a),
                                    fcst(0.0f));
  // The code is the number of the 255 ascending thresholds below r (abi.h
  // zopt_q8_encode). Instead of searching them (8 dependent lookups), the
  // map's structure gives a first guess c0 within one code of it: the
  // values of decade i (i = 0..6, [10^(i-7), 10^(i-6)]) are the centres of
  // P_i equal intervals, so y = |r| lies nearest the k-th, k =
  // floor(y * 10^(6-i) * P_i / 0.9 - P_i / 9), up to the rounding of that
  // f32 arithmetic and the gaps between decades (one code either way).
  // Two independent lookups, T[c0] and T[c0 - 1], then give the code
  // exactly: c0 + (r > T[c0]) - (r <= T[c0 - 1]). zopt-kernel-check
  // --q8-sweep checks it value by value.
  //
  // On x86 vectors, with the padded table U = (-inf, T[0..254], +inf), one
  // lookup does: y lies between two adjacent values of the map, the
  // code is one of theirs, and u = t - 1/2 (t the position of y in units of
  // the decade's interval, as k above) is within a rounding of the centres'
  // positions, so floor(u) is the lower of the two up to that rounding,
  // which moves it only where y is within a rounding of a centre, where
  // the code is that centre either way. At a decade's start S_i, below the
  // first centre (u in [-1/2, 0)), floor(u) = -1 names the last value of
  // the decade below, the same as just under S_i (u near P_i-1 - 1/2).
  // With q = floor(u) + 1 = trunc(t + 1/2) (t + 1/2 > 0) and s = base + q
  // the lower code is c_lo = s (unsigned), 127 + s (signed, r >= 0) or
  // 126 - s (r < 0: the magnitudes mirrored), and the code is
  // c_lo + (r > T[c_lo]) with T[-1] = U[0] = -inf: c_lo = -1 where r lies
  // below the most negative value, -0.99297 (the signed map has no -1),
  // and the code is 0. The whole sweep (every f32 r in [-1, 1], the only
  // input besides x != 0) checks this path.
  Value pad = lanes > 1 && x86Gather
                  ? q8Tables[int(isUnsigned ? Q8Table::UnsignedThresholdsPadded
                                            : Q8Table::SignedThresholdsPadded)]
                  : Value();
  Value y = isUnsigned ? Value(arith::MaxNumFOp::create(b, loc, r, fcst(0.0f)))
                       : Value(math::AbsFOp::create(b, loc, r));
  // Decade i's constants: the guess's scale and shift, its first position
  // among the positive values, and its count P_i.
  SmallVector<uint32_t> scaleOf, shiftOf, baseOf, topOf;
  int64_t firstPos = 0;
  for (int i = 0; i < 7; ++i) {
    const int64_t P = isUnsigned ? (2 << i) : (1 << i);
    const double s = std::pow(10.0, 6 - i);
    scaleOf.push_back(bitsOf(float(s * double(P) / 0.9)));
    shiftOf.push_back(bitsOf(float(double(P) / 9.0 - (pad ? 0.5 : 0.0))));
    baseOf.push_back(uint32_t(firstPos));
    topOf.push_back(uint32_t(P));
    firstPos += P;
  }
  Value scale, shift, base, top;
  if (lanes > 1 && x86Gather) {
    // The decade d is the number of decade starts S_i = f32(10^(i-7)),
    // i = 1..6, at or below y (the selects below pick the same); its four
    // constants come from registers (VPERMD), not from chains of selects
    // between constants.
    Value d;
    if (x86Gather == 512) {
      // From y's binade: y in [2^(E-127), 2^(E-126)) holds at most one
      // start (they are 10x apart), so d = below[E] + (y >= inside[E]),
      // below[E] the starts under the binade, inside[E] the start in it
      // (+inf: none). y <= 1, so E <= 127; E < 96 (y < 2^-31, no start
      // below) reads entry 96: index max(E, 96) mod 32.
      SmallVector<uint32_t> below(32), inside(32);
      for (int j = 0; j < 32; ++j) {
        const double lo = std::ldexp(1.0, j + 96 - 127),
                     hi = std::ldexp(1.0, j + 96 - 126);
        inside[j] = bitsOf(std::numeric_limits<float>::infinity());
        for (int i = 1; i < 7; ++i) {
          const double s = double(float(std::pow(10.0, i - 7)));
          if (s <= lo)
            below[j] += 1;
          else if (s < hi)
            inside[j] = bitsOf(float(s));
        }
      }
      Value e = arith::MaxSIOp::create(
          b, loc,
          arith::ShRUIOp::create(
              b, loc, arith::BitcastOp::create(b, loc, vec(i32), y),
              intCst(i32, 23)),
          intCst(i32, 96));
      Value in = arith::CmpFOp::create(
          b, loc, arith::CmpFPredicate::OGE, y,
          arith::BitcastOp::create(b, loc, vec(f32),
                                   registerLookup(*this, inside, e)));
      d = arith::AddIOp::create(b, loc, registerLookup(*this, below, e),
                                arith::ExtUIOp::create(b, loc, vec(i32), in));
    } else {
      d = intCst(i32, 0);
      for (int i = 1; i < 7; ++i) {
        Value in = arith::CmpFOp::create(b, loc, arith::CmpFPredicate::OGE,
                                         y, fcst(float(std::pow(10.0, i - 7))));
        d = arith::AddIOp::create(
            b, loc, d, arith::ExtUIOp::create(b, loc, vec(i32), in));
      }
    }
    auto look = [&](ArrayRef<uint32_t> t) { return registerLookup(*this, t, d); };
    scale = arith::BitcastOp::create(b, loc, vec(f32), look(scaleOf));
    shift = arith::BitcastOp::create(b, loc, vec(f32), look(shiftOf));
    base = look(baseOf);
  } else {
    auto fbits = [&](uint32_t u) {
      float f;
      std::memcpy(&f, &u, 4);
      return fcst(f);
    };
    for (int i = 0; i < 7; ++i) {
      Value A = fbits(scaleOf[i]), B = fbits(shiftOf[i]);
      Value base_i = intCst(i32, baseOf[i]), top_i = intCst(i32, topOf[i]);
      if (i == 0) {
        scale = A, shift = B, base = base_i, top = top_i;
        continue;
      }
      Value in = arith::CmpFOp::create(b, loc, arith::CmpFPredicate::OGE, y,
                                       fcst(float(std::pow(10.0, i - 7))));
      scale = arith::SelectOp::create(b, loc, in, A, scale);
      shift = arith::SelectOp::create(b, loc, in, B, shift);
      base = arith::SelectOp::create(b, loc, in, base_i, base);
      top = arith::SelectOp::create(b, loc, in, top_i, top);
    }
  }
  Value c;
  if (pad) {
    // q = trunc(t + 1/2), in [0, P_d] (the shift holds P_i/9 - 1/2).
    Value q = arith::FPToSIOp::create(
        b, loc, vec(i32),
        arith::SubFOp::create(b, loc, arith::MulFOp::create(b, loc, y, scale),
                              shift));
    Value sPos = arith::AddIOp::create(b, loc, base, q);
    Value lo = sPos;
    if (!isUnsigned) {
      Value neg = arith::CmpFOp::create(b, loc, arith::CmpFPredicate::OLT, r,
                                        fcst(0.0f));
      lo = arith::SelectOp::create(
          b, loc, neg, arith::SubIOp::create(b, loc, intCst(i32, 126), sPos),
          arith::AddIOp::create(b, loc, sPos, intCst(i32, 127)));
    }
    // T[lo] = U[lo + 1], lo in [-1, 254].
    Value t = tableLookup(LLVM::GEPOp::create(b, loc, pad.getType(), f32, pad,
                                              ArrayRef<LLVM::GEPArg>{1}),
                          lo);
    Value up = arith::CmpFOp::create(b, loc, arith::CmpFPredicate::OGT, r, t);
    c = arith::AddIOp::create(
        b, loc, lo,
        arith::SelectOp::create(b, loc, up, intCst(i32, 1), intCst(i32, 0)));
  } else {
    // k = max(floor(t), 0) is max(trunc(t), 0): they differ only for t in
    // (-1, 0), where both give 0 (t is finite: r is 0 unless absmax is).
    Value k = arith::FPToSIOp::create(
        b, loc, vec(i32),
        arith::SubFOp::create(b, loc, arith::MulFOp::create(b, loc, y, scale),
                              shift));
    k = arith::MaxSIOp::create(b, loc, k, intCst(i32, 0));
    k = arith::MinSIOp::create(b, loc, k, top);
    Value pos = arith::AddIOp::create(b, loc, base, k); // among the positives
    Value c0;
    if (isUnsigned) {
      c0 = arith::AddIOp::create(b, loc, pos, intCst(i32, 1));
    } else {
      Value up = arith::AddIOp::create(b, loc, pos, intCst(i32, 128));
      Value down = arith::SubIOp::create(
          b, loc, intCst(i32, 126),
          arith::MinSIOp::create(b, loc, pos, intCst(i32, 126)));
      Value neg = arith::CmpFOp::create(b, loc, arith::CmpFPredicate::OLT, r,
                                        fcst(0.0f));
      c0 = arith::SelectOp::create(b, loc, neg, down, up);
    }
    Value goUp, goDown;
    if (Value padded =
            q8Tables[int(isUnsigned ? Q8Table::UnsignedThresholdsPadded
                                    : Q8Table::SignedThresholdsPadded)]) {
      // The CPU's scalar tail: T[c0 - 1] = U[c0] and T[c0] = U[c0 + 1] for
      // every c0 in [0, 255] (r is finite): one index, no range checks.
      Value tDown = tableLookup(padded, c0);
      Value tUp = tableLookup(
          LLVM::GEPOp::create(b, loc, padded.getType(), f32, padded,
                              ArrayRef<LLVM::GEPArg>{1}),
          c0);
      goUp = arith::CmpFOp::create(b, loc, arith::CmpFPredicate::OGT, r, tUp);
      goDown =
          arith::CmpFOp::create(b, loc, arith::CmpFPredicate::OLE, r, tDown);
    } else {
      Value table = q8Tables[int(isUnsigned ? Q8Table::UnsignedThresholds
                                            : Q8Table::SignedThresholds)];
      Value tUp = tableLookup(
          table, arith::MinSIOp::create(b, loc, c0, intCst(i32, 254)));
      Value tDown = tableLookup(
          table, arith::SubIOp::create(
                     b, loc, arith::MaxSIOp::create(b, loc, c0, intCst(i32, 1)),
                     intCst(i32, 1)));
      goUp = arith::AndIOp::create(
          b, loc,
          arith::CmpFOp::create(b, loc, arith::CmpFPredicate::OGT, r, tUp),
          arith::CmpIOp::create(b, loc, arith::CmpIPredicate::slt, c0,
                                intCst(i32, 255)));
      goDown = arith::AndIOp::create(
          b, loc,
          arith::CmpFOp::create(b, loc, arith::CmpFPredicate::OLE, r, tDown),
          arith::CmpIOp::create(b, loc, arith::CmpIPredicate::sgt, c0,
                                intCst(i32, 0)));
    }
    c = arith::AddIOp::create(
        b, loc, c0,
        arith::SelectOp::create(b, loc, goUp, intCst(i32, 1), intCst(i32, 0)));
    c = arith::SubIOp::create(
        b, loc, c,
        arith::SelectOp::create(b, loc, goDown, intCst(i32, 1),
                                intCst(i32, 0)));
  }
  if (isUnsigned) { // the zero point: a nonzero x takes code 1 at least
    Value zero = arith::CmpIOp::create(b, loc, arith::CmpIPredicate::eq, c,
                                       intCst(i32, 0));
    Value nz = arith::CmpFOp::create(b, loc, arith::CmpFPredicate::UNE, x,
                                     fcst(0.0f));
    c = arith::SelectOp::create(b, loc,
                                arith::AndIOp::create(b, loc, zero, nz),
                                intCst(i32, 1), c);
  }
  // absmax 0 (a block of zeros) or not finite: the zero code.
  c = arith::SelectOp::create(
      b, loc, valid, c,
      intCst(i32, isUnsigned ? ZOPT_Q8_UNSIGNED_ZERO : ZOPT_Q8_SIGNED_ZERO));
  return arith::TruncIOp::create(b, loc, vec(b.getI8Type()), c);
}

