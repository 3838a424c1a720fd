// RUN: zopt-opt %s --split-input-file --verify-diagnostics
// Every zopt op refuses attributes it does not declare (the
// KnownAttributesOnly trait of Zopt_Op): a misspelled attribute must not
// silently change the math. Compiler-internal `zopt.` attributes set by the
// passes stay accepted (last cases).

// The brief's case: `decoupled_wd` is not `decoupled`; without the check
// this compiles to Adam with L2 decay instead of AdamW.
zopt.step @adamw_typo {
  %p = zopt.state param : f32 on cpu
  %g = zopt.state grad : f32 on cpu
  %m = zopt.state exp_avg : f32 on cpu
  %v = zopt.state exp_avg_sq : f32 on cpu
  %lr = zopt.hyper lr
  %b1 = zopt.hyper beta1
  %b2 = zopt.hyper beta2
  %eps = zopt.hyper eps
  %wd = zopt.hyper weight_decay
  // expected-error@+1 {{'zopt.adam' op unknown attribute 'decoupled_wd'; did you mean 'decoupled'? (attributes of 'zopt.adam': decoupled)}}
  %p1, %m1, %v1 = zopt.adam %p, %g, %m, %v, %lr, %b1, %b2, %eps, %wd {decoupled_wd} : f32, f32, f32, f32
  zopt.yield %p1, %m1, %v1 into %p, %m, %v : f32, f32, f32 into f32, f32, f32
}

// -----

// A misspelled step attribute: the step would silently run at ZeRO-0.
// expected-error@+1 {{'zopt.step' op unknown attribute 'zero_satge'; did you mean 'zero_stage'? (attributes of 'zopt.step': align, gpu_arch, zero_stage)}}
zopt.step @s attributes {zero_satge = 2 : i64} {
  %p = zopt.state param : f32 on cpu
  %g = zopt.state grad : f32 on cpu
  %lr = zopt.hyper lr
  %p1 = zopt.apply %p, %g, %lr : f32, f32
  zopt.yield %p1 into %p : f32 into f32
}

// -----

// A prefix of a known name is suggested too.
// expected-error@+1 {{unknown attribute 'gpu'; did you mean 'gpu_arch'?}}
zopt.step @s attributes {gpu = "sm_90"} {
  %p = zopt.state param : f32 on cpu
  %g = zopt.state grad : f32 on cpu
  %lr = zopt.hyper lr
  %p1 = zopt.apply %p, %g, %lr : f32, f32
  zopt.yield %p1 into %p : f32 into f32
}

// -----

// An op without attributes says so; no far-fetched suggestion.
zopt.step @s {
  %p = zopt.state param : f32 on cpu
  %g = zopt.state grad : f32 on cpu
  %lr = zopt.hyper lr
  // expected-error@+1 {{'zopt.apply' op unknown attribute 'nesterov' ('zopt.apply' takes no attributes)}}
  %p1 = zopt.apply %p, %g, %lr {nesterov} : f32, f32
  zopt.yield %p1 into %p : f32 into f32
}

// -----

// Attributes of other dialects are not zopt's either.
zopt.step @s {
  %p = zopt.state param : f32 on cpu
  // expected-error@+1 {{'zopt.state' op unknown attribute 'arith.fastmath'}}
  %g = zopt.state grad : f32 on cpu {arith.fastmath = #arith.fastmath<fast>}
  %lr = zopt.hyper lr
  %p1 = zopt.apply %p, %g, %lr : f32, f32
  zopt.yield %p1 into %p : f32 into f32
}

// -----

// On the terminator too.
zopt.step @s {
  %p = zopt.state param : f32 on cpu
  %g = zopt.state grad : f32 on cpu
  %lr = zopt.hyper lr
  %p1 = zopt.apply %p, %g, %lr : f32, f32
  // expected-error@+1 {{'zopt.yield' op unknown attribute 'rounding' ('zopt.yield' takes no attributes)}}
  zopt.yield %p1 into %p {rounding = "stochastic"} : f32 into f32
}

// -----

// The passes' own attributes are accepted (this is what zopt-plan prints):
// zopt.device, zopt.partitioned, zopt.max_norm, zopt.loss_scale on the step,
// zopt.slot on the states.
zopt.step @planned attributes {zero_stage = 2 : i64, zopt.device = #zopt<placement cpu>, zopt.loss_scale, zopt.max_norm = 1.000000e+00 : f64, zopt.partitioned = ["master", "grad"]} {
  %p = zopt.state param : f16 on cpu {zopt.slot = 0 : i64}
  %g = zopt.state grad : f16 on cpu {zopt.slot = 1 : i64}
  %w = zopt.state master : f32 on cpu {zopt.slot = 2 : i64}
  %lr = zopt.hyper lr
  %s = zopt.global grad_scale
  %st = arith.truncf %s : f64 to f32
  %ge = arith.extf %g : f16 to f32
  %gs = arith.mulf %ge, %st : f32
  zopt.reduce_sumsq %gs : f32
  %w1 = zopt.apply %w, %gs, %lr : f32, f32
  zopt.yield %w1, %w1 into %w, %p : f32, f32 into f32, f16
}
