// RUN: zopt-opt %s --split-input-file --verify-diagnostics
// Each refusal of a q8 moment (docs/Dialects/Zopt.md rule 14b).

// Not an Adam moment.
zopt.step @s {
  %p = zopt.state param : f32 on cpu
  %g = zopt.state grad : f32 on cpu
  // expected-error@+1 {{'q8' block-quantizes an Adam moment (exp_avg: the signed map, exp_avg_sq: the unsigned one); state 'momentum_buffer' is not one: drop 'q8'}}
  %b = zopt.state momentum_buffer : f32 on cpu q8
  %lr = zopt.hyper lr
  %p1 = zopt.apply %p, %b, %lr : f32, f32
  zopt.yield %p1, %b into %p, %b : f32, f32 into f32, f32
}

// -----

// A master.
zopt.step @s {
  %p = zopt.state param : bf16 on cpu
  %g = zopt.state grad : bf16 on cpu
  // expected-error@+1 {{'q8' block-quantizes an Adam moment (exp_avg: the signed map, exp_avg_sq: the unsigned one); state 'master' is not one: drop 'q8'}}
  %w = zopt.state master : f32 on cpu q8
  %lr = zopt.hyper lr
  %gs = zopt.unscale %g : bf16
  %w1 = zopt.apply %w, %gs, %lr : f32, f32
  zopt.yield %w1, %w1 into %w, %p : f32, f32 into f32, bf16
}

// -----

// amsgrad's running max.
zopt.step @s {
  %p = zopt.state param : f32 on cpu
  %g = zopt.state grad : f32 on cpu
  // expected-error@+1 {{state 'max_exp_avg_sq' is not one: drop 'q8'}}
  %x = zopt.state max_exp_avg_sq : f32 on cpu q8
  %lr = zopt.hyper lr
  %p1 = zopt.apply %p, %x, %lr : f32, f32
  zopt.yield %p1, %x into %p, %x : f32, f32 into f32, f32
}

// -----

// A bf16 moment: the logical moment is f32.
zopt.step @s {
  %p = zopt.state param : f32 on cpu
  %g = zopt.state grad : f32 on cpu
  // expected-error@+1 {{a q8 moment is an f32 moment stored as 8-bit codes and a per-block absmax (the rule sees f32); this moment is 'bf16': declare it f32}}
  %m = zopt.state exp_avg : bf16 on cpu q8
  %lr = zopt.hyper lr
  %b1 = zopt.hyper beta1
  %m1 = zopt.ema %m, %g, %b1 : bf16, f32
  %p1 = zopt.apply %p, %m1, %lr : f32, f32
  zopt.yield %p1, %m1 into %p, %m : f32, f32 into f32, bf16
}

// -----

// With a rounding mode.
zopt.step @s {
  %p = zopt.state param : f32 on cpu
  %g = zopt.state grad : f32 on cpu
  // expected-error@+1 {{a q8 moment is encoded to the nearest value of its map (docs/NUMERICS.md §10), not rounded: drop 'rounding'}}
  %m = zopt.state exp_avg : f32 on cpu rounding nearest_even q8
  %lr = zopt.hyper lr
  %b1 = zopt.hyper beta1
  %m1 = zopt.ema %m, %g, %b1 : f32, f32
  %p1 = zopt.apply %p, %m1, %lr : f32, f32
  zopt.yield %p1, %m1 into %p, %m : f32, f32 into f32, f32
}
