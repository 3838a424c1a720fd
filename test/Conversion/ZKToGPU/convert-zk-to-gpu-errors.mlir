// RUN: not zopt-opt %s --convert-zk-to-gpu 2>&1 | FileCheck %s --check-prefix=NOCHIP
// RUN: not zopt-opt %s --convert-zk-to-gpu="chips=gfx90a" 2>&1 | FileCheck %s --check-prefix=BADCHIP
// RUN: not zopt-opt %s --convert-zk-to-gpu="chips=sm_90" 2>&1 | FileCheck %s --check-prefix=NOCONTROL

// NOCHIP: error: the optimizer states are on the GPU but no GPU architecture was given
// BADCHIP: error: unknown GPU architecture 'gfx90a'; expected sm_70 or newer
// NOCONTROL: error: a GPU step needs exactly one zk.control (its SUMSQ and FINISH kernels evaluate it), found 0
zk.descriptor {name = "e", zero_stage = 0 : i64, align = 1 : i64, flags = 0 : i64,
  max_norm = 0.0 : f64, num_coeffs = 1 : i64,
  state_kinds = array<i32: 1, 2>, state_dtypes = array<i32: 1, 1>,
  state_placements = array<i32: 2, 2>, state_roundings = array<i32: 1, 1>,
  state_inits = array<i32: 1, 1>, state_access = array<i32: 3, 1>, state_flags = array<i32: 0, 0>,
  hyper_kinds = array<i32: 1>, hyper_defaults = array<f64: 0.001>,
  hyper_mins = array<f64: 0.0>, hyper_maxs = array<f64: 1.0>,
  hyper_max_exclusive = array<i32: 0>}
zk.prepare @e_prepare {
  %lr = zk.hyper 0
  %c = arith.truncf %lr : f64 to f32
  zk.set_coeff 0, %c : f32
}
zk.kernel @e_update update {
  %p = zk.load 0 : f32
  zk.store 0, %p : f32 into f32
}
