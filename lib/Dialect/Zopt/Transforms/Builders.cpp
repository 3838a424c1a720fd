//===- Builders.cpp -------------------------------------------------------===//
#include "Builders.h"

#include "mlir/Dialect/Math/IR/Math.h"

using namespace mlir;
using namespace mlir::zopt;

Value ElemBuilder::cst(double v, Type t) {
  return arith::ConstantOp::create(b, loc, t, b.getFloatAttr(t, v));
}
Value ElemBuilder::add(Value x, Value y) {
  return arith::AddFOp::create(b, loc, x, y);
}
Value ElemBuilder::sub(Value x, Value y) {
  return arith::SubFOp::create(b, loc, x, y);
}
Value ElemBuilder::mul(Value x, Value y) {
  return arith::MulFOp::create(b, loc, x, y);
}
Value ElemBuilder::div(Value x, Value y) {
  return arith::DivFOp::create(b, loc, x, y);
}
Value ElemBuilder::sqrt(Value x) { return math::SqrtOp::create(b, loc, x); }
Value ElemBuilder::pow(Value x, Value y) {
  return math::PowFOp::create(b, loc, x, y);
}
Value ElemBuilder::select(Value c, Value x, Value y) {
  return arith::SelectOp::create(b, loc, c, x, y);
}
Value ElemBuilder::cmp(arith::CmpFPredicate p, Value x, Value y) {
  return arith::CmpFOp::create(b, loc, p, x, y);
}
Value ElemBuilder::toF32(Value x) {
  if (x.getType().isF32())
    return x;
  return arith::ExtFOp::create(b, loc, b.getF32Type(), x);
}
Value ElemBuilder::coeff(Value x64) {
  if (x64.getType().isF32())
    return x64;
  return arith::TruncFOp::create(b, loc, b.getF32Type(), x64);
}
