// RUN: zopt-opt %s --split-input-file --verify-diagnostics
// Each refusal of a remainder master (docs/Dialects/Zopt.md rule 14a).

// Not a master.
zopt.step @s {
  %p = zopt.state param : bf16 on cpu
  %g = zopt.state grad : bf16 on cpu
  // expected-error@+1 {{'remainder' stores an f32 master as the int16 low half beside its bf16 param; state 'exp_avg' is not a master: drop 'remainder'}}
  %m = zopt.state exp_avg : f32 on cpu remainder
  %b1 = zopt.hyper beta1
  %lr = zopt.hyper lr
  %m1 = zopt.ema %m, %g, %b1 : f32, bf16
  %p1 = zopt.apply %p, %m1, %lr : bf16, f32
  zopt.yield %p1, %m1 into %p, %m : f32, f32 into bf16, f32
}

// -----

// A bf16 master: the logical master must be f32.
zopt.step @s {
  %p = zopt.state param : f16 on cpu
  %g = zopt.state grad : f16 on cpu
  // expected-error@+1 {{a remainder master is an f32 master (the bf16 param is its high half, the remainder its low half); this master is 'bf16'}}
  %w = zopt.state master : bf16 on cpu remainder
  %lr = zopt.hyper lr
  %gs = zopt.unscale %g : f16
  %w1 = zopt.apply %w, %gs, %lr : bf16, f32
  zopt.yield %w1, %w1 into %w, %p : f32, f32 into bf16, f16
}

// -----

// An f16 param: its high half is no f32's.
// expected-error@+4 {{a remainder master needs a bf16 param (its high half); the param is 'f16'}}
zopt.step @s {
  %p = zopt.state param : f16 on cpu
  %g = zopt.state grad : f16 on cpu
  %w = zopt.state master : f32 on cpu remainder
  %lr = zopt.hyper lr
  %gs = zopt.unscale %g : f16
  %w1 = zopt.apply %w, %gs, %lr : f32, f32
  zopt.yield %w1, %w1 into %w, %p : f32, f32 into f32, f16
}

// -----

// The param on the GPU, the master on the CPU (the offload layout).
// expected-error@+4 {{a remainder master lives beside its param (the param is its high half); the param is on gpu, the master on cpu}}
zopt.step @s attributes {zero_stage = 2 : i64, gpu_arch = "sm_80"} {
  %p = zopt.state param : bf16 on gpu
  %g = zopt.state grad : bf16 on gpu
  %w = zopt.state master : f32 on cpu remainder
  %lr = zopt.hyper lr
  %w1 = zopt.apply %w, %g, %lr : f32, bf16
  zopt.yield %w1, %w1 into %w, %p : f32, f32 into f32, bf16
}

// -----

// A stochastically rounded param.
zopt.step @s {
  // expected-note@+1 {{the param is the master's high half rounded so that the remainder rebuilds the master exactly}}
  %p = zopt.state param : bf16 on cpu rounding stochastic
  %g = zopt.state grad : bf16 on cpu
  // expected-error@+1 {{a remainder master does not combine with a stochastically rounded param: drop 'rounding stochastic' from the param}}
  %w = zopt.state master : f32 on cpu remainder
  %lr = zopt.hyper lr
  %w1 = zopt.apply %w, %g, %lr : f32, bf16
  zopt.yield %w1, %w1 into %w, %p : f32, f32 into f32, bf16
}
