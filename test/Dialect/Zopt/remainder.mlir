// RUN: zopt-opt %s --split-input-file | FileCheck %s
// RUN: zopt-opt %s --split-input-file | zopt-opt --split-input-file | FileCheck %s
// A remainder master (docs/Dialects/Zopt.md rule 14a, docs/NUMERICS.md §9):
// parses, prints and re-parses; the refusals are in remainder-invalid.mlir.

// CHECK-LABEL: zopt.step @remainder
// CHECK: %{{.*}} = zopt.state master : f32 on cpu remainder
zopt.step @remainder attributes {zero_stage = 0 : i64, align = 16 : i64} {
  %p = zopt.state param : bf16 on cpu
  %g = zopt.state grad : bf16 on cpu
  %w = zopt.state master : f32 on cpu remainder
  %m = zopt.state exp_avg : f32 on cpu
  %v = zopt.state exp_avg_sq : f32 on cpu
  %lr = zopt.hyper lr
  %b1 = zopt.hyper beta1
  %b2 = zopt.hyper beta2
  %eps = zopt.hyper eps
  %wd = zopt.hyper weight_decay
  %m1 = zopt.ema %m, %g, %b1 : f32, bf16
  %v1 = zopt.ema_sq %v, %g, %b2 : f32, bf16
  %u = zopt.adam_direction %m1, %v1, %b1, %b2, %eps : f32, f32
  %w1 = zopt.decoupled_decay %w, %lr, %wd : f32
  %w2 = zopt.apply %w1, %u, %lr : f32, f32
  zopt.yield %w2, %m1, %v1, %w2 into %w, %m, %v, %p : f32, f32, f32, f32 into f32, f32, f32, bf16
}

// -----

// On the GPU, beside a GPU param, with a stochastically rounded moment.
// CHECK-LABEL: zopt.step @remainder_gpu
// CHECK: zopt.state master : f32 on gpu remainder
zopt.step @remainder_gpu attributes {gpu_arch = "sm_80"} {
  %p = zopt.state param : bf16 on gpu
  %g = zopt.state grad : bf16 on gpu
  %w = zopt.state master : f32 on gpu remainder
  %m = zopt.state exp_avg : bf16 on gpu rounding stochastic
  %lr = zopt.hyper lr
  %b1 = zopt.hyper beta1
  %m1 = zopt.ema %m, %g, %b1 : bf16, bf16
  %w1 = zopt.apply %w, %m1, %lr : f32, f32
  zopt.yield %w1, %m1, %w1 into %w, %m, %p : f32, f32, f32 into f32, bf16, bf16
}
