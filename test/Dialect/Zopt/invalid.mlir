// RUN: zopt-opt %s --split-input-file --verify-diagnostics
// Every rule of the zopt.step verifier, one case each; docs/Dialects/Zopt.md
// lists the rules and their reasons.

// ZeRO stage out of range.
// expected-error@+1 {{zero_stage must be 0, 1, 2 or 3 (got 4)}}
zopt.step @s attributes {zero_stage = 4 : i64} {
  %p = zopt.state param : f32 on cpu
  %g = zopt.state grad : f32 on cpu
  %lr = zopt.hyper lr
  %p1 = zopt.apply %p, %g, %lr : f32, f32
  zopt.yield %p1 into %p : f32 into f32
}

// -----

// Negative ZeRO stage.
// expected-error@+1 {{zero_stage must be 0, 1, 2 or 3 (got -1)}}
zopt.step @s attributes {zero_stage = -1 : i64} {
  %p = zopt.state param : f32 on cpu
  %g = zopt.state grad : f32 on cpu
  %lr = zopt.hyper lr
  %p1 = zopt.apply %p, %g, %lr : f32, f32
  zopt.yield %p1 into %p : f32 into f32
}

// -----

// Alignment not a power of two.
// expected-error@+1 {{align must be a power of two between 1 and 1048576 elements (got 24)}}
zopt.step @s attributes {align = 24 : i64} {
  %p = zopt.state param : f32 on cpu
  %g = zopt.state grad : f32 on cpu
  %lr = zopt.hyper lr
  %p1 = zopt.apply %p, %g, %lr : f32, f32
  zopt.yield %p1 into %p : f32 into f32
}

// -----

// Alignment zero.
// expected-error@+1 {{align must be a power of two between 1 and 1048576 elements (got 0)}}
zopt.step @s attributes {align = 0 : i64} {
  %p = zopt.state param : f32 on cpu
  %g = zopt.state grad : f32 on cpu
  %lr = zopt.hyper lr
  %p1 = zopt.apply %p, %g, %lr : f32, f32
  zopt.yield %p1 into %p : f32 into f32
}

// -----

// A gpu_arch that is not a CUDA architecture.
// expected-error@+1 {{gpu_arch must name a CUDA architecture sm_70 or newer}}
zopt.step @s attributes {gpu_arch = "gfx90a"} {
  %p = zopt.state param : f32 on cpu
  %g = zopt.state grad : f32 on cpu
  %lr = zopt.hyper lr
  %p1 = zopt.apply %p, %g, %lr : f32, f32
  zopt.yield %p1 into %p : f32 into f32
}

// -----

// A gpu_arch past every architecture LLVM knows (ptxas failed late on it).
// expected-error@+1 {{gpu_arch must name a CUDA architecture sm_70 or newer, like "sm_90" (got "sm_1000"; known: sm_70, sm_72, sm_75, sm_80, sm_86, sm_87, sm_89, sm_90)}}
zopt.step @s attributes {gpu_arch = "sm_1000"} {
  %p = zopt.state param : f32 on cpu
  %g = zopt.state grad : f32 on cpu
  %lr = zopt.hyper lr
  %p1 = zopt.apply %p, %g, %lr : f32, f32
  zopt.yield %p1 into %p : f32 into f32
}

// -----

// A GPU-placed state in a CPU-only compile (no gpu_arch).
zopt.step @s {
  // expected-error@+1 {{state 'param' is placed on gpu but the step has no gpu_arch (a CPU-only compile)}}
  %p = zopt.state param : f32 on gpu
  %g = zopt.state grad : f32 on cpu
  %lr = zopt.hyper lr
  %p1 = zopt.apply %p, %g, %lr : f32, f32
  zopt.yield %p1 into %p : f32 into f32
}

// -----

// A state declared twice.
zopt.step @s {
  %p = zopt.state param : f32 on cpu
  // expected-note@+1 {{first declared here}}
  %g = zopt.state grad : f32 on cpu
  %lr = zopt.hyper lr
  // expected-error@+1 {{duplicate 'grad' state; each kind is declared once per step}}
  %g2 = zopt.state grad : f32 on cpu
  %p1 = zopt.apply %p, %g, %lr : f32, f32
  zopt.yield %p1 into %p : f32 into f32
}

// -----

// No param state.
// expected-error@+1 {{declares no 'param' state}}
zopt.step @s {
  %g = zopt.state grad : f32 on cpu
  %w = zopt.state master : f32 on cpu
  %lr = zopt.hyper lr
  %w1 = zopt.apply %w, %g, %lr : f32, f32
  zopt.yield %w1 into %w : f32 into f32
}

// -----

// No grad state.
// expected-error@+1 {{declares no 'grad' state}}
zopt.step @s {
  %p = zopt.state param : f32 on cpu
  %lr = zopt.hyper lr
  %p1 = zopt.apply %p, %p, %lr : f32, f32
  zopt.yield %p1 into %p : f32 into f32
}

// -----

// A grad whose type differs from the param's.
zopt.step @s {
  %p = zopt.state param : f32 on cpu
  // expected-error@+1 {{grad is 'bf16' but param is 'f32'}}
  %g = zopt.state grad : bf16 on cpu
  %lr = zopt.hyper lr
  %p1 = zopt.apply %p, %g, %lr : f32, bf16
  zopt.yield %p1 into %p : f32 into f32
}

// -----

// A grad narrower than f32 of another type than the param's (f32 grads of a
// bf16/f16 param are DeepSpeed's accumulation layout and are accepted).
zopt.step @s {
  %p = zopt.state param : bf16 on cpu
  // expected-error@+1 {{grad is 'f16' but param is 'bf16'}}
  %g = zopt.state grad : f16 on cpu
  %lr = zopt.hyper lr
  %p1 = zopt.apply %p, %g, %lr : bf16, f16
  zopt.yield %p1 into %p : f32 into bf16
}

// -----

// fp16 gradients without a loss scale.
zopt.step @s {
  %p = zopt.state param : f16 on cpu
  // expected-error@+1 {{f16 gradients need loss scaling}}
  %g = zopt.state grad : f16 on cpu
  %w = zopt.state master : f32 on cpu
  %lr = zopt.hyper lr
  %w1 = zopt.apply %w, %g, %lr : f32, f16
  zopt.yield %w1, %w1 into %w, %p : f32, f32 into f32, f16
}

// -----

// A master of lower precision than the param.
zopt.step @s {
  %p = zopt.state param : f32 on cpu
  %g = zopt.state grad : f32 on cpu
  // expected-error@+1 {{master ('bf16') has lower precision than the param ('f32')}}
  %w = zopt.state master : bf16 on cpu
  %lr = zopt.hyper lr
  %w1 = zopt.apply %w, %g, %lr : bf16, f32
  zopt.yield %w1, %w1 into %w, %p : f32, f32 into bf16, f32
}

// -----

// A bf16 master for f16 params (fewer mantissa bits).
zopt.step @s {
  %p = zopt.state param : f16 on cpu
  %g = zopt.state grad : f16 on cpu
  // expected-error@+1 {{has lower precision than the param}}
  %w = zopt.state master : bf16 on cpu
  %lr = zopt.hyper lr
  %gs = zopt.unscale %g : f16
  %w1 = zopt.apply %w, %gs, %lr : bf16, f32
  zopt.yield %w1, %w1 into %w, %p : f32, f32 into bf16, f16
}

// -----

// An f16 master.
zopt.step @s {
  %p = zopt.state param : f16 on cpu
  %g = zopt.state grad : f16 on cpu
  // expected-error@+1 {{master must be f32 or bf16}}
  %w = zopt.state master : f16 on cpu
  %lr = zopt.hyper lr
  %gs = zopt.unscale %g : f16
  %w1 = zopt.apply %w, %gs, %lr : f16, f32
  zopt.yield %w1, %w1 into %w, %p : f32, f32 into f16, f16
}

// -----

// A master that duplicates the param on the same placement.
zopt.step @s {
  %p = zopt.state param : f32 on cpu
  %g = zopt.state grad : f32 on cpu
  // expected-error@+1 {{master duplicates the 'f32' param on the same placement}}
  %w = zopt.state master : f32 on cpu
  %lr = zopt.hyper lr
  %w1 = zopt.apply %w, %g, %lr : f32, f32
  zopt.yield %w1, %w1 into %w, %p : f32, f32 into f32, f32
}

// -----

// exp_avg_sq in f16.
zopt.step @s {
  %p = zopt.state param : f32 on cpu
  %g = zopt.state grad : f32 on cpu
  %lr = zopt.hyper lr
  // expected-error@+1 {{'exp_avg_sq' cannot be f16}}
  %v = zopt.state exp_avg_sq : f16 on cpu
  %b2 = zopt.hyper beta2
  %v1 = zopt.ema_sq %v, %g, %b2 : f16, f32
  %p1 = zopt.apply %p, %g, %lr : f32, f32
  zopt.yield %p1, %v1 into %p, %v : f32, f32 into f32, f16
}

// -----

// amsgrad's max_exp_avg_sq without exp_avg_sq.
zopt.step @s {
  %p = zopt.state param : f32 on cpu
  %g = zopt.state grad : f32 on cpu
  %lr = zopt.hyper lr
  // expected-error@+1 {{'max_exp_avg_sq' (amsgrad) needs an 'exp_avg_sq' state}}
  %vm = zopt.state max_exp_avg_sq : f32 on cpu
  %vm1 = zopt.max %vm, %g : f32, f32
  %p1 = zopt.apply %p, %vm1, %lr : f32, f32
  zopt.yield %p1, %vm1 into %p, %vm : f32, f32 into f32, f32
}

// -----

// Optimizer states on different placements.
zopt.step @s attributes {gpu_arch = "sm_90"} {
  %p = zopt.state param : f32 on cpu
  %g = zopt.state grad : f32 on cpu
  %lr = zopt.hyper lr
  %m = zopt.state exp_avg : f32 on cpu
  // expected-error@+1 {{'exp_avg_sq' is on gpu but 'exp_avg' on cpu: the fused update runs where the optimizer states live}}
  %v = zopt.state exp_avg_sq : f32 on gpu
  %b1 = zopt.hyper beta1
  %m1 = zopt.ema %m, %g, %b1 : f32, f32
  %v1 = zopt.ema_sq %v, %g, %b1 : f32, f32
  %p1 = zopt.apply %p, %m1, %lr : f32, f32
  zopt.yield %p1, %m1, %v1 into %p, %m, %v : f32, f32, f32 into f32, f32, f32
}

// -----

// A state that is not a float type.
zopt.step @s {
  // expected-error@+1 {{state 'param' has type 'i32'; states are stored as f32, bf16 or f16}}
  %p = zopt.state param : i32 on cpu
}

// -----

// An f64 state.
zopt.step @s {
  %p = zopt.state param : f32 on cpu
  %g = zopt.state grad : f32 on cpu
  %lr = zopt.hyper lr
  // expected-error@+1 {{state 'exp_avg' has type 'f64'}}
  %m = zopt.state exp_avg : f64 on cpu
}

// -----

// Rounding on an f32 state, which never narrows.
zopt.step @s {
  %p = zopt.state param : f32 on cpu
  %g = zopt.state grad : f32 on cpu
  %lr = zopt.hyper lr
  // expected-error@+1 {{rounding applies to narrowing stores; state 'exp_avg' is f32}}
  %m = zopt.state exp_avg : f32 on cpu rounding stochastic
}

// -----

// Stochastic rounding on a state that is never written: the gradient.
zopt.step @s {
  %p = zopt.state param : bf16 on cpu
  // expected-error@+2 {{rounding applies to stores, and 'grad' is never stored: drop 'rounding'}}
  // expected-note@+1 {{the gradient is read-only (it belongs to the user)}}
  %g = zopt.state grad : bf16 on cpu rounding stochastic
  %lr = zopt.hyper lr
  %p1 = zopt.apply %p, %g, %lr : bf16, bf16
  zopt.yield %p1 into %p : f32 into bf16
}

// -----

// Any rounding on the gradient, nearest_even included (it is never stored).
zopt.step @s {
  %p = zopt.state param : f16 on cpu
  // expected-error@+2 {{rounding applies to stores, and 'grad' is never stored}}
  // expected-note@+1 {{the gradient is read-only}}
  %g = zopt.state grad : f16 on cpu rounding nearest_even
}

// -----

// Stochastic rounding on an f16 state (bf16 only), refused by the verifier
// rather than late in the fuse phase.
zopt.step @s {
  %p = zopt.state param : bf16 on cpu
  %g = zopt.state grad : bf16 on cpu
  %w = zopt.state master : f32 on cpu
  // expected-error@+2 {{stochastic rounding is implemented for bf16 states; this state is 'f16' (use nearest_even)}}
  // expected-note@+1 {{store the state as bf16 to round it stochastically}}
  %m = zopt.state exp_avg : f16 on cpu rounding stochastic
}

// -----

// A clip whose result is never used: clipping would have no effect.
zopt.step @s {
  %p = zopt.state param : f32 on cpu
  %g = zopt.state grad : f32 on cpu
  %lr = zopt.hyper lr
  // expected-error@+1 {{'zopt.clip_by_global_norm' op the clipped gradient is never used: clipping would have no effect}}
  %gc = zopt.clip_by_global_norm %g max 1.0 : f32
  %p1 = zopt.apply %p, %g, %lr : f32, f32
  zopt.yield %p1 into %p : f32 into f32
}

// -----

// A clip used only by a value that is never stored has no effect either.
zopt.step @s {
  %p = zopt.state param : f32 on cpu
  %g = zopt.state grad : f32 on cpu
  %lr = zopt.hyper lr
  // expected-error@+1 {{the clipped gradient is never used by a stored value: clipping would have no effect}}
  %gc = zopt.clip_by_global_norm %g max 1.0 : f32
  %dead = zopt.apply %p, %gc, %lr : f32, f32
  %p1 = zopt.apply %p, %g, %lr : f32, f32
  zopt.yield %p1 into %p : f32 into f32
}

// -----

// An unused unscale: the loss-scaled gradient would be applied as is.
zopt.step @s {
  %p = zopt.state param : f16 on cpu
  %g = zopt.state grad : f16 on cpu
  %w = zopt.state master : f32 on cpu
  %lr = zopt.hyper lr
  // expected-error@+1 {{'zopt.unscale' op the unscaled gradient is never used: loss scaling would have no effect}}
  %gs = zopt.unscale %g : f16
  %w1 = zopt.apply %w, %g, %lr : f32, f16
  zopt.yield %w1, %w1 into %w, %p : f32, f32 into f32, f16
}

// -----

// Unknown hyperparameter name.
zopt.step @s {
  %p = zopt.state param : f32 on cpu
  %g = zopt.state grad : f32 on cpu
  %lr = zopt.hyper lr
  // expected-error@+3 {{failed to parse Zopt_HyperKindAttr}}
  // expected-error@+1 {{expected ::mlir::zopt::HyperKind to be one of: lr, beta1, beta2, eps, weight_decay, momentum, dampening, bias_correction}}
  %x = zopt.hyper learning_rate
}

// -----

// A hyperparameter default out of range (beta1 must be < 1).
zopt.step @s {
  %p = zopt.state param : f32 on cpu
  %g = zopt.state grad : f32 on cpu
  %lr = zopt.hyper lr
  // expected-error@+1 {{default beta1 = 1 is out of range [0, 1)}}
  %b1 = zopt.hyper beta1 default 1.0
}

// -----

// A negative learning-rate default.
zopt.step @s {
  %p = zopt.state param : f32 on cpu
  %g = zopt.state grad : f32 on cpu
  // expected-error@+1 {{default lr = -0.1 is out of range [0, inf]}}
  %lr = zopt.hyper lr default -0.1
}

// -----

// Conflicting defaults for one hyperparameter. (A declaration without a
// default defers to another one in the IR, as the decompose phase's
// `zopt.hyper bias_correction` does; a description must agree exactly:
// test/zopt-compile/description.test.)
zopt.step @s {
  %p = zopt.state param : f32 on cpu
  %g = zopt.state grad : f32 on cpu
  %lr = zopt.hyper lr default 0.1
  %lr0 = zopt.hyper lr
  // expected-error@+1 {{conflicting defaults for hyperparameter 'lr'}}
  %lr2 = zopt.hyper lr default 0.5
  %p1 = zopt.apply %p, %g, %lr2 : f32, f32
  zopt.yield %p1 into %p : f32 into f32
}

// -----

// Clipping with a non-positive max_norm.
zopt.step @s {
  %p = zopt.state param : f32 on cpu
  %g = zopt.state grad : f32 on cpu
  %lr = zopt.hyper lr
  // expected-error@+1 {{max_norm must be a positive finite number, got 0}}
  %gc = zopt.clip_by_global_norm %g max 0.0 : f32
  %p1 = zopt.apply %p, %gc, %lr : f32, f32
  zopt.yield %p1 into %p : f32 into f32
}

// -----

// Two global-norm clips in one step.
zopt.step @s {
  %p = zopt.state param : f32 on cpu
  %g = zopt.state grad : f32 on cpu
  %lr = zopt.hyper lr
  // expected-note@+1 {{first clip here}}
  %gc = zopt.clip_by_global_norm %g max 1.0 : f32
  // expected-error@+1 {{the step already clips by the global norm; one global norm per step}}
  %gc2 = zopt.clip_by_global_norm %gc max 2.0 : f32
  %p1 = zopt.apply %p, %gc2, %lr : f32, f32
  zopt.yield %p1 into %p : f32 into f32
}

// -----

// Unscaling something that is not the gradient.
zopt.step @s {
  %p = zopt.state param : f32 on cpu
  %g = zopt.state grad : f32 on cpu
  %lr = zopt.hyper lr
  // expected-error@+1 {{its operand must be the 'grad' state}}
  %ps = zopt.unscale %p : f32
  %p1 = zopt.apply %p, %ps, %lr : f32, f32
  zopt.yield %p1 into %p : f32 into f32
}

// -----

// Unscaling twice.
zopt.step @s {
  %p = zopt.state param : f32 on cpu
  %g = zopt.state grad : f32 on cpu
  %lr = zopt.hyper lr
  %g1 = zopt.unscale %g : f32
  // expected-error@+1 {{the step already unscales the gradient}}
  %g2 = zopt.unscale %g : f32
  %p1 = zopt.apply %p, %g1, %lr : f32, f32
  zopt.yield %p1 into %p : f32 into f32
}

// -----

// zopt.adam with exp_avg and exp_avg_sq swapped.
zopt.step @s {
  %p = zopt.state param : f32 on cpu
  %g = zopt.state grad : f32 on cpu
  %lr = zopt.hyper lr
  %m = zopt.state exp_avg : f32 on cpu
  %v = zopt.state exp_avg_sq : f32 on cpu
  %b1 = zopt.hyper beta1
  %b2 = zopt.hyper beta2
  %eps = zopt.hyper eps
  %wd = zopt.hyper weight_decay
  // expected-error@+1 {{third operand must be the 'exp_avg' state}}
  %p1, %m1, %v1 = zopt.adam %p, %g, %v, %m, %lr, %b1, %b2, %eps, %wd : f32, f32, f32, f32
  zopt.yield %p1, %m1, %v1 into %p, %m, %v : f32, f32, f32 into f32, f32, f32
}

// -----

// More values than states in the yield.
zopt.step @s {
  %p = zopt.state param : f32 on cpu
  %g = zopt.state grad : f32 on cpu
  %lr = zopt.hyper lr
  %p1 = zopt.apply %p, %g, %lr : f32, f32
  // expected-error@+1 {{yields 2 values into 1 states}}
  zopt.yield %p1, %p1 into %p : f32, f32 into f32
}

// -----

// Storing into something that is not a state.
zopt.step @s {
  %p = zopt.state param : f32 on cpu
  %g = zopt.state grad : f32 on cpu
  %lr = zopt.hyper lr
  %p1 = zopt.apply %p, %g, %lr : f32, f32
  // expected-error@+1 {{target #1 is not a zopt.state}}
  zopt.yield %p1, %p1 into %p, %p1 : f32, f32 into f32, f32
}

// -----

// Writing the gradient.
zopt.step @s {
  %p = zopt.state param : f32 on cpu
  %g = zopt.state grad : f32 on cpu
  %lr = zopt.hyper lr
  %p1 = zopt.apply %p, %g, %lr : f32, f32
  // expected-error@+1 {{stores into 'grad', which is read-only}}
  zopt.yield %p1, %p1 into %p, %g : f32, f32 into f32, f32
}

// -----

// Writing a state twice.
zopt.step @s {
  %p = zopt.state param : f32 on cpu
  %g = zopt.state grad : f32 on cpu
  %lr = zopt.hyper lr
  %p1 = zopt.apply %p, %g, %lr : f32, f32
  // expected-error@+1 {{stores into 'param' twice}}
  zopt.yield %p1, %p1 into %p, %p : f32, f32 into f32, f32
}

// -----

// An optimizer state that is never written.
zopt.step @s {
  %p = zopt.state param : f32 on cpu
  %g = zopt.state grad : f32 on cpu
  %lr = zopt.hyper lr
  // expected-error@+1 {{state 'exp_avg' is never written}}
  %m = zopt.state exp_avg : f32 on cpu
  %p1 = zopt.apply %p, %g, %lr : f32, f32
  zopt.yield %p1 into %p : f32 into f32
}

// -----

// A gradient that no stored value depends on (found by the fuzzer: the
// canonicalizer then deleted the unused grad and the step failed after the
// decompose phase with "declares no 'grad' state").
zopt.step @s {
  %p = zopt.state param : f32 on cpu
  // expected-error@+1 {{'zopt.state' op the gradient never reaches a stored value: the update does not depend on it}}
  %g = zopt.state grad : f32 on cpu
  %lr = zopt.hyper lr
  %wd = zopt.hyper weight_decay
  %p1 = zopt.decoupled_decay %p, %lr, %wd : f32
  zopt.yield %p1 into %p : f32 into f32
}

// -----

// A param that is never updated.
zopt.step @s {
  // expected-error@+1 {{state 'param' is never written}}
  %p = zopt.state param : f32 on cpu
  %g = zopt.state grad : f32 on cpu
  %m = zopt.state exp_avg : f32 on cpu
  %b1 = zopt.hyper beta1
  %m1 = zopt.ema %m, %g, %b1 : f32, f32
  zopt.yield %m1 into %m : f32 into f32
}

// -----

// With a master, the param must be the rounded master.
zopt.step @s {
  %p = zopt.state param : bf16 on cpu
  %g = zopt.state grad : bf16 on cpu
  %w = zopt.state master : f32 on cpu
  %lr = zopt.hyper lr
  %w1 = zopt.apply %w, %g, %lr : f32, bf16
  %p1 = zopt.apply %p, %g, %lr : bf16, bf16
  // expected-error@+1 {{with a master, the param is the rounded master}}
  zopt.yield %w1, %p1 into %w, %p : f32, f32 into f32, bf16
}

// -----

// Storing an integer.
zopt.step @s {
  %p = zopt.state param : f32 on cpu
  %g = zopt.state grad : f32 on cpu
  %lr = zopt.hyper lr
  %i = arith.constant 1 : i32
  // expected-error@+1 {{value #1 has type 'i32'; only f32, bf16 or f16 can be stored}}
  zopt.yield %g, %i into %p, %p : f32, i32 into f32, f32
}

// -----

// A primitive over an f64 element.
zopt.step @s {
  %p = zopt.state param : f32 on cpu
  %g = zopt.state grad : f32 on cpu
  %lr = zopt.hyper lr
  %x = arith.constant 1.0 : f64
  // expected-error@+1 {{operand #0 must be f32, bf16 or f16}}
  %y = zopt.sign %x : f64
}

// -----

// zopt.state outside of a zopt.step.
func.func @f() {
  // expected-error@+1 {{expects parent op 'zopt.step'}}
  %p = zopt.state param : f32 on cpu
  return
}

// -----

// Unknown placement.
zopt.step @s {
  // expected-error@+3 {{failed to parse Zopt_PlacementAttr}}
  // expected-error@+1 {{expected ::mlir::zopt::Placement to be one of: cpu, gpu}}
  %p = zopt.state param : f32 on nvme
}

// -----

// ZeRO-3 with GPU params and CPU optimizer states (offload) is refused.
// expected-error@+1 {{zero_stage 3 with the params on the GPU and the optimizer states on the CPU}}
zopt.step @s attributes {zero_stage = 3 : i64, gpu_arch = "sm_90"} {
  %p = zopt.state param : bf16 on gpu
  %g = zopt.state grad : bf16 on gpu
  %w = zopt.state master : f32 on cpu
  %lr = zopt.hyper lr
  %w1 = zopt.apply %w, %g, %lr : f32, bf16
  zopt.yield %w1, %w1 into %w, %p : f32, f32 into f32, bf16
}

// -----

// A loss-scaled gradient is read through zopt.unscale only.
zopt.step @s {
  %p = zopt.state param : f16 on cpu
  %g = zopt.state grad : f16 on cpu
  %w = zopt.state master : f32 on cpu
  %m = zopt.state exp_avg : f32 on cpu
  %lr = zopt.hyper lr
  %b1 = zopt.hyper beta1
  // expected-note@+1 {{zopt.unscale here) instead}}
  %gs = zopt.unscale %g : f16
  // expected-error@+1 {{reads the loss-scaled gradient directly; read the unscaled value}}
  %m1 = zopt.ema %m, %g, %b1 : f32, f16
  %w1 = zopt.apply %w, %gs, %lr : f32, f32
  %w2 = zopt.apply %w1, %m1, %lr : f32, f32
  zopt.yield %w2, %m1, %w2 into %w, %m, %p : f32, f32, f32 into f32, f32, f16
}
