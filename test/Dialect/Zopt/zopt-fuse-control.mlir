// RUN: zopt-opt %s --split-input-file --zopt-decompose --zopt-plan --zopt-fuse --canonicalize --cse | FileCheck %s

// zopt-fuse writes the step's control semantics once, as a zk.control
// (lib/Dialect/Zopt/Transforms/Control.cpp; docs/NUMERICS.md §3, §5, §6),
// from the step's flags; every backend lowers that one body.

// Loss scaling, no clipping: the norm and the non-finite skip, a clip
// coefficient of 1, and the dynamic scaler: skipped, max(S * backoff,
// min_scale); taken, good + 1 >= growth_interval grows S by growth_factor
// when the product is finite; a static scaler (dynamic false) keeps S.
// CHECK-LABEL: zk.control @adam_ls_control
// CHECK: zk.control_in sumsq : f64
// CHECK-NOT: zk.control_in max_norm
// CHECK-DAG: zk.control_out clip_coef, %{{.+}} : f64
// CHECK-DAG: zk.control_in backoff_factor : f64
// CHECK-DAG: zk.control_in min_scale : f64
// CHECK-DAG: zk.control_in growth_interval : i64
// CHECK-DAG: arith.cmpi sge
// CHECK-DAG: zk.control_in growth_factor : f64
// CHECK-DAG: zk.control_in dynamic : i1
// CHECK-DAG: zk.control_out new_scale
// CHECK-DAG: zk.control_out new_good_steps
// CHECK: zk.kernel @adam_ls_update
zopt.step @adam_ls {
  %p = zopt.state param : f16 on cpu
  %g = zopt.state grad : f16 on cpu
  %w = zopt.state master : f32 on cpu
  %m = zopt.state exp_avg : f32 on cpu
  %v = zopt.state exp_avg_sq : f32 on cpu
  %lr = zopt.hyper lr
  %b1 = zopt.hyper beta1
  %b2 = zopt.hyper beta2
  %eps = zopt.hyper eps
  %wd = zopt.hyper weight_decay
  %gs = zopt.unscale %g : f16
  %w1, %m1, %v1 = zopt.adam %w, %gs, %m, %v, %lr, %b1, %b2, %eps, %wd : f32, f32, f32, f32
  zopt.yield %w1, %m1, %v1, %w1 into %w, %m, %v, %p : f32, f32, f32, f32 into f32, f32, f32, f16
}

// -----

// No norm (neither clipping nor loss scaling): no sum is read; the norm is
// NaN, nothing skips, the counts always advance, the scaler passes through.
// CHECK-LABEL: zk.control @adam_plain_control
// CHECK-NOT: zk.control_in sumsq
// CHECK-DAG: %[[NAN:.+]] = arith.constant 0x7FF8000000000000 : f64
// CHECK-DAG: %[[F:.+]] = arith.constant false
// CHECK-DAG: %[[T:.+]] = arith.constant true
// CHECK-DAG: zk.control_out norm, %[[NAN]] : f64
// CHECK-DAG: zk.control_out skip, %[[F]] : i1
// CHECK-DAG: zk.control_out advance, %[[T]] : i1
// CHECK-DAG: %[[S:.+]] = zk.control_in scale : f64
// CHECK-DAG: zk.control_out new_scale, %[[S]] : f64
zopt.step @adam_plain {
  %p = zopt.state param : f32 on cpu
  %g = zopt.state grad : f32 on cpu
  %m = zopt.state exp_avg : f32 on cpu
  %v = zopt.state exp_avg_sq : f32 on cpu
  %lr = zopt.hyper lr
  %b1 = zopt.hyper beta1
  %b2 = zopt.hyper beta2
  %eps = zopt.hyper eps
  %wd = zopt.hyper weight_decay
  %p1, %m1, %v1 = zopt.adam %p, %g, %m, %v, %lr, %b1, %b2, %eps, %wd : f32, f32, f32, f32
  zopt.yield %p1, %m1, %v1 into %p, %m, %v : f32, f32, f32 into f32, f32, f32
}
