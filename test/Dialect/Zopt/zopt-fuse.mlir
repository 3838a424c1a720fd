// RUN: zopt-opt %s --zopt-decompose --zopt-plan --zopt-fuse --canonicalize --cse | FileCheck %s

// AdamW on bf16 params with an f32 master and clipping. The fuse phase
// produces one descriptor, one f64 prepare function, one update kernel that
// does the whole step in one pass (every state loaded at most once, every
// written state stored once) and one sumsq kernel over the clipped value.
// Flags: CLIP | SUMSQ | DECOUPLED_DECAY | RULE_STATED (1 + 4 + 32 + 64).

// CHECK: zk.descriptor
// CHECK-SAME: flags = 101 : i64
// CHECK-SAME: hyper_kinds = array<i32: 1, 2, 3, 4, 5, 8>
// CHECK-SAME: max_norm = 1.000000e+00 : f64
// CHECK-SAME: name = "adamw_bf16"
// CHECK-SAME: state_access = array<i32: 2, 1, 3, 3, 3>
// CHECK-SAME: state_dtypes = array<i32: 2, 2, 1, 1, 1>
// CHECK-SAME: state_flags = array<i32: 0, 0, 0, 0, 0>
// CHECK-SAME: state_inits = array<i32: 1, 1, 3, 2, 2>
// CHECK-SAME: state_kinds = array<i32: 1, 2, 3, 4, 5>

// Hyperparameters and globals are only read in prepare, in f64.
// CHECK-LABEL: zk.prepare @adamw_bf16_prepare
// CHECK-DAG: zk.hyper 0
// CHECK-DAG: zk.global 0
// CHECK-DAG: zk.global 1
// CHECK-DAG: zk.global 2
// CHECK-DAG: math.powf %{{.+}}, %{{.+}} : f64
// CHECK: zk.set_coeff 0,

// The step's control (Control.cpp; abi.h CONTROL): a clipping step without
// loss scaling takes the norm of the sum, skips when it is not finite and
// clips by min(1, max_norm / (norm + 1e-6)); the scaler passes through.
// CHECK-LABEL: zk.control @adamw_bf16_control
// CHECK-DAG: %[[S:.+]] = zk.control_in sumsq : f64
// CHECK-DAG: %[[N:.+]] = math.sqrt %[[S]] : f64
// CHECK-DAG: %[[A:.+]] = math.absf %[[S]] : f64
// CHECK-DAG: %[[FIN:.+]] = arith.cmpf olt, %[[A]], %{{.+}} : f64
// CHECK-DAG: %[[MN:.+]] = zk.control_in max_norm : f64
// CHECK-DAG: %[[D:.+]] = arith.addf %[[N]], %{{.+}} : f64
// CHECK-DAG: %[[Q:.+]] = arith.divf %[[MN]], %[[D]] : f64
// CHECK-DAG: zk.control_out norm, %[[N]] : f64
// CHECK-DAG: zk.control_out advance, %[[FIN]] : i1
// CHECK-DAG: %[[SC:.+]] = zk.control_in scale : f64
// CHECK-DAG: zk.control_out new_scale, %[[SC]] : f64
// CHECK-NOT: zk.control_in growth_factor

// CHECK-LABEL: zk.kernel @adamw_bf16_update update
// CHECK-NOT: zk.load 0
// CHECK: %[[G:.+]] = zk.load 1 : bf16
// CHECK-DAG: %[[W:.+]] = zk.load 2 : f32
// CHECK-DAG: %[[M:.+]] = zk.load 3 : f32
// CHECK-DAG: %[[V:.+]] = zk.load 4 : f32
// CHECK-NOT: zk.load
// CHECK-NOT: f64
// CHECK: math.sqrt %{{.+}} : f32
// CHECK: zk.store 2, %[[W1:.+]] : f32 into f32
// CHECK: zk.store 3, %{{.+}} : f32 into f32
// CHECK: zk.store 4, %{{.+}} : f32 into f32
// CHECK: zk.store 0, %[[W1]] : f32 into bf16

// The sum of squares is over the scaled grad (coefficient: grad_scale).
// CHECK-LABEL: zk.kernel @adamw_bf16_sumsq sumsq
// CHECK: %[[G2:.+]] = zk.load 1 : bf16
// CHECK: %[[GF:.+]] = arith.extf %[[G2]] : bf16 to f32
// CHECK: %[[GS:.+]] = zk.coeff
// CHECK: %[[X:.+]] = arith.mulf %[[GF]], %[[GS]] : f32
// CHECK: zk.accumulate_sumsq %[[X]] : f32
// CHECK-NOT: zk.store

// The program stays for codegen, which writes it into the descriptor.
// CHECK: zprog.program for "adamw_bf16"
zopt.step @adamw_bf16 {
  %p = zopt.state param : bf16 on cpu
  %g = zopt.state grad : bf16 on cpu
  %w = zopt.state master : f32 on cpu
  %m = zopt.state exp_avg : f32 on cpu
  %v = zopt.state exp_avg_sq : f32 on cpu
  %lr = zopt.hyper lr
  %b1 = zopt.hyper beta1
  %b2 = zopt.hyper beta2
  %eps = zopt.hyper eps
  %wd = zopt.hyper weight_decay
  %gc = zopt.clip_by_global_norm %g max 1.0 : bf16
  %w1, %m1, %v1 = zopt.adam %w, %gc, %m, %v, %lr, %b1, %b2, %eps, %wd {decoupled} : f32, f32, f32, f32
  zopt.yield %w1, %m1, %v1, %w1 into %w, %m, %v, %p : f32, f32, f32, f32 into f32, f32, f32, bf16
}

