// RUN: zopt-opt %s --split-input-file --verify-diagnostics
// The zk verifiers: kernel roles and descriptor shape.

// An update kernel must store.
// expected-error@+1 {{an update kernel stores and does not accumulate}}
zk.kernel @k update {
  %g = zk.load 1 : f32
  zk.accumulate_sumsq %g : f32
}

// -----

// A sumsq kernel must not store.
// expected-error@+1 {{a sumsq kernel accumulates and does not store}}
zk.kernel @k sumsq {
  %g = zk.load 1 : f32
  zk.store 0, %g : f32 into f32
}

// -----

// State arrays must agree in length.
// expected-error@+1 {{state arrays must all have the same length}}
zk.descriptor {name = "t", zero_stage = 0 : i64, align = 1 : i64, flags = 0 : i64,
  max_norm = 0.0 : f64, num_coeffs = 0 : i64,
  state_kinds = array<i32: 1, 2>, state_dtypes = array<i32: 1>,
  state_placements = array<i32: 1, 1>, state_roundings = array<i32: 1, 1>,
  state_inits = array<i32: 1, 1>, state_access = array<i32: 3, 1>, state_flags = array<i32: 0, 0>,
  hyper_kinds = array<i32>, hyper_defaults = array<f64>,
  hyper_mins = array<f64>, hyper_maxs = array<f64>, hyper_max_exclusive = array<i32>}

// -----

// zk.load belongs to a kernel.
func.func @f() {
  // expected-error@+1 {{expects parent op 'zk.kernel'}}
  %x = zk.load 0 : f32
  return
}

// -----

// The kernel tables the conversions record are [role, isa, "symbol"]
// (cpu_kernels) and [code, "symbol"] (gpu_kernels, gpu_images) of i32 codes.
// expected-error@+1 {{cpu_kernels entries are [i32, i32, "symbol"] arrays; got [1 : i32, "t_prepare"]}}
zk.descriptor {name = "t", zero_stage = 0 : i64, align = 1 : i64, flags = 0 : i64,
  max_norm = 0.0 : f64, num_coeffs = 0 : i64,
  state_kinds = array<i32: 1, 2>, state_dtypes = array<i32: 1, 1>,
  state_placements = array<i32: 1, 1>, state_roundings = array<i32: 1, 1>,
  state_inits = array<i32: 1, 1>, state_access = array<i32: 3, 1>, state_flags = array<i32: 0, 0>,
  hyper_kinds = array<i32>, hyper_defaults = array<f64>,
  hyper_mins = array<f64>, hyper_maxs = array<f64>, hyper_max_exclusive = array<i32>,
  cpu_kernels = [[1 : i32, "t_prepare"]]}

// -----

// expected-error@+1 {{gpu_images entries are [i32, "symbol"] arrays; got [90, "t_gpu_sm_90"]}}
zk.descriptor {name = "t", zero_stage = 0 : i64, align = 1 : i64, flags = 0 : i64,
  max_norm = 0.0 : f64, num_coeffs = 0 : i64,
  state_kinds = array<i32: 1, 2>, state_dtypes = array<i32: 1, 1>,
  state_placements = array<i32: 2, 2>, state_roundings = array<i32: 1, 1>,
  state_inits = array<i32: 1, 1>, state_access = array<i32: 3, 1>, state_flags = array<i32: 0, 0>,
  hyper_kinds = array<i32>, hyper_defaults = array<f64>,
  hyper_mins = array<f64>, hyper_maxs = array<f64>, hyper_max_exclusive = array<i32>,
  gpu_images = [[90, "t_gpu_sm_90"]]}

// -----

// zk.control writes every output of zopt_control exactly once.
// expected-error@+1 {{does not write 'new_good_steps'}}
zk.control @c {
  %one = arith.constant 1.0 : f64
  %f = arith.constant false
  zk.control_out norm, %one : f64
  zk.control_out clip_coef, %one : f64
  zk.control_out skip, %f : i1
  zk.control_out advance, %f : i1
  zk.control_out new_scale, %one : f64
}

// -----

zk.control @c {
  %one = arith.constant 1.0 : f64
  zk.control_out norm, %one : f64
  // expected-error@+1 {{writes 'norm' twice}}
  zk.control_out norm, %one : f64
}

// -----

zk.control @c {
  // expected-error@+1 {{reads 'norm', an output of zopt_control}}
  %n = zk.control_in norm : f64
}

// -----

zk.control @c {
  // expected-error@+1 {{field 'good_steps' is 'i64', not 'f64'}}
  %g = zk.control_in good_steps : f64
}

// -----

zk.control @c {
  %one = arith.constant 1.0 : f64
  // expected-error@+1 {{writes 'sumsq', an input of zopt_control}}
  zk.control_out sumsq, %one : f64
}

// -----

// Only scalar arith/math between the field ops (the lowerings inline it).
zk.control @c {
  %x = arith.constant 1.0 : f64
  // expected-error@+1 {{is not scalar arith/math}}
  %v = vector.broadcast %x : f64 to vector<2xf64>
}

// -----

// i16 storage only for a remainder master.
zk.kernel @k update {
  %w = zk.load 2 : f32
  // expected-error@+1 {{stores into f32, bf16 or f16 (i16 only as a remainder master, with remainder_of; i8 only as a q8 moment, with absmax), not 'i16'}}
  zk.store 2, %w : f32 into i16
}

// -----

// A remainder master stores an f32 into i16.
zk.kernel @k update {
  %w = zk.load 2 {remainder_of = 0 : i64} : f32
  // expected-error@+1 {{a remainder master stores an f32 into i16, not 'f32' into 'f32'}}
  zk.store 2, %w {remainder_of = 0 : i64} : f32 into f32
}

// -----

// A remainder master loads as f32.
zk.kernel @k update {
  // expected-error@+1 {{a remainder master loads as f32, not 'bf16'}}
  %w = zk.load 2 {remainder_of = 0 : i64} : bf16
  zk.store 0, %w : bf16 into bf16
}

// -----

// Its high half is another slot.
zk.kernel @k update {
  // expected-error@+1 {{a remainder master's high half is another slot}}
  %w = zk.load 2 {remainder_of = 2 : i64} : f32
  zk.store 0, %w : f32 into bf16
}

// -----

// i8 storage only for a q8 moment (docs/NUMERICS.md §10).
zk.kernel @k update {
  %m = zk.load 2 : f32
  // expected-error@+1 {{i8 only as a q8 moment, with absmax), not 'i8'}}
  zk.store 2, %m : f32 into i8
}

// -----

// A q8 moment stores an f32 into i8 codes.
zk.kernel @k update {
  %m = zk.load 2 {absmax = 4 : i64} : f32
  // expected-error@+1 {{a q8 moment stores an f32 into i8 codes and an absmax in another slot, not 'f32' into 'bf16'}}
  zk.store 2, %m {absmax = 4 : i64} : f32 into bf16
}

// -----

// Its absmax is another slot.
zk.kernel @k update {
  // expected-error@+1 {{a q8 moment loads as f32 from codes and an absmax in another slot}}
  %m = zk.load 2 {absmax = 2 : i64} : f32
  zk.store 0, %m : f32 into f32
}

// -----

// The unsigned map only on a q8 moment.
zk.kernel @k update {
  // expected-error@+1 {{q8_unsigned needs absmax (a q8 moment)}}
  %v = zk.load 3 {q8_unsigned} : f32
  zk.store 0, %v : f32 into f32
}

// -----

// A Kahan-compensated param (docs/NUMERICS.md §11) stores an f32 into bf16.
zk.kernel @k update {
  %p = zk.load 0 : bf16
  // expected-error@+1 {{a Kahan-compensated param stores an f32 into bf16, rounded to nearest even, with its compensation in another slot, not 'bf16' into 'bf16'}}
  zk.store 0, %p {kahan = 3 : i64} : bf16 into bf16
}

// -----

// Its compensation is another slot.
zk.kernel @k update {
  %p = zk.load 0 : f32
  // expected-error@+1 {{with its compensation in another slot, not 'f32' into 'bf16'}}
  zk.store 0, %p {kahan = 0 : i64} : f32 into bf16
}
