// RUN: zopt-opt %s --split-input-file | FileCheck %s
// RUN: zopt-opt %s --split-input-file | zopt-opt --split-input-file | FileCheck %s
// RUN: zopt-opt %s --split-input-file --zopt-pipeline="compile-to=fuse" | FileCheck %s --check-prefix=FUSE
// q8 moments (docs/Dialects/Zopt.md rule 14b, docs/NUMERICS.md §10):
// parse, print and re-parse; zopt-fuse stores each as Q8 codes (dtype 5)
// plus an f32 absmax state per block (kinds 8, 9, flags PER_BLOCK = 2) and
// decodes/encodes them in the update kernel. The refusals are in
// q8-invalid.mlir.

// CHECK-LABEL: zopt.step @q8
// CHECK: %{{.*}} = zopt.state exp_avg : f32 on cpu q8
// CHECK: %{{.*}} = zopt.state exp_avg_sq : f32 on cpu q8
// FUSE: zk.descriptor
// FUSE-SAME: state_access = array<i32: 3, 1, 3, 3, 3, 3>
// FUSE-SAME: state_dtypes = array<i32: 1, 1, 5, 5, 1, 1>
// FUSE-SAME: state_flags = array<i32: 0, 0, 0, 0, 2, 2>
// FUSE-SAME: state_kinds = array<i32: 1, 2, 4, 5, 8, 9>
// FUSE: zk.kernel @q8_update
// FUSE-DAG: zk.load 2 {absmax = 4 : i64} : f32
// FUSE-DAG: zk.load 3 {absmax = 5 : i64, q8_unsigned} : f32
// FUSE-DAG: zk.store 2, %{{.*}} {absmax = 4 : i64} : f32 into i8
// FUSE-DAG: zk.store 3, %{{.*}} {absmax = 5 : i64, q8_unsigned} : f32 into i8
zopt.step @q8 attributes {zero_stage = 0 : i64, align = 256 : i64} {
  %p = zopt.state param : f32 on cpu
  %g = zopt.state grad : f32 on cpu
  %m = zopt.state exp_avg : f32 on cpu q8
  %v = zopt.state exp_avg_sq : f32 on cpu q8
  %lr = zopt.hyper lr
  %b1 = zopt.hyper beta1
  %b2 = zopt.hyper beta2
  %eps = zopt.hyper eps
  %m1 = zopt.ema %m, %g, %b1 : f32, f32
  %v1 = zopt.ema_sq %v, %g, %b2 : f32, f32
  %u = zopt.adam_direction %m1, %v1, %b1, %b2, %eps : f32, f32
  %p1 = zopt.apply %p, %u, %lr : f32, f32
  zopt.yield %p1, %m1, %v1 into %p, %m, %v : f32, f32, f32 into f32, f32, f32
}

// -----

// Only the second moment quantized: its absmax takes the next slot.
// CHECK-LABEL: zopt.step @q8_v
// CHECK: %{{.*}} = zopt.state exp_avg : f32 on cpu
// CHECK-NOT: q8
// CHECK: %{{.*}} = zopt.state exp_avg_sq : f32 on cpu q8
// FUSE: state_dtypes = array<i32: 1, 1, 1, 5, 1>
// FUSE-SAME: state_kinds = array<i32: 1, 2, 4, 5, 9>
zopt.step @q8_v attributes {zero_stage = 0 : i64, align = 256 : i64} {
  %p = zopt.state param : f32 on cpu
  %g = zopt.state grad : f32 on cpu
  %m = zopt.state exp_avg : f32 on cpu
  %v = zopt.state exp_avg_sq : f32 on cpu q8
  %lr = zopt.hyper lr
  %b1 = zopt.hyper beta1
  %b2 = zopt.hyper beta2
  %eps = zopt.hyper eps
  %m1 = zopt.ema %m, %g, %b1 : f32, f32
  %v1 = zopt.ema_sq %v, %g, %b2 : f32, f32
  %u = zopt.adam_direction %m1, %v1, %b1, %b2, %eps : f32, f32
  %p1 = zopt.apply %p, %u, %lr : f32, f32
  zopt.yield %p1, %m1, %v1 into %p, %m, %v : f32, f32, f32 into f32, f32, f32
}
