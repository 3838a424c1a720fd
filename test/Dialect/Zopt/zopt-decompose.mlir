// RUN: zopt-opt %s --split-input-file --zopt-decompose | FileCheck %s

// zopt.adam {decoupled} is AdamW: decay the param by (1 - lr*wd) computed in
// f64, moments in f32, bias correction from the group's bias_correction slot
// and the step count; no zopt primitive survives.
// CHECK-LABEL: zopt.step @adamw
// CHECK-DAG: %[[P:.+]] = zopt.state param : f32
// CHECK-DAG: %[[LR:.+]] = zopt.hyper lr
// CHECK-DAG: %[[WD:.+]] = zopt.hyper weight_decay
// CHECK: %[[LRWD:.+]] = arith.mulf %[[LR]], %[[WD]] : f64
// CHECK: %[[K:.+]] = arith.subf %{{.+}}, %[[LRWD]] : f64
// CHECK: %[[KF:.+]] = arith.truncf %[[K]] : f64 to f32
// CHECK: arith.mulf %[[P]], %[[KF]] : f32
// CHECK-DAG: zopt.global step
// CHECK-DAG: zopt.hyper bias_correction
// CHECK-DAG: math.powf %{{.+}}, %{{.+}} : f64
// CHECK-DAG: math.sqrt %{{.+}} : f32
// CHECK-NOT: zopt.adam
// CHECK-NOT: zopt.ema
// CHECK-NOT: zopt.apply
// CHECK: zopt.yield
zopt.step @adamw {
  %p = zopt.state param : f32 on cpu
  %g = zopt.state grad : f32 on cpu
  %m = zopt.state exp_avg : f32 on cpu
  %v = zopt.state exp_avg_sq : f32 on cpu
  %lr = zopt.hyper lr
  %b1 = zopt.hyper beta1
  %b2 = zopt.hyper beta2
  %eps = zopt.hyper eps
  %wd = zopt.hyper weight_decay
  %p1, %m1, %v1 = zopt.adam %p, %g, %m, %v, %lr, %b1, %b2, %eps, %wd {decoupled} : f32, f32, f32, f32
  zopt.yield %p1, %m1, %v1 into %p, %m, %v : f32, f32, f32 into f32, f32, f32
}

// -----

// Without `decoupled`, zopt.adam is Adam with L2: g + wd * p, no param decay.
// CHECK-LABEL: zopt.step @adam_l2
// CHECK-DAG: %[[P:.+]] = zopt.state param : f32
// CHECK-DAG: %[[G:.+]] = zopt.state grad : f32
// CHECK: %[[WDF:.+]] = arith.truncf %{{.+}} : f64 to f32
// CHECK: %[[D:.+]] = arith.mulf %[[WDF]], %[[P]] : f32
// CHECK: arith.addf %[[G]], %[[D]] : f32
zopt.step @adam_l2 {
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

// -----

// bf16 operands widen exactly (arith.extf) before f32 math; SGD momentum
// selects buf = g at the first step from the step count, in f64.
// CHECK-LABEL: zopt.step @sgd_bf16
// CHECK: %[[B:.+]] = zopt.state momentum_buffer : bf16
// CHECK: %[[T:.+]] = zopt.global step
// CHECK: %[[FIRST:.+]] = arith.cmpf oeq, %[[T]], %{{.+}} : f64
// CHECK: arith.select %[[FIRST]]
// CHECK: arith.extf %[[B]] : bf16 to f32
zopt.step @sgd_bf16 {
  %p = zopt.state param : bf16 on cpu
  %g = zopt.state grad : bf16 on cpu
  %buf = zopt.state momentum_buffer : bf16 on cpu
  %lr = zopt.hyper lr
  %mu = zopt.hyper momentum
  %damp = zopt.hyper dampening
  %b1 = zopt.momentum %buf, %g, %mu, %damp : bf16, bf16
  %p1 = zopt.apply %p, %b1, %lr : bf16, f32
  zopt.yield %p1, %b1 into %p, %buf : f32, f32 into bf16, bf16
}

// -----

// Lion's sign keeps NaN and zero: two selects over ordered compares.
// CHECK-LABEL: zopt.step @sign
// CHECK: %[[LT:.+]] = arith.cmpf olt
// CHECK: %[[NEG:.+]] = arith.select %[[LT]]
// CHECK: %[[GT:.+]] = arith.cmpf ogt
// CHECK: arith.select %[[GT]], %{{.+}}, %[[NEG]] : f32
// clip_by_global_norm is left for the plan phase.
// CHECK: zopt.clip_by_global_norm
zopt.step @sign {
  %p = zopt.state param : f32 on cpu
  %g = zopt.state grad : f32 on cpu
  %lr = zopt.hyper lr
  %s = zopt.sign %g : f32
  %gc = zopt.clip_by_global_norm %s max 1.0 : f32
  %p1 = zopt.apply %p, %gc, %lr : f32, f32
  zopt.yield %p1 into %p : f32 into f32
}
