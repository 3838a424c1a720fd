// RUN: zopt-opt %s --split-input-file | FileCheck %s
// RUN: zopt-opt %s --split-input-file | zopt-opt --split-input-file | FileCheck %s
// RUN: zopt-opt %s --split-input-file --zopt-pipeline="compile-to=fuse" | FileCheck %s --check-prefix=FUSE
// A Kahan-compensated param (docs/Dialects/Zopt.md rule 14c, docs/NUMERICS.md
// §11): parses, prints and re-parses; zopt-fuse adds the compensation (kind
// 10, bf16, zero-initialized, read and written; partitioned under ZeRO) as
// the last slot and the param's store carries it. The refusals are in
// kahan-invalid.mlir.

// CHECK-LABEL: zopt.step @kahan
// CHECK: %{{.*}} = zopt.state param : bf16 on cpu kahan
// FUSE: zk.descriptor
// FUSE-SAME: state_access = array<i32: 3, 1, 3, 3, 3>
// FUSE-SAME: state_dtypes = array<i32: 2, 2, 1, 1, 2>
// FUSE-SAME: state_flags = array<i32: 0, 0, 0, 0, 0>
// FUSE-SAME: state_inits = array<i32: 1, 1, 2, 2, 2>
// FUSE-SAME: state_kinds = array<i32: 1, 2, 4, 5, 10>
// FUSE: zk.kernel @kahan_update
// FUSE: zk.store 0, %{{.*}} {kahan = 4 : i64} : f32 into bf16
zopt.step @kahan attributes {zero_stage = 0 : i64, align = 16 : i64} {
  %p = zopt.state param : bf16 on cpu kahan
  %g = zopt.state grad : bf16 on cpu
  %m = zopt.state exp_avg : f32 on cpu
  %v = zopt.state exp_avg_sq : f32 on cpu
  %lr = zopt.hyper lr
  %b1 = zopt.hyper beta1
  %b2 = zopt.hyper beta2
  %eps = zopt.hyper eps
  %wd = zopt.hyper weight_decay
  %p1, %m1, %v1 = zopt.adam %p, %g, %m, %v, %lr, %b1, %b2, %eps, %wd {decoupled} : bf16, bf16, f32, f32
  zopt.yield %p1, %m1, %v1 into %p, %m, %v : f32, f32, f32 into bf16, f32, f32
}

// -----

// On the GPU, under ZeRO-2 (the compensation is partitioned), with a
// stochastically rounded bf16 moment.
// CHECK-LABEL: zopt.step @kahan_gpu
// CHECK: zopt.state param : bf16 on gpu kahan
// FUSE: zk.descriptor
// FUSE-SAME: state_flags = array<i32: 0, 1, 1, 1>
// FUSE-SAME: state_kinds = array<i32: 1, 2, 4, 10>
// FUSE-SAME: state_placements = array<i32: 2, 2, 2, 2>
// FUSE: zk.store 0, %{{.*}} {kahan = 3 : i64} : f32 into bf16
zopt.step @kahan_gpu attributes {gpu_arch = "sm_80", zero_stage = 2 : i64} {
  %p = zopt.state param : bf16 on gpu kahan
  %g = zopt.state grad : bf16 on gpu
  %m = zopt.state exp_avg : bf16 on gpu rounding stochastic
  %lr = zopt.hyper lr
  %b1 = zopt.hyper beta1
  %m1 = zopt.ema %m, %g, %b1 : bf16, bf16
  %p1 = zopt.apply %p, %m1, %lr : bf16, f32
  zopt.yield %p1, %m1 into %p, %m : f32, f32 into bf16, bf16
}
