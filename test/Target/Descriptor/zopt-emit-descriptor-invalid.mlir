// RUN: zopt-opt %s --split-input-file --zopt-emit-descriptor --verify-diagnostics

// zopt-emit-descriptor refuses what the runtime would refuse at load or
// finalize, or run into wrong values: a missing table or program, and the
// rules that relate the step program to the step (docs/Dialects/Program.md,
// "Against the step"). One case per rule.

// The descriptor is written after convert-zk-to-cpu recorded its table.
// expected-error@+1 {{'zk.descriptor' op has no CPU kernel table: zopt-emit-descriptor runs after convert-zk-to-cpu}}
zk.descriptor {name = "t", zero_stage = 0 : i64, align = 1 : i64, flags = 0 : i64,
  max_norm = 0.0 : f64, num_coeffs = 1 : i64,
  state_kinds = array<i32: 1, 2>, state_dtypes = array<i32: 1, 1>,
  state_placements = array<i32: 1, 1>, state_roundings = array<i32: 1, 1>,
  state_inits = array<i32: 1, 1>, state_access = array<i32: 3, 1>, state_flags = array<i32: 0, 0>,
  hyper_kinds = array<i32: 1>, hyper_defaults = array<f64: 0.001>,
  hyper_mins = array<f64: 0.0>, hyper_maxs = array<f64: 1.0>,
  hyper_max_exclusive = array<i32: 0>}
zprog.program for "t" {
  zprog.reduce_scatter grad : f32 accumulate f32
  zprog.all_gather grad : f32
  zprog.prepare on cpu
  zprog.update all on cpu
  zprog.finish on cpu
}

// -----

// Every step has its program (made by zopt-plan).
// expected-error@+1 {{expected exactly one zprog.program (made by zopt-plan), found 0}}
module {
zk.descriptor {name = "t", zero_stage = 0 : i64, align = 1 : i64, flags = 0 : i64,
  max_norm = 0.0 : f64, num_coeffs = 1 : i64,
  state_kinds = array<i32: 1, 2>, state_dtypes = array<i32: 1, 1>,
  state_placements = array<i32: 1, 1>, state_roundings = array<i32: 1, 1>,
  state_inits = array<i32: 1, 1>, state_access = array<i32: 3, 1>, state_flags = array<i32: 0, 0>,
  hyper_kinds = array<i32: 1>, hyper_defaults = array<f64: 0.001>,
  hyper_mins = array<f64: 0.0>, hyper_maxs = array<f64: 1.0>,
  hyper_max_exclusive = array<i32: 0>,
  cpu_kernels = [[1 : i32, 0 : i32, "t_prepare"], [2 : i32, 1 : i32, "t_update_avx2"]]}
}

// -----

// The descriptor holds at most ZOPT_MAX_KERNELS (16) kernels.
// expected-error@+1 {{too many kernels for the descriptor}}
zk.descriptor {name = "t", zero_stage = 0 : i64, align = 1 : i64, flags = 0 : i64,
  max_norm = 0.0 : f64, num_coeffs = 1 : i64,
  state_kinds = array<i32: 1, 2>, state_dtypes = array<i32: 1, 1>,
  state_placements = array<i32: 1, 1>, state_roundings = array<i32: 1, 1>,
  state_inits = array<i32: 1, 1>, state_access = array<i32: 3, 1>, state_flags = array<i32: 0, 0>,
  hyper_kinds = array<i32: 1>, hyper_defaults = array<f64: 0.001>,
  hyper_mins = array<f64: 0.0>, hyper_maxs = array<f64: 1.0>,
  hyper_max_exclusive = array<i32: 0>,
  cpu_kernels = [[2 : i32, 1 : i32, "k0"], [2 : i32, 1 : i32, "k1"], [2 : i32, 1 : i32, "k2"], [2 : i32, 1 : i32, "k3"], [2 : i32, 1 : i32, "k4"], [2 : i32, 1 : i32, "k5"], [2 : i32, 1 : i32, "k6"], [2 : i32, 1 : i32, "k7"], [2 : i32, 1 : i32, "k8"], [2 : i32, 1 : i32, "k9"], [2 : i32, 1 : i32, "k10"], [2 : i32, 1 : i32, "k11"], [2 : i32, 1 : i32, "k12"], [2 : i32, 1 : i32, "k13"], [2 : i32, 1 : i32, "k14"], [2 : i32, 1 : i32, "k15"], [2 : i32, 1 : i32, "k16"]]}
zprog.program for "t" {
  zprog.reduce_scatter grad : f32 accumulate f32
  zprog.all_gather grad : f32
  zprog.prepare on cpu
  zprog.update all on cpu
  zprog.finish on cpu
}

// -----

// A program op names a state the step has.
zk.descriptor {name = "t", zero_stage = 0 : i64, align = 1 : i64, flags = 0 : i64,
  max_norm = 0.0 : f64, num_coeffs = 1 : i64,
  state_kinds = array<i32: 1, 3>, state_dtypes = array<i32: 1, 1>,
  state_placements = array<i32: 1, 1>, state_roundings = array<i32: 1, 1>,
  state_inits = array<i32: 1, 1>, state_access = array<i32: 3, 1>, state_flags = array<i32: 0, 0>,
  hyper_kinds = array<i32: 1>, hyper_defaults = array<f64: 0.001>,
  hyper_mins = array<f64: 0.0>, hyper_maxs = array<f64: 1.0>,
  hyper_max_exclusive = array<i32: 0>,
  cpu_kernels = [[1 : i32, 0 : i32, "t_prepare"], [2 : i32, 1 : i32, "t_update_avx2"]]}
zprog.program for "t" {
  // expected-error@+1 {{'zprog.reduce_scatter' op names a state the step does not have}}
  zprog.reduce_scatter grad : f32 accumulate f32
  zprog.all_gather grad : f32
  zprog.prepare on cpu
  zprog.update all on cpu
  zprog.finish on cpu
}

// -----

// Collectives move a state in its storage type.
zk.descriptor {name = "t", zero_stage = 0 : i64, align = 1 : i64, flags = 0 : i64,
  max_norm = 0.0 : f64, num_coeffs = 1 : i64,
  state_kinds = array<i32: 1, 2>, state_dtypes = array<i32: 2, 2>,
  state_placements = array<i32: 1, 1>, state_roundings = array<i32: 1, 1>,
  state_inits = array<i32: 1, 1>, state_access = array<i32: 3, 1>, state_flags = array<i32: 0, 0>,
  hyper_kinds = array<i32: 1>, hyper_defaults = array<f64: 0.001>,
  hyper_mins = array<f64: 0.0>, hyper_maxs = array<f64: 1.0>,
  hyper_max_exclusive = array<i32: 0>,
  cpu_kernels = [[1 : i32, 0 : i32, "t_prepare"], [2 : i32, 1 : i32, "t_update_avx2"]]}
zprog.program for "t" {
  // expected-error@+1 {{'zprog.reduce_scatter' op moves the grad as 'f32', but the step stores it as bf16}}
  zprog.reduce_scatter grad : f32 accumulate f32
  zprog.all_gather grad : bf16
  zprog.prepare on cpu
  zprog.update all on cpu
  zprog.finish on cpu
}

// -----

// A copy stages a state from where the step keeps it.
zk.descriptor {name = "t", zero_stage = 0 : i64, align = 1 : i64, flags = 0 : i64,
  max_norm = 0.0 : f64, num_coeffs = 1 : i64,
  state_kinds = array<i32: 1, 2>, state_dtypes = array<i32: 1, 1>,
  state_placements = array<i32: 1, 1>, state_roundings = array<i32: 1, 1>,
  state_inits = array<i32: 1, 1>, state_access = array<i32: 3, 1>, state_flags = array<i32: 0, 0>,
  hyper_kinds = array<i32: 1>, hyper_defaults = array<f64: 0.001>,
  hyper_mins = array<f64: 0.0>, hyper_maxs = array<f64: 1.0>,
  hyper_max_exclusive = array<i32: 0>,
  cpu_kernels = [[1 : i32, 0 : i32, "t_prepare"], [2 : i32, 1 : i32, "t_update_avx2"]]}
zprog.program for "t" {
  // expected-error@+1 {{'zprog.copy' op copies the grad from gpu, but the step keeps it on cpu}}
  zprog.copy grad : f32 from gpu to cpu
  zprog.reduce_scatter grad : f32 accumulate f32
  zprog.all_gather grad : f32
  zprog.prepare on cpu
  zprog.update all on cpu
  zprog.finish on cpu
}

// -----

// A state the step keeps sharded is never gathered whole (ZeRO-3 params).
zk.descriptor {name = "t", zero_stage = 0 : i64, align = 1 : i64, flags = 0 : i64,
  max_norm = 0.0 : f64, num_coeffs = 1 : i64,
  state_kinds = array<i32: 1, 2, 4>, state_dtypes = array<i32: 1, 1, 1>,
  state_placements = array<i32: 1, 1, 1>, state_roundings = array<i32: 1, 1, 1>,
  state_inits = array<i32: 1, 1, 1>, state_access = array<i32: 3, 1, 1>, state_flags = array<i32: 1, 1, 1>,
  hyper_kinds = array<i32: 1>, hyper_defaults = array<f64: 0.001>,
  hyper_mins = array<f64: 0.0>, hyper_maxs = array<f64: 1.0>,
  hyper_max_exclusive = array<i32: 0>,
  cpu_kernels = [[1 : i32, 0 : i32, "t_prepare"], [2 : i32, 1 : i32, "t_update_avx2"]]}
zprog.program for "t" {
  zprog.reduce_scatter grad : f32 accumulate f32
  zprog.prepare on cpu
  zprog.update owned on cpu
  // expected-error@+1 {{'zprog.all_gather' op gathers the param, which the step keeps sharded across ranks (ZeRO-3 params are gathered on request)}}
  zprog.all_gather param : f32 unless_skipped
  zprog.finish on cpu
}

// -----

// With sharded states, no op covers every element.
zk.descriptor {name = "t", zero_stage = 0 : i64, align = 1 : i64, flags = 0 : i64,
  max_norm = 0.0 : f64, num_coeffs = 1 : i64,
  state_kinds = array<i32: 1, 2, 4>, state_dtypes = array<i32: 1, 1, 1>,
  state_placements = array<i32: 1, 1, 1>, state_roundings = array<i32: 1, 1, 1>,
  state_inits = array<i32: 1, 1, 1>, state_access = array<i32: 3, 1, 1>, state_flags = array<i32: 0, 0, 1>,
  hyper_kinds = array<i32: 1>, hyper_defaults = array<f64: 0.001>,
  hyper_mins = array<f64: 0.0>, hyper_maxs = array<f64: 1.0>,
  hyper_max_exclusive = array<i32: 0>,
  cpu_kernels = [[1 : i32, 0 : i32, "t_prepare"], [2 : i32, 1 : i32, "t_update_avx2"]]}
zprog.program for "t" {
  zprog.reduce_scatter grad : f32 accumulate f32
  zprog.all_gather grad : f32
  zprog.prepare on cpu
  // expected-error@+1 {{'zprog.update' op covers every element, but the step shards states across ranks: use 'owned'}}
  zprog.update all on cpu
  zprog.finish on cpu
}

// -----

// The norm's partials need the step's sum-of-squares kernel (flag SUMSQ).
zk.descriptor {name = "t", zero_stage = 0 : i64, align = 1 : i64, flags = 0 : i64,
  max_norm = 0.0 : f64, num_coeffs = 1 : i64,
  state_kinds = array<i32: 1, 2>, state_dtypes = array<i32: 1, 1>,
  state_placements = array<i32: 1, 1>, state_roundings = array<i32: 1, 1>,
  state_inits = array<i32: 1, 1>, state_access = array<i32: 3, 1>, state_flags = array<i32: 0, 0>,
  hyper_kinds = array<i32: 1>, hyper_defaults = array<f64: 0.001>,
  hyper_mins = array<f64: 0.0>, hyper_maxs = array<f64: 1.0>,
  hyper_max_exclusive = array<i32: 0>,
  cpu_kernels = [[1 : i32, 0 : i32, "t_prepare"], [2 : i32, 1 : i32, "t_update_avx2"]]}
zprog.program for "t" {
  zprog.reduce_scatter grad : f32 accumulate f32
  zprog.all_gather grad : f32
  zprog.prepare on cpu
  // expected-error@+1 {{'zprog.norm_partials' op needs the step's sum-of-squares kernel, and the step has none}}
  zprog.norm_partials all on cpu
  zprog.norm
  zprog.update all on cpu
  zprog.finish on cpu
}

// -----

// A clipped step (flag CLIP) takes the norm: without it the runtime would
// never clip nor skip a non-finite step.
zk.descriptor {name = "t", zero_stage = 0 : i64, align = 1 : i64, flags = 5 : i64,
  max_norm = 0.0 : f64, num_coeffs = 1 : i64,
  state_kinds = array<i32: 1, 2>, state_dtypes = array<i32: 1, 1>,
  state_placements = array<i32: 1, 1>, state_roundings = array<i32: 1, 1>,
  state_inits = array<i32: 1, 1>, state_access = array<i32: 3, 1>, state_flags = array<i32: 0, 0>,
  hyper_kinds = array<i32: 1>, hyper_defaults = array<f64: 0.001>,
  hyper_mins = array<f64: 0.0>, hyper_maxs = array<f64: 1.0>,
  hyper_max_exclusive = array<i32: 0>,
  cpu_kernels = [[1 : i32, 0 : i32, "t_prepare"], [2 : i32, 1 : i32, "t_update_avx2"]]}
// expected-error@+1 {{'zprog.program' op takes no norm, but the step clips or scales the loss: the clip coefficient and the non-finite skip need zprog.norm_partials and zprog.norm}}
zprog.program for "t" {
  zprog.reduce_scatter grad : f32 accumulate f32
  zprog.all_gather grad : f32
  zprog.prepare on cpu
  zprog.update all on cpu
  zprog.finish on cpu
}

// -----

// An update of this rank's shards of a param every rank holds whole is
// followed by the params' gather (ZeRO-1, 2), else the ranks' copies diverge.
zk.descriptor {name = "t", zero_stage = 0 : i64, align = 1 : i64, flags = 0 : i64,
  max_norm = 0.0 : f64, num_coeffs = 1 : i64,
  state_kinds = array<i32: 1, 2>, state_dtypes = array<i32: 1, 1>,
  state_placements = array<i32: 1, 1>, state_roundings = array<i32: 1, 1>,
  state_inits = array<i32: 1, 1>, state_access = array<i32: 3, 1>, state_flags = array<i32: 0, 0>,
  hyper_kinds = array<i32: 1>, hyper_defaults = array<f64: 0.001>,
  hyper_mins = array<f64: 0.0>, hyper_maxs = array<f64: 1.0>,
  hyper_max_exclusive = array<i32: 0>,
  cpu_kernels = [[1 : i32, 0 : i32, "t_prepare"], [2 : i32, 1 : i32, "t_update_avx2"]]}
zprog.program for "t" {
  zprog.reduce_scatter grad : f32 accumulate f32
  zprog.prepare on cpu
  // expected-error@+1 {{'zprog.update' op updates only this rank's shards of the param, which every rank holds whole, and no zprog.all_gather of the param follows: the other ranks' copies would go stale}}
  zprog.update owned on cpu
  zprog.finish on cpu
}
