//===- Control.cpp - the step's control semantics as one zk.control -------===//
//
// The one place the norm -> clip coefficient -> non-finite skip -> loss
// scaler -> step counts rule is written (docs/NUMERICS.md sections 3, 5,
// 6). zopt-fuse calls buildControl beside the prepare and the kernels; every
// backend lowers the result: convert-zk-to-cpu into the host function of
// kernel role CONTROL (CPU and offloaded steps call it once per step),
// convert-zk-to-gpu inlines it into the SUMSQ kernel's last block and
// FINISH. The float64 oracles of the tests check it against the contract.
//
//===----------------------------------------------------------------------===//
#include "Builders.h"
#include "zopt/Dialect/ZK/IR/ZKOps.h"
#include "zopt/abi.h"

#include "mlir/Dialect/Math/IR/Math.h"

#include <limits>

using namespace mlir;
using namespace mlir::zopt;

void mlir::zopt::buildControl(OpBuilder &b, Location loc, StringRef stepName,
                              int64_t flags) {
  MLIRContext *ctx = b.getContext();
  auto ctl = zk::ControlOp::create(b, loc, (stepName + "_control").str());
  Block *blk = new Block();
  ctl.getBody().push_back(blk);
  OpBuilder cb = OpBuilder::atBlockEnd(blk);
  ElemBuilder e{cb, loc};
  using F = zk::ControlField;
  auto in = [&](F f) -> Value {
    return zk::ControlInOp::create(cb, loc, zk::ControlOp::fieldType(ctx, f),
                                   f);
  };
  auto out = [&](F f, Value v) { zk::ControlOutOp::create(cb, loc, f, v); };
  auto i1 = [&](bool v) -> Value {
    return arith::ConstantOp::create(cb, loc, cb.getBoolAttr(v));
  };
  auto i64 = [&](int64_t v) -> Value {
    return arith::ConstantOp::create(cb, loc, cb.getI64IntegerAttr(v));
  };
  auto notI1 = [&](Value v) -> Value {
    return arith::XOrIOp::create(cb, loc, v, i1(true));
  };
  auto isFinite = [&](Value x) -> Value { // |x| < inf: false for NaN, +-inf
    return e.cmp(arith::CmpFPredicate::OLT, math::AbsFOp::create(cb, loc, x),
                 e.f64(std::numeric_limits<double>::infinity()));
  };
  const double one = 1.0;

  // §3: the norm of the value the description clips / checks, its clip
  // coefficient min(1, max_norm / (norm + 1e-6)) (PyTorch's
  // clip_grad_norm_), and the skip of a step whose sum is not finite. A
  // step that takes no norm never skips.
  Value norm, clip = e.f64(one), skip;
  if (flags & ZOPT_FLAG_SUMSQ) {
    Value s = in(F::sumsq);
    norm = e.sqrt(s);
    skip = notI1(isFinite(s));
    if (flags & ZOPT_FLAG_CLIP) {
      Value q = e.div(in(F::max_norm), e.add(norm, e.f64(1e-6)));
      Value c = e.select(e.cmp(arith::CmpFPredicate::OLT, q, e.f64(one)), q,
                         e.f64(one));
      clip = e.select(skip, e.f64(one), c);
    }
  } else {
    norm = e.f64(std::numeric_limits<double>::quiet_NaN());
    skip = i1(false);
  }
  out(F::norm, norm);
  out(F::clip_coef, clip);
  out(F::skip, skip);
  // §6: a taken step advances the step counts; a skipped one changes none.
  out(F::advance, notI1(skip));

  // §5: the dynamic loss scaler (torch's GradScaler). Skipped: S = max(S *
  // backoff, min_scale), good steps 0. Taken: good steps + 1; at
  // growth_interval S = S * growth if that is finite, good steps 0. A
  // static scaler keeps S.
  Value S = in(F::scale), good = in(F::good_steps);
  Value newS = S, newGood = good;
  if (flags & ZOPT_FLAG_LOSS_SCALE) {
    Value minS = in(F::min_scale);
    Value backed = e.mul(S, in(F::backoff_factor));
    Value backedC =
        e.select(e.cmp(arith::CmpFPredicate::OLT, backed, minS), minS, backed);
    Value good1 = arith::AddIOp::create(cb, loc, good, i64(1));
    Value grow = arith::CmpIOp::create(cb, loc, arith::CmpIPredicate::sge,
                                       good1, in(F::growth_interval));
    Value grown = e.mul(S, in(F::growth_factor));
    Value takenS = e.select(arith::AndIOp::create(cb, loc, grow, isFinite(grown)),
                            grown, S);
    Value takenGood = e.select(grow, i64(0), good1);
    Value dyn = in(F::dynamic);
    newS = e.select(dyn, e.select(skip, backedC, takenS), S);
    newGood = e.select(dyn, e.select(skip, i64(0), takenGood), good);
  }
  out(F::new_scale, newS);
  out(F::new_good_steps, newGood);
}
