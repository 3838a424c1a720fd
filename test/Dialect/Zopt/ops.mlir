// RUN: zopt-opt %s | FileCheck %s
// RUN: zopt-opt %s | zopt-opt | FileCheck %s
// Every zopt op prints and re-parses to the same text.

// CHECK-LABEL: zopt.step @all_primitives
// CHECK-SAME: attributes {align = 64 : i64, zero_stage = 2 : i64}
zopt.step @all_primitives attributes {zero_stage = 2 : i64, align = 64 : i64} {
  // CHECK: %[[P:.+]] = zopt.state param : bf16 on cpu
  %p = zopt.state param : bf16 on cpu
  // CHECK: %[[G:.+]] = zopt.state grad : bf16 on cpu
  %g = zopt.state grad : bf16 on cpu
  // CHECK: %[[W:.+]] = zopt.state master : f32 on cpu
  %w = zopt.state master : f32 on cpu
  // CHECK: %[[M:.+]] = zopt.state exp_avg : bf16 on cpu rounding nearest_even
  %m = zopt.state exp_avg : bf16 on cpu rounding nearest_even
  // CHECK: %[[V:.+]] = zopt.state exp_avg_sq : f32 on cpu
  %v = zopt.state exp_avg_sq : f32 on cpu
  %vm = zopt.state max_exp_avg_sq : f32 on cpu
  %buf = zopt.state momentum_buffer : f32 on cpu
  // CHECK: %[[LR:.+]] = zopt.hyper lr default 1.000000e-02
  %lr = zopt.hyper lr default 1.0e-2
  %b1 = zopt.hyper beta1
  %b2 = zopt.hyper beta2
  %eps = zopt.hyper eps
  %wd = zopt.hyper weight_decay
  %mu = zopt.hyper momentum
  %damp = zopt.hyper dampening
  // CHECK: %{{.+}} = zopt.global step
  %t = zopt.global step
  // CHECK: %[[GC:.+]] = zopt.clip_by_global_norm %[[G]] max 1.000000e+00 : bf16
  %gc = zopt.clip_by_global_norm %g max 1.0 : bf16
  // CHECK: zopt.l2_decay %[[GC]], %[[W]], %{{.+}} : f32, f32
  %gd = zopt.l2_decay %gc, %w, %wd : f32, f32
  // CHECK: zopt.ema %[[M]], %{{.+}}, %{{.+}} : bf16, f32
  %m1 = zopt.ema %m, %gd, %b1 : bf16, f32
  // CHECK: zopt.ema_sq %[[V]], %{{.+}}, %{{.+}} : f32, f32
  %v1 = zopt.ema_sq %v, %gd, %b2 : f32, f32
  // CHECK: zopt.max
  %vm1 = zopt.max %vm, %v1 : f32, f32
  // CHECK: zopt.adam_direction
  %u = zopt.adam_direction %m1, %vm1, %b1, %b2, %eps : f32, f32
  // CHECK: zopt.momentum
  %bf1 = zopt.momentum %buf, %gd, %mu, %damp : f32, f32
  // CHECK: zopt.nesterov
  %d = zopt.nesterov %gd, %bf1, %mu : f32, f32
  // CHECK: zopt.sign
  %s = zopt.sign %d : f32
  // CHECK: zopt.decoupled_decay %[[W]], %[[LR]], %{{.+}} : f32
  %w1 = zopt.decoupled_decay %w, %lr, %wd : f32
  // CHECK: zopt.apply
  %w2 = zopt.apply %w1, %u, %lr : f32, f32
  %w3 = zopt.apply %w2, %s, %lr : f32, f32
  // CHECK: zopt.yield %{{.+}} into %[[W]], %[[M]], %[[V]], {{.*}} : f32, f32, f32, f32, f32, f32 into f32, bf16, f32, f32, f32, bf16
  zopt.yield %w3, %m1, %v1, %vm1, %bf1, %w3 into %w, %m, %v, %vm, %buf, %p : f32, f32, f32, f32, f32, f32 into f32, bf16, f32, f32, f32, bf16
}

// CHECK-LABEL: zopt.step @named_rule
// CHECK: zopt.unscale
// CHECK: zopt.adam %{{.+}} {decoupled} : f16, f32, f32, f32
module {
zopt.step @named_rule {
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
  %w1, %m1, %v1 = zopt.adam %p, %gs, %m, %v, %lr, %b1, %b2, %eps, %wd {decoupled} : f16, f32, f32, f32
  zopt.yield %w1, %m1, %v1, %w1 into %w, %m, %v, %p : f32, f32, f32, f32 into f32, f32, f32, f16
}
}
