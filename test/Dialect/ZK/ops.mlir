// RUN: zopt-opt %s | FileCheck %s
// RUN: zopt-opt %s | zopt-opt | FileCheck %s
// RUN: zopt-opt %s --mlir-print-op-generic | zopt-opt | FileCheck %s

// Every zk op prints and parses back, in the custom and the generic form:
// the descriptor with the kernel tables the conversions record, the f64
// prepare and the two kernel roles.

// CHECK: zk.descriptor {align = 16 : i64, cpu_kernels = {{\[}}[1 : i32, 0 : i32, "t_prepare"]], flags = 4 : i64,
// CHECK-SAME: gpu_images = {{\[}}[90 : i32, "t_gpu_sm_90"]], gpu_kernels = {{\[}}[2 : i32, "t_update"]],
// CHECK-SAME: name = "t"
zk.descriptor {name = "t", zero_stage = 1 : i64, align = 16 : i64, flags = 4 : i64,
  max_norm = 0.0 : f64, num_coeffs = 2 : i64,
  state_kinds = array<i32: 1, 2, 4>, state_dtypes = array<i32: 2, 2, 1>,
  state_placements = array<i32: 2, 2, 2>, state_roundings = array<i32: 1, 1, 1>,
  state_inits = array<i32: 1, 1, 2>, state_access = array<i32: 3, 1, 3>,
  state_flags = array<i32: 0, 0, 1>,
  hyper_kinds = array<i32: 1, 2>, hyper_defaults = array<f64: 0.001, 0.9>,
  hyper_mins = array<f64: 0.0, 0.0>, hyper_maxs = array<f64: 1.0, 1.0>,
  hyper_max_exclusive = array<i32: 0, 1>,
  cpu_kernels = [[1 : i32, 0 : i32, "t_prepare"]],
  gpu_kernels = [[2 : i32, "t_update"]],
  gpu_images = [[90 : i32, "t_gpu_sm_90"]]}

// CHECK-LABEL: zk.prepare @t_prepare {
// CHECK-NEXT: %[[LR:.+]] = zk.hyper 0
// CHECK-NEXT: %[[B1:.+]] = zk.hyper 1
// CHECK-NEXT: %[[T:.+]] = zk.global 0
// CHECK: zk.set_coeff 0, %{{.+}} : f32
// CHECK: zk.set_coeff 1, %{{.+}} : f64
zk.prepare @t_prepare {
  %lr = zk.hyper 0
  %b1 = zk.hyper 1
  %t = zk.global 0
  %c = arith.truncf %lr : f64 to f32
  zk.set_coeff 0, %c : f32
  %p = math.powf %b1, %t : f64
  zk.set_coeff 1, %p : f64
}

// CHECK-LABEL: zk.kernel @t_update update {
// CHECK-NEXT: %[[P:.+]] = zk.load 0 : bf16
// CHECK-NEXT: %[[M:.+]] = zk.load 2 : f32
// CHECK-NEXT: %[[C:.+]] = zk.coeff 0
// CHECK: zk.store 0, %{{.+}} {rounding = 2 : i32} : f32 into bf16
// CHECK: zk.store 2, %{{.+}} : f32 into f32
zk.kernel @t_update update {
  %p = zk.load 0 : bf16
  %m = zk.load 2 : f32
  %c = zk.coeff 0
  %pf = arith.extf %p : bf16 to f32
  %d = arith.mulf %c, %m : f32
  %p1 = arith.subf %pf, %d : f32
  zk.store 0, %p1 {rounding = 2 : i32} : f32 into bf16
  zk.store 2, %d : f32 into f32
}

// CHECK-LABEL: zk.kernel @t_sumsq sumsq {
// CHECK-NEXT: %[[G:.+]] = zk.load 1 : bf16
// CHECK: zk.accumulate_sumsq %{{.+}} : f32
zk.kernel @t_sumsq sumsq {
  %g = zk.load 1 : bf16
  %gf = arith.extf %g : bf16 to f32
  zk.accumulate_sumsq %gf : f32
}

// CHECK-LABEL: zk.control @t_control {
// CHECK-NEXT: %[[S:.+]] = zk.control_in sumsq : f64
// CHECK-NEXT: %[[N:.+]] = math.sqrt %[[S]] : f64
// CHECK: zk.control_in dynamic : i1
// CHECK: zk.control_out norm, %[[N]] : f64
// CHECK: zk.control_out new_good_steps, %{{.+}} : i64
zk.control @t_control {
  %s = zk.control_in sumsq : f64
  %n = math.sqrt %s : f64
  %one = arith.constant 1.0 : f64
  %f = arith.constant false
  %t = arith.constant true
  %S = zk.control_in scale : f64
  %good = zk.control_in good_steps : i64
  %d = zk.control_in dynamic : i1
  zk.control_out norm, %n : f64
  zk.control_out clip_coef, %one : f64
  zk.control_out skip, %f : i1
  zk.control_out advance, %t : i1
  zk.control_out new_scale, %S : f64
  zk.control_out new_good_steps, %good : i64
}

// A remainder master (docs/NUMERICS.md §9): joined from slots 2 and 0, split
// back into them.
// CHECK-LABEL: zk.kernel @remainder_update update
// CHECK: zk.load 2 {remainder_of = 0 : i64} : f32
// CHECK: zk.store 2, %{{.+}} {remainder_of = 0 : i64} : f32 into i16
zk.kernel @remainder_update update {
  %w = zk.load 2 {remainder_of = 0 : i64} : f32
  %g = zk.load 1 : bf16
  %gf = arith.extf %g : bf16 to f32
  %w1 = arith.subf %w, %gf : f32
  zk.store 2, %w1 {remainder_of = 0 : i64} : f32 into i16
}
