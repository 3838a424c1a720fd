//===- BodyEmitter.cpp - zk kernel bodies at a vector width ---------------===//
//
// lib/Conversion/ZKCommon/ owns the kernel-body emission both conversions
// share (ZKToCPU and ZKToGPU, as MLIR's GPUCommon): BodyEmitter.h says what
// it emits and why.
//
//===----------------------------------------------------------------------===//
#include "BodyEmitter.h"

#include "mlir/Dialect/Math/IR/Math.h"
#include "mlir/IR/IRMapping.h"
#include "mlir/IR/SymbolTable.h"

#include <cmath>
#include <limits>

using namespace mlir;
using namespace mlir::zopt;

Value mlir::zopt::emitFmix32(OpBuilder &b, Location loc, Value h) {
  Type t = h.getType();
  auto cst = [&](uint32_t v) -> Value {
    Attribute a = b.getI32IntegerAttr(int32_t(v));
    if (auto vt = dyn_cast<VectorType>(t))
      return arith::ConstantOp::create(b, loc, DenseElementsAttr::get(vt, a));
    return arith::ConstantOp::create(b, loc, t, cast<TypedAttr>(a));
  };
  auto xorShr = [&](Value v, uint32_t k) {
    return arith::XOrIOp::create(b, loc, v,
                                 arith::ShRUIOp::create(b, loc, v, cst(k)));
  };
  h = arith::MulIOp::create(b, loc, xorShr(h, 16), cst(0x85EBCA6Bu));
  h = arith::MulIOp::create(b, loc, xorShr(h, 13), cst(0xC2B2AE35u));
  return xorShr(h, 16);
}

Value BodyEmitter::splatConst(arith::ConstantOp c) {
  if (lanes == 1)
    return b.clone(*c)->getResult(0);
  auto attr = cast<TypedAttr>(c.getValue());
  return arith::ConstantOp::create(
      b, loc, DenseElementsAttr::get(cast<ShapedType>(vec(attr.getType())),
                                     attr));
}

Value BodyEmitter::intCst(Type elem, int64_t v) {
  Type t = vec(elem);
  if (lanes == 1)
    return arith::ConstantOp::create(b, loc, t, b.getIntegerAttr(elem, v));
  return arith::ConstantOp::create(
      b, loc, DenseElementsAttr::get(cast<ShapedType>(t),
                                     b.getIntegerAttr(elem, v)));
}

Value BodyEmitter::elemPtr(int64_t slot, Type memElem, Value i, bool store) {
  Value base = store && !storePtrs.empty() ? storePtrs[slot] : statePtrs[slot];
  Type ptrTy = base.getType(); // keeps the address space
  return LLVM::GEPOp::create(b, loc, ptrTy, memElem, base, ValueRange{i});
}

Value BodyEmitter::loadAt(Type t, Value p, int64_t align) {
  if (!loadMask || lanes == 1)
    return LLVM::LoadOp::create(b, loc, t, p, align);
  auto vt = cast<VectorType>(t);
  Value zero = arith::ConstantOp::create(
      b, loc, DenseElementsAttr::get(vt, b.getZeroAttr(vt.getElementType())));
  return LLVM::MaskedLoadOp::create(b, loc, t, p, loadMask, zero,
                                    uint32_t(align));
}

void BodyEmitter::storeAt(Value v, Value p, int64_t align) {
  if (!storeMask || lanes == 1) {
    LLVM::StoreOp::create(b, loc, v, p, align);
    return;
  }
  LLVM::MaskedStoreOp::create(b, loc, v, p, storeMask,
                              b.getI32IntegerAttr(int32_t(align)));
}

Value BodyEmitter::bf16SplitToF32(Value bits16) {
  int64_t h = lanes / 2;
  Type i32 = b.getI32Type();
  auto wt = VectorType::get({h}, i32);
  auto cst = [&](int64_t v) -> Value {
    return arith::ConstantOp::create(
        b, loc, DenseElementsAttr::get(wt, b.getIntegerAttr(i32, v)));
  };
  Value w = vector::BitCastOp::create(b, loc, wt, bits16);
  Value ev = arith::ShLIOp::create(b, loc, w, cst(16));
  Value od = arith::AndIOp::create(b, loc, w, cst(int64_t(int32_t(0xFFFF0000u))));
  SmallVector<int64_t> cat;
  for (int64_t j = 0; j < lanes; ++j)
    cat.push_back(j);
  Value both = vector::ShuffleOp::create(b, loc, ev, od, cat);
  return vector::BitCastOp::create(b, loc, vec(b.getF32Type()), both);
}

Value BodyEmitter::bf16BitsToF32(Value bits16) {
  if (packHalves && lanes > 1) {
    // Interleave with zero: each value lands in the high half of a lane.
    Value zero = intCst(b.getI16Type(), 0);
    SmallVector<int64_t> mask;
    for (int j = 0; j < lanes; ++j)
      mask.append({lanes, j});
    Value w = vector::ShuffleOp::create(b, loc, bits16, zero, mask);
    return vector::BitCastOp::create(b, loc, vec(b.getF32Type()), w);
  }
  Value w = arith::ExtUIOp::create(b, loc, vec(b.getI32Type()), bits16);
  w = arith::ShLIOp::create(b, loc, w, intCst(b.getI32Type(), 16));
  return arith::BitcastOp::create(b, loc, vec(b.getF32Type()), w);
}

Value BodyEmitter::high16(Value v32) {
  if (packHalves && lanes > 1) {
    Value h = vector::BitCastOp::create(
        b, loc, VectorType::get({2 * lanes}, b.getI16Type()), v32);
    SmallVector<int64_t> mask;
    for (int j = 0; j < lanes; ++j)
      mask.push_back(2 * j + 1);
    return vector::ShuffleOp::create(b, loc, h, h, mask);
  }
  Value hi = arith::ShRUIOp::create(b, loc, v32, intCst(b.getI32Type(), 16));
  return arith::TruncIOp::create(b, loc, vec(b.getI16Type()), hi);
}

Value BodyEmitter::f32ToBf16RoundedInt(Value x) {
  Type i32 = b.getI32Type();
  Value bits = arith::BitcastOp::create(b, loc, vec(i32), x);
  Value lsb = arith::AndIOp::create(
      b, loc, arith::ShRUIOp::create(b, loc, bits, intCst(i32, 16)),
      intCst(i32, 1));
  Value rounded = arith::AddIOp::create(
      b, loc, bits, arith::AddIOp::create(b, loc, lsb, intCst(i32, 0x7FFF)));
  Value nanBits = arith::OrIOp::create(b, loc, bits, intCst(i32, 0x400000));
  Value isNan =
      arith::CmpFOp::create(b, loc, arith::CmpFPredicate::UNO, x, x);
  return arith::SelectOp::create(b, loc, isNan, nanBits, rounded);
}

Value BodyEmitter::f32ToBf16RoundedFinite(Value x) {
  Type i32 = b.getI32Type();
  Value bits = arith::BitcastOp::create(b, loc, vec(i32), x);
  if (avx512 && lanes > 1) {
    // bits + 0x8000 rounds half up; a tie (the low half now 0) then clears
    // the bf16's lowest bit, which gives the even one of the two: hi + 1
    // where hi was odd, hi where it was even. Three operations, no shift:
    // VPADDD, VPTESTNMD, a masked VPANDD.
    Value t = arith::AddIOp::create(b, loc, bits, intCst(i32, 0x8000));
    Value tie = arith::CmpIOp::create(
        b, loc, arith::CmpIPredicate::eq,
        arith::AndIOp::create(b, loc, t, intCst(i32, 0xFFFF)), intCst(i32, 0));
    return arith::SelectOp::create(
        b, loc, tie,
        arith::AndIOp::create(b, loc, t,
                              intCst(i32, int64_t(int32_t(0xFFFEFFFFu)))),
        t);
  }
  Value lsb = arith::AndIOp::create(
      b, loc, arith::ShRUIOp::create(b, loc, bits, intCst(i32, 16)),
      intCst(i32, 1));
  return arith::AddIOp::create(
      b, loc, bits, arith::AddIOp::create(b, loc, lsb, intCst(i32, 0x7FFF)));
}

Value BodyEmitter::splitRoundedRne(Value x) {
  // One unordered compare of the two halves finds a NaN in either; the
  // branch is taken only where one is stored (the NaN's select then costs
  // what it did on every vector before).
  int64_t h = lanes / 2;
  Value half[2];
  for (int k = 0; k < 2; ++k)
    half[k] = vector::ExtractStridedSliceOp::create(
        b, loc, x, ArrayRef<int64_t>{k * h}, ArrayRef<int64_t>{h},
        ArrayRef<int64_t>{1});
  Value any = vector::ReductionOp::create(
      b, loc, vector::CombiningKind::OR,
      arith::CmpFOp::create(b, loc, arith::CmpFPredicate::UNO, half[0],
                            half[1]));
  Type i16v = vec(b.getI16Type());
  auto ifOp = scf::IfOp::create(b, loc, TypeRange{i16v}, any,
                                /*withElseRegion=*/true);
  OpBuilder::InsertionGuard g(b);
  b.setInsertionPointToStart(&ifOp.getThenRegion().front());
  scf::YieldOp::create(b, loc, splitToBf16Bits(f32ToBf16RoundedInt(x)));
  b.setInsertionPointToStart(&ifOp.getElseRegion().front());
  scf::YieldOp::create(b, loc, splitToBf16Bits(f32ToBf16RoundedFinite(x)));
  return ifOp.getResult(0);
}

Value BodyEmitter::f32ToBf16BitsInt(Value x) {
  return high16(f32ToBf16RoundedInt(x));
}

Value BodyEmitter::splitToBf16Bits(Value rounded32) {
  int64_t h = lanes / 2;
  Type i32 = b.getI32Type();
  auto cst = [&](int64_t v) -> Value {
    auto wt = VectorType::get({h}, i32);
    return arith::ConstantOp::create(
        b, loc, DenseElementsAttr::get(wt, b.getIntegerAttr(i32, v)));
  };
  SmallVector<int64_t> lo, hi;
  for (int64_t j = 0; j < h; ++j) {
    lo.push_back(j);
    hi.push_back(h + j);
  }
  Value ev = vector::ShuffleOp::create(b, loc, rounded32, rounded32, lo);
  Value od = vector::ShuffleOp::create(b, loc, rounded32, rounded32, hi);
  if (avx512 && h == 16) {
    // (ev >> 16) | (od & 0xFFFF0000) as one VPTERNLOGD (imm 0xF8: A | B & C)
    // after the shift: LLVM would fold the generic form into a VPERMT2W
    // (three uops, two on port 5) where this is two.
    auto wt = VectorType::get({h}, i32);
    Value w = LLVM::CallIntrinsicOp::create(
                  b, loc, wt,
                  StringAttr::get(b.getContext(),
                                  "llvm.x86.avx512.pternlog.d.512"),
                  ValueRange{arith::ShRUIOp::create(b, loc, ev, cst(16)), od,
                             cst(int64_t(int32_t(0xFFFF0000u))),
                             LLVM::ConstantOp::create(
                                 b, loc, i32, b.getI32IntegerAttr(0xF8))})
                  .getResult(0);
    return vector::BitCastOp::create(b, loc, vec(b.getI16Type()), w);
  }
  Value w = arith::OrIOp::create(
      b, loc, arith::ShRUIOp::create(b, loc, ev, cst(16)),
      arith::AndIOp::create(b, loc, od, cst(int64_t(int32_t(0xFFFF0000u)))));
  return vector::BitCastOp::create(b, loc, vec(b.getI16Type()), w);
}

Value BodyEmitter::f32ToBf16Bits(Value x) {
  if (!nativeBf16 || lanes != 32)
    return f32ToBf16BitsInt(x);
  // Two 16-lane halves: VFPCLASSPS finds subnormals (which VCVTNE2PS2BF16
  // would flush to zero; such a vector takes the integer form), then one
  // VCVTNE2PS2BF16 rounds both halves into one register.
  MLIRContext *ctx = b.getContext();
  Type i1x16 = VectorType::get({16}, b.getI1Type());
  Value half[2];
  for (int h = 0; h < 2; ++h)
    half[h] = vector::ExtractStridedSliceOp::create(
        b, loc, x, ArrayRef<int64_t>{16 * h}, ArrayRef<int64_t>{16},
        ArrayRef<int64_t>{1});
  Value subnormal = LLVM::ConstantOp::create(b, loc, b.getI32Type(),
                                             b.getI32IntegerAttr(0x20));
  Value k[2];
  for (int h = 0; h < 2; ++h)
    k[h] = LLVM::CallIntrinsicOp::create(
               b, loc, i1x16,
               StringAttr::get(ctx, "llvm.x86.avx512.fpclass.ps.512"),
               ValueRange{half[h], subnormal})
               .getResult(0);
  Value any = vector::ReductionOp::create(
      b, loc, vector::CombiningKind::OR,
      arith::OrIOp::create(b, loc, k[0], k[1]));
  Type i16v = vec(b.getI16Type());
  auto ifOp = scf::IfOp::create(b, loc, TypeRange{i16v}, any,
                                /*withElseRegion=*/true);
  {
    OpBuilder::InsertionGuard g(b);
    b.setInsertionPointToStart(&ifOp.getThenRegion().front());
    scf::YieldOp::create(b, loc, f32ToBf16BitsInt(x));
    b.setInsertionPointToStart(&ifOp.getElseRegion().front());
    // The intrinsic's second operand fills the low half.
    Value c = LLVM::CallIntrinsicOp::create(
                  b, loc, vec(b.getBF16Type()),
                  StringAttr::get(ctx, "llvm.x86.avx512bf16.cvtne2ps2bf16.512"),
                  ValueRange{half[1], half[0]})
                  .getResult(0);
    scf::YieldOp::create(b, loc,
                         Value(arith::BitcastOp::create(b, loc, i16v, c)));
  }
  return ifOp.getResult(0);
}

Value BodyEmitter::f32ToBf16BitsStochastic(Value x, int64_t slot) {
  return high16(f32ToBf16RoundedStochastic(x, slot));
}

Value BodyEmitter::f32ToBf16RoundedStochastic(Value x, int64_t slot) {
  Type i32 = b.getI32Type();
  Value kslot = arith::AddIOp::create(
      b, loc, srKey,
      arith::ConstantOp::create(
          b, loc, b.getI32IntegerAttr(int32_t(uint32_t(slot) * 0x27D4EB2Fu))));
  if (lanes > 1)
    kslot = vector::BroadcastOp::create(b, loc, vec(i32), kslot);
  Value h = arith::XOrIOp::create(
      b, loc,
      arith::MulIOp::create(b, loc, srIndex,
                            intCst(i32, int32_t(0x9E3779B1u))),
      kslot);
  h = emitFmix32(b, loc, h);
  Value r = arith::ShRUIOp::create(b, loc, h, intCst(i32, 16));
  Value bits = arith::BitcastOp::create(b, loc, vec(i32), x);
  Value sum = arith::AddIOp::create(b, loc, bits, r);
  Value nanBits = arith::OrIOp::create(b, loc, bits, intCst(i32, 0x400000));
  Value isNan =
      arith::CmpFOp::create(b, loc, arith::CmpFPredicate::UNO, x, x);
  return arith::SelectOp::create(b, loc, isNan, nanBits, sum);
}

Value BodyEmitter::remainderJoin(Value hi16, Value lo16) {
  Type i32 = b.getI32Type();
  Value hi = arith::ShLIOp::create(
      b, loc, arith::ExtUIOp::create(b, loc, vec(i32), hi16), intCst(i32, 16));
  Value lo = arith::ExtSIOp::create(b, loc, vec(i32), lo16);
  return arith::BitcastOp::create(b, loc, vec(b.getF32Type()),
                                  arith::AddIOp::create(b, loc, hi, lo));
}

std::pair<Value, Value> BodyEmitter::remainderSplit(Value x) {
  Type i32 = b.getI32Type(), i16 = b.getI16Type();
  Value bits = arith::BitcastOp::create(b, loc, vec(i32), x);
  Value lo = arith::TruncIOp::create(b, loc, vec(i16), bits);
  Value carry = arith::AndIOp::create(
      b, loc, arith::ShRUIOp::create(b, loc, bits, intCst(i32, 15)),
      intCst(i32, 1));
  Value up = arith::AddIOp::create(
      b, loc, arith::ShRUIOp::create(b, loc, bits, intCst(i32, 16)), carry);
  Value nan = arith::ShRUIOp::create(
      b, loc, arith::OrIOp::create(b, loc, bits, intCst(i32, 0x400000)),
      intCst(i32, 16));
  Value isNan = arith::CmpFOp::create(b, loc, arith::CmpFPredicate::UNO, x, x);
  Value hi = arith::TruncIOp::create(
      b, loc, vec(i16), arith::SelectOp::create(b, loc, isNan, nan, up));
  return {hi, lo};
}

Value mlir::zopt::concatVectors(OpBuilder &b, Location loc,
                                SmallVector<Value> parts) {
  while (parts.size() > 1) {
    SmallVector<Value> next;
    for (size_t p = 0; p < parts.size(); p += 2) {
      int64_t n = cast<VectorType>(parts[p].getType()).getNumElements();
      SmallVector<int64_t> cat;
      for (int64_t j = 0; j < 2 * n; ++j)
        cat.push_back(j);
      next.push_back(
          vector::ShuffleOp::create(b, loc, parts[p], parts[p + 1], cat));
    }
    parts = next;
  }
  return parts[0];
}

Value mlir::zopt::q8TableAddress(OpBuilder &b, Location loc,
                                 Operation *symbolTable, Q8Table t,
                                 unsigned addrSpace) {
  static const char *names[] = {"zopt_q8_signed_map", "zopt_q8_unsigned_map",
                                "zopt_q8_signed_thresholds",
                                "zopt_q8_unsigned_thresholds",
                                "zopt_q8_signed_thresholds_padded",
                                "zopt_q8_unsigned_thresholds_padded"};
  const float *data[] = {zopt_q8_signed_map, zopt_q8_unsigned_map,
                         zopt_q8_signed_thresholds,
                         zopt_q8_unsigned_thresholds,
                         zopt_q8_signed_thresholds,
                         zopt_q8_unsigned_thresholds};
  const bool padded = t == Q8Table::SignedThresholdsPadded ||
                      t == Q8Table::UnsignedThresholdsPadded;
  const int64_t len = t == Q8Table::SignedMap || t == Q8Table::UnsignedMap
                          ? 256 : padded ? 257 : 255;
  const char *name = names[int(t)];
  MLIRContext *ctx = b.getContext();
  Type f32 = b.getF32Type();
  auto arrTy = LLVM::LLVMArrayType::get(f32, len);
  if (!SymbolTable::lookupSymbolIn(symbolTable, name)) {
    OpBuilder::InsertionGuard g(b);
    b.setInsertionPointToStart(&symbolTable->getRegion(0).front());
    auto tensorTy = RankedTensorType::get({len}, f32);
    SmallVector<float> v;
    if (padded)
      v.push_back(-std::numeric_limits<float>::infinity());
    v.append(data[int(t)], data[int(t)] + (padded ? 255 : len));
    if (padded)
      v.push_back(std::numeric_limits<float>::infinity());
    auto vals = DenseElementsAttr::get(tensorTy, ArrayRef<float>(v));
    LLVM::GlobalOp::create(b, loc, arrTy, /*isConstant=*/true,
                           LLVM::Linkage::Internal, name, vals,
                           /*alignment=*/64, addrSpace);
  }
  Value a = LLVM::AddressOfOp::create(
      b, loc, LLVM::LLVMPointerType::get(ctx, addrSpace), name);
  return a;
}

Value BodyEmitter::tableLookup(Value table, Value idx) {
  Type f32 = b.getF32Type();
  if (lanes == 1) {
    Value p = LLVM::GEPOp::create(b, loc, table.getType(), f32, table,
                                  ValueRange{idx});
    return LLVM::LoadOp::create(b, loc, f32, p, 4);
  }
  if (x86Gather && lanes % (x86Gather / 32) == 0) {
    // VGATHERDPS with 32-bit indices, a register at a time (LLVM's generic
    // gather widens some of these indices to 64 bits: twice the gathers).
    const int w = x86Gather / 32;
    MLIRContext *ctx = b.getContext();
    auto fw = VectorType::get({w}, f32);
    Value zero = arith::ConstantOp::create(
        b, loc, DenseElementsAttr::get(fw, b.getF32FloatAttr(0)));
    SmallVector<Value> parts;
    for (int h = 0; h < lanes; h += w) {
      Value ix = vector::ExtractStridedSliceOp::create(
          b, loc, idx, ArrayRef<int64_t>{h}, ArrayRef<int64_t>{w},
          ArrayRef<int64_t>{1});
      Value g;
      if (x86Gather == 512) {
        Value all = arith::ConstantOp::create(
            b, loc, DenseElementsAttr::get(VectorType::get({w}, b.getI1Type()),
                                           true));
        Value scale = LLVM::ConstantOp::create(b, loc, b.getI32Type(),
                                               b.getI32IntegerAttr(4));
        g = LLVM::CallIntrinsicOp::create(
                b, loc, fw,
                StringAttr::get(ctx, "llvm.x86.avx512.mask.gather.dps.512"),
                ValueRange{zero, table, ix, all, scale})
                .getResult(0);
      } else {
        Value all = arith::ConstantOp::create(
            b, loc, DenseElementsAttr::get(fw, b.getF32FloatAttr(-0.0f)));
        Value scale = LLVM::ConstantOp::create(b, loc, b.getI8Type(),
                                               b.getI8IntegerAttr(4));
        g = LLVM::CallIntrinsicOp::create(
                b, loc, fw, StringAttr::get(ctx, "llvm.x86.avx2.gather.d.ps.256"),
                ValueRange{zero, table, ix, all, scale})
                .getResult(0);
      }
      parts.push_back(g);
    }
    return concatVectors(b, loc, std::move(parts));
  }
  auto ptrVec = VectorType::get({lanes}, table.getType());
  Value ps = LLVM::GEPOp::create(b, loc, ptrVec, f32, table, ValueRange{idx});
  Value all = arith::ConstantOp::create(
      b, loc, DenseElementsAttr::get(VectorType::get({lanes}, b.getI1Type()),
                                     true));
  Value pass = arith::ConstantOp::create(
      b, loc, DenseElementsAttr::get(cast<ShapedType>(vec(f32)),
                                     b.getF32FloatAttr(0)));
  return LLVM::masked_gather::create(b, loc, vec(f32), ps, all, pass, 4);
}

Value BodyEmitter::q8Decode(Value codes, Value absmax, bool isUnsigned) {
  Value idx = arith::ExtUIOp::create(b, loc, vec(b.getI32Type()), codes);
  Value m = tableLookup(
      q8Tables[int(isUnsigned ? Q8Table::UnsignedMap : Q8Table::SignedMap)],
      idx);
  if (lanes > 1)
    absmax = vector::BroadcastOp::create(b, loc, vec(b.getF32Type()), absmax);
  return arith::MulFOp::create(b, loc, m, absmax); // one rounding, no FMA
}

std::pair<Value, Value> BodyEmitter::kahanStore(int64_t pSlot, int64_t cSlot,
                                                Value i, Value v) {
  // abi.h zopt_kahan_store: f32 operations, each rounded, none fused (no
  // fastmath flags: the contraction the rule's ops allow is not allowed
  // here; there is no product to fuse anyway).
  Type i16 = b.getI16Type(), i32 = b.getI32Type();
  // In split order (splitBf16: an UPDATE whose every access is bf16) v's
  // lanes are split too: the param and compensation are widened and
  // narrowed the same way.
  const bool split = splitBf16 && lanes > 1;
  auto load = [&](int64_t slot) {
    Value bits = loadAt(vec(i16), elemPtr(slot, i16, i), alignFor(2));
    return split ? bf16SplitToF32(bits) : bf16BitsToF32(bits);
  };
  Value p = load(pSlot), c = load(cSlot);
  Value u = arith::SubFOp::create(b, loc, v, p);
  Value y = arith::AddFOp::create(b, loc, u, c);
  Value s = arith::AddFOp::create(b, loc, p, y);
  if (!split) {
    Value np = f32ToBf16Bits(s);
    Value moved = arith::SubFOp::create(b, loc, bf16BitsToF32(np), p);
    return {np, f32ToBf16Bits(arith::SubFOp::create(b, loc, y, moved))};
  }
  // The rounded words (the bf16 in each high half) give the new param's
  // f32 value lane by lane, then go back to element order.
  Value np32 = f32ToBf16RoundedInt(s);
  Value npF = arith::BitcastOp::create(
      b, loc, vec(b.getF32Type()),
      arith::AndIOp::create(b, loc, np32, intCst(i32, int32_t(0xFFFF0000u))));
  Value moved = arith::SubFOp::create(b, loc, npF, p);
  Value nc32 = f32ToBf16RoundedInt(arith::SubFOp::create(b, loc, y, moved));
  return {splitToBf16Bits(np32), splitToBf16Bits(nc32)};
}

Value BodyEmitter::emit(Block &body, Value i) {
  IRMapping map;
  Value acc;
  auto get = [&](Value v) { return map.lookup(v); };
  for (Operation &op : body) {
    if (auto l = dyn_cast<zk::LoadOp>(op)) {
      Type t = l.getType();
      Value r;
      if (l.getAbsmax()) {
        Type i8 = b.getI8Type();
        Value codes = loadAt(vec(i8), elemPtr(l.getSlot(), i8, i), 1);
        r = q8Decode(codes, q8Absmax.at(l.getSlot()), l.getQ8Unsigned());
      } else if (std::optional<uint64_t> hiSlot = l.getRemainderOf()) {
        Type i16 = b.getI16Type();
        Value hi = loadAt(vec(i16), elemPtr(*hiSlot, i16, i), alignFor(2));
        Value lo = loadAt(vec(i16), elemPtr(l.getSlot(), i16, i), alignFor(2));
        r = remainderJoin(hi, lo);
      } else if (t.isBF16()) {
        Value p = elemPtr(l.getSlot(), b.getI16Type(), i);
        Value bits = loadAt(vec(b.getI16Type()), p, alignFor(2));
        r = splitBf16 && lanes > 1 ? bf16SplitToF32(bits)
                                   : bf16BitsToF32(bits);
      } else {
        Value p = elemPtr(l.getSlot(), t, i);
        r = loadAt(vec(t), p, alignFor(t.isF32() ? 4 : 2));
      }
      map.map(l.getResult(), r);
    } else if (auto c = dyn_cast<zk::CoeffOp>(op)) {
      map.map(c.getResult(), lanes == 1 ? coeffScalars[c.getIndex()]
                                        : coeffVecs[c.getIndex()]);
    } else if (auto c = dyn_cast<arith::ConstantOp>(op)) {
      map.map(c.getResult(), splatConst(c));
    } else if (auto e = dyn_cast<arith::ExtFOp>(op);
               e && e.getIn().getType().isBF16()) {
      map.map(e.getResult(), get(e.getIn())); // already f32
    } else if (auto t = dyn_cast<arith::TruncFOp>(op);
               t && t.getType().isBF16()) {
      map.map(t.getResult(), bf16BitsToF32(f32ToBf16Bits(get(t.getIn()))));
    } else if (auto s = dyn_cast<zk::StoreOp>(op)) {
      Type st = s.getStorage();
      Value v = get(s.getValue());
      Type vt = s.getValue().getType();
      if (vt.isBF16())
        vt = b.getF32Type(); // carried as f32
      if (vt.isF16() && !st.isF16())
        v = arith::ExtFOp::create(b, loc, vec(b.getF32Type()), v);
      if (s.getAbsmax()) {
        // Into the block buffer (CPU; the GPU keeps it in a register); the
        // caller reduces the absmax and encodes.
        if (auto buf = q8Buf.find(s.getSlot()); buf != q8Buf.end()) {
          Value j = arith::SubIOp::create(b, loc, i, q8Base);
          Value p = LLVM::GEPOp::create(b, loc, buf->second.getType(),
                                        b.getF32Type(), buf->second,
                                        ValueRange{j});
          LLVM::StoreOp::create(b, loc, v, p, alignFor(4));
        }
        q8Stored.push_back({int64_t(s.getSlot()), v});
        continue;
      }
      if (std::optional<uint64_t> cSlot = s.getKahan()) {
        auto [p, c] = kahanStore(s.getSlot(), *cSlot, i, v);
        Type i16 = b.getI16Type();
        storeAt(p, elemPtr(s.getSlot(), i16, i, /*store=*/true), alignFor(2));
        storeAt(c, elemPtr(*cSlot, i16, i, /*store=*/true), alignFor(2));
        continue;
      }
      if (std::optional<uint64_t> hiSlot = s.getRemainderOf()) {
        auto [hi, lo] = remainderSplit(v);
        Type i16 = b.getI16Type();
        storeAt(hi, elemPtr(*hiSlot, i16, i, /*store=*/true), alignFor(2));
        storeAt(lo, elemPtr(s.getSlot(), i16, i, /*store=*/true), alignFor(2));
        continue;
      }
      Value toStore;
      int align = 4;
      Type memElem = st;
      if (st.isF32()) {
        toStore = v;
      } else if (st.isBF16() && splitBf16 && lanes > 1) {
        // Split order (an UPDATE whose every access is bf16): the rounded
        // words go back to element order by a shift, a mask and an or.
        toStore = s.getRounding() == ZOPT_ROUND_STOCHASTIC
                      ? splitToBf16Bits(
                            f32ToBf16RoundedStochastic(v, s.getSlot()))
                      : splitRoundedRne(v);
        memElem = b.getI16Type();
        align = 2;
      } else if (st.isBF16()) {
        toStore = s.getRounding() == ZOPT_ROUND_STOCHASTIC
                      ? f32ToBf16BitsStochastic(v, s.getSlot())
                      : f32ToBf16Bits(v);
        memElem = b.getI16Type();
        align = 2;
      } else { // f16
        toStore = vt.isF16() ? v
                             : arith::TruncFOp::create(
                                   b, loc, vec(b.getF16Type()), v)
                                   .getResult();
        align = 2;
      }
      storeAt(toStore, elemPtr(s.getSlot(), memElem, i, /*store=*/true),
              alignFor(align));
    } else if (auto a = dyn_cast<zk::AccumulateOp>(op)) {
      Value x = get(a.getValue());
      Type f64 = vec(b.getF64Type());
      if (!a.getValue().getType().isF64()) {
        // The square of a widened f32 is exact in f64 (48 significant
        // bits), so fusing it into the accumulation (FMA) changes no bit:
        // the caller's add carries the same flag (accumulateFastmath).
        x = arith::ExtFOp::create(b, loc, f64, x);
        acc = arith::MulFOp::create(b, loc, x, x, accumulateFastmath());
      } else {
        acc = arith::MulFOp::create(b, loc, x, x);
      }
    } else {
      // Elementwise arith/math: same op at vector type.
      OperationState st(loc, op.getName());
      for (Value v : op.getOperands())
        st.addOperands(get(v));
      for (Type t : op.getResultTypes())
        st.addTypes(vec(t.isBF16() ? b.getF32Type() : t));
      st.addAttributes(op.getAttrs());
      // Let LLVM fuse a*b+c into FMA: fp32 math with one rounding fewer,
      // never less accurate than the unfused form.
      if (isa<arith::MulFOp, arith::AddFOp, arith::SubFOp>(op))
        st.attributes.set("fastmath",
                          arith::FastMathFlagsAttr::get(
                              b.getContext(), arith::FastMathFlags::contract));
      Operation *n = b.create(st);
      for (auto [o, r] : llvm::zip(op.getResults(), n->getResults()))
        map.map(o, r);
    }
  }
  return acc;
}

void mlir::zopt::emitPrepareBody(
    OpBuilder &b, Location loc, zk::PrepareOp p,
    llvm::function_ref<Value(int64_t)> hyper,
    llvm::function_ref<Value(int64_t)> global,
    llvm::function_ref<void(int64_t, Value)> setCoeff) {
  IRMapping map;
  for (Operation &op : p.getBody().front()) {
    if (auto h = dyn_cast<zk::HyperOp>(op)) {
      map.map(h.getResult(), hyper(h.getIndex()));
    } else if (auto g = dyn_cast<zk::GlobalOp>(op)) {
      map.map(g.getResult(), global(g.getIndex()));
    } else if (auto s = dyn_cast<zk::SetCoeffOp>(op)) {
      Value v = map.lookup(s.getValue());
      if (!v.getType().isF32())
        v = arith::TruncFOp::create(b, loc, b.getF32Type(), v);
      setCoeff(s.getIndex(), v);
    } else {
      b.clone(op, map);
    }
  }
}

LogicalResult mlir::zopt::emitControlBody(
    OpBuilder &b, Location loc, zk::ControlOp c,
    ArrayRef<zk::ControlField> want,
    llvm::function_ref<Value(zk::ControlField)> in,
    llvm::function_ref<void(zk::ControlField, Value)> out) {
  (void)loc;
  Block &body = c.getBody().front();
  llvm::SmallPtrSet<Operation *, 32> needed;
  SmallVector<Operation *> work;
  for (auto o : body.getOps<zk::ControlOutOp>())
    if (llvm::is_contained(want, o.getField()))
      work.push_back(o);
  while (!work.empty()) {
    Operation *op = work.pop_back_val();
    if (!needed.insert(op).second)
      continue;
    for (Value v : op->getOperands())
      if (Operation *d = v.getDefiningOp())
        work.push_back(d);
  }
  IRMapping map;
  for (Operation &op : body) {
    if (!needed.contains(&op))
      continue;
    if (auto i = dyn_cast<zk::ControlInOp>(op)) {
      Value v = in(i.getField());
      if (!v)
        return i.emitOpError("reads '")
               << zk::stringifyControlField(i.getField())
               << "', which this lowering does not provide here";
      map.map(i.getResult(), v);
    } else if (auto o = dyn_cast<zk::ControlOutOp>(op)) {
      out(o.getField(), map.lookup(o.getValue()));
    } else {
      b.clone(op, map);
    }
  }
  return success();
}

Value mlir::zopt::loadPtrAt(OpBuilder &b, Location loc, Value base,
                            int64_t idx, Type elem, Type result) {
  auto ptrTy = LLVM::LLVMPointerType::get(b.getContext());
  Value p = LLVM::GEPOp::create(b, loc, ptrTy, elem, base,
                                ArrayRef<LLVM::GEPArg>{int32_t(idx)});
  return LLVM::LoadOp::create(b, loc, result, p);
}
