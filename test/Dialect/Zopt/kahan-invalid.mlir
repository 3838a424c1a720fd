// RUN: zopt-opt %s --split-input-file --verify-diagnostics
// Each refusal of a Kahan-compensated param (docs/Dialects/Zopt.md rule 14c).

// Not the param.
zopt.step @s {
  %p = zopt.state param : bf16 on cpu
  %g = zopt.state grad : bf16 on cpu
  // expected-error@+1 {{'kahan' compensates the rounding of a bf16 param's stores; state 'exp_avg' is not the param: drop 'kahan'}}
  %m = zopt.state exp_avg : bf16 on cpu kahan
  %b1 = zopt.hyper beta1
  %lr = zopt.hyper lr
  %m1 = zopt.ema %m, %g, %b1 : bf16, bf16
  %p1 = zopt.apply %p, %m1, %lr : bf16, f32
  zopt.yield %p1, %m1 into %p, %m : f32, f32 into bf16, bf16
}

// -----

// An f16 param.
zopt.step @s {
  // expected-error@+1 {{'kahan' compensates a bf16 param (its compensation is bf16 too); this param is 'f16'}}
  %p = zopt.state param : f16 on cpu kahan
  %g = zopt.state grad : f16 on cpu
  %lr = zopt.hyper lr
  %gs = zopt.unscale %g : f16
  %p1 = zopt.apply %p, %gs, %lr : f16, f32
  zopt.yield %p1 into %p : f32 into f16
}

// -----

// With a master.
zopt.step @s {
  // expected-note@+1 {{the compensation carries the rounding error of the param's stores into the next step in place of a master}}
  %p = zopt.state param : bf16 on cpu kahan
  %g = zopt.state grad : bf16 on cpu
  // expected-error@+1 {{a Kahan-compensated param has no master: drop the master or 'kahan' from the param}}
  %w = zopt.state master : f32 on cpu
  %lr = zopt.hyper lr
  %w1 = zopt.apply %w, %g, %lr : f32, bf16
  zopt.yield %w1, %w1 into %w, %p : f32, f32 into f32, bf16
}

// -----

// With stochastic rounding.
zopt.step @s {
  // expected-error@+2 {{a Kahan-compensated param does not combine with stochastic rounding: drop 'rounding stochastic' or 'kahan'}}
  // expected-note@+1 {{a stochastic store would only add noise that the compensation then cancels}}
  %p = zopt.state param : bf16 on cpu rounding stochastic kahan
  %g = zopt.state grad : bf16 on cpu
  %lr = zopt.hyper lr
  %p1 = zopt.apply %p, %g, %lr : bf16, bf16
  zopt.yield %p1 into %p : f32 into bf16
}

// -----

// The optimizer states elsewhere (offload): the compensation lives with the
// param, and the update runs where the optimizer states are.
zopt.step @s attributes {gpu_arch = "sm_80"} {
  // expected-error@+1 {{a Kahan-compensated param is updated beside its compensation, with the optimizer states; the param is on gpu, 'exp_avg' on cpu}}
  %p = zopt.state param : bf16 on gpu kahan
  %g = zopt.state grad : bf16 on gpu
  %m = zopt.state exp_avg : f32 on cpu
  %b1 = zopt.hyper beta1
  %lr = zopt.hyper lr
  %m1 = zopt.ema %m, %g, %b1 : f32, bf16
  %p1 = zopt.apply %p, %m1, %lr : bf16, f32
  zopt.yield %p1, %m1 into %p, %m : f32, f32 into bf16, f32
}

