// RUN: zopt-opt %s --split-input-file --verify-diagnostics
// RUN: zopt-opt %examples/adam_amsgrad_f32.mlir -o /dev/null
// RUN: zopt-opt %examples/adam_f16_loss_scale.mlir -o /dev/null
// RUN: zopt-opt %examples/adamw_bf16_gpu.mlir -o /dev/null
// RUN: zopt-opt %examples/adamw_bf16_master.mlir -o /dev/null
// RUN: zopt-opt %examples/adamw_bf16_zero2.mlir -o /dev/null
// RUN: zopt-opt %examples/adamw_f32.mlir -o /dev/null
// RUN: zopt-opt %examples/lion_bf16.mlir -o /dev/null
// RUN: zopt-opt %examples/sgd_nesterov_f32.mlir -o /dev/null
// RUN: zopt-opt %examples/adamw_f32.mlir --zopt-pipeline="compile-to=plan" -o /dev/null
// RUN: zopt-opt %examples/lion_bf16.mlir --zopt-pipeline="compile-to=plan" -o /dev/null
//
// The role rule (docs/Dialects/Zopt.md, "Roles"): a value stored into state
// S is an update of S, traced through each op's tied operand. The examples
// above (and, after decompose and plan, their arith form) are accepted; the
// cases below are the mistakes it refuses, then descriptions it accepts.

// The brief's case: the moments of zopt.adam stored into each other's state.
zopt.step @swapped_adam {
  %p = zopt.state param : f32 on cpu
  %g = zopt.state grad : f32 on cpu
  %m = zopt.state exp_avg : f32 on cpu
  %v = zopt.state exp_avg_sq : f32 on cpu
  %lr = zopt.hyper lr
  %b1 = zopt.hyper beta1
  %b2 = zopt.hyper beta2
  %eps = zopt.hyper eps
  %wd = zopt.hyper weight_decay
  // expected-note@+1 {{value #1 is computed here: 'zopt.adam' returns the new param, exp_avg and exp_avg_sq, in that order}}
  %p1, %m1, %v1 = zopt.adam %p, %g, %m, %v, %lr, %b1, %b2, %eps, %wd {decoupled} : f32, f32, f32, f32
  // expected-error@+1 {{value #1 stored into 'exp_avg_sq' is not an update of 'exp_avg_sq': it is an update of 'exp_avg'; did you swap the values stored into 'exp_avg_sq' and 'exp_avg'?}}
  zopt.yield %p1, %m1, %v1 into %p, %v, %m : f32, f32, f32 into f32, f32, f32
}

// -----

// The same with primitives: ema updates its first operand.
zopt.step @swapped_primitives {
  %p = zopt.state param : f32 on cpu
  %g = zopt.state grad : f32 on cpu
  %m = zopt.state exp_avg : f32 on cpu
  %v = zopt.state exp_avg_sq : f32 on cpu
  %lr = zopt.hyper lr
  %b1 = zopt.hyper beta1
  %b2 = zopt.hyper beta2
  %eps = zopt.hyper eps
  %m1 = zopt.ema %m, %g, %b1 : f32, f32
  // expected-note@+1 {{value #1 is computed here: 'zopt.ema_sq' updates its first operand, the running average}}
  %v1 = zopt.ema_sq %v, %g, %b2 : f32, f32
  %u = zopt.adam_direction %m1, %v1, %b1, %b2, %eps : f32, f32
  %p1 = zopt.apply %p, %u, %lr : f32, f32
  // expected-error@+1 {{value #1 stored into 'exp_avg' is not an update of 'exp_avg': it is an update of 'exp_avg_sq'; did you swap}}
  zopt.yield %p1, %v1, %m1 into %p, %m, %v : f32, f32, f32 into f32, f32, f32
}

// -----

// A moment stored into the param (no master).
zopt.step @moment_into_param {
  %p = zopt.state param : f32 on cpu
  %g = zopt.state grad : f32 on cpu
  %m = zopt.state exp_avg : f32 on cpu
  %lr = zopt.hyper lr
  %b1 = zopt.hyper beta1
  // expected-note@+1 {{value #0 is computed here: 'zopt.ema' updates its first operand}}
  %m1 = zopt.ema %m, %g, %b1 : f32, f32
  %p1 = zopt.apply %p, %m1, %lr : f32, f32
  // expected-error@+1 {{value #0 stored into 'param' is not an update of 'param': it is an update of 'exp_avg'}}
  zopt.yield %m1, %m1 into %p, %m : f32, f32 into f32, f32
}

// -----

// Operands of zopt.ema in the wrong order: the result averages the moment
// into the gradient, an update of no state.
zopt.step @ema_operands_swapped {
  %p = zopt.state param : f32 on cpu
  %g = zopt.state grad : f32 on cpu
  %m = zopt.state exp_avg : f32 on cpu
  %lr = zopt.hyper lr
  %b1 = zopt.hyper beta1
  // expected-note@+1 {{value #1 is computed here: 'zopt.ema' updates its first operand, the running average}}
  %m1 = zopt.ema %g, %m, %b1 : f32, f32
  %p1 = zopt.apply %p, %m1, %lr : f32, f32
  // expected-error@+1 {{value #1 stored into 'exp_avg' is not an update of 'exp_avg': it is derived from the gradient only (a gradient is never stored)}}
  zopt.yield %p1, %m1 into %p, %m : f32, f32 into f32, f32
}

// -----

// An update direction stored as the param: it is not the param's new value.
zopt.step @direction_into_param {
  %p = zopt.state param : f32 on cpu
  %g = zopt.state grad : f32 on cpu
  %m = zopt.state exp_avg : f32 on cpu
  %b1 = zopt.hyper beta1
  %m1 = zopt.ema %m, %g, %b1 : f32, f32
  // expected-note@+1 {{value #0 is computed here: 'zopt.sign' computes an update direction: apply it to a state with zopt.apply}}
  %s = zopt.sign %m1 : f32
  // expected-error@+1 {{value #0 stored into 'param' is not an update of 'param': it is not an update of any state}}
  zopt.yield %s, %m1 into %p, %m : f32, f32 into f32, f32
}

// -----

// The Nesterov direction stored as the momentum buffer.
zopt.step @nesterov_into_buffer {
  %p = zopt.state param : f32 on cpu
  %g = zopt.state grad : f32 on cpu
  %buf = zopt.state momentum_buffer : f32 on cpu
  %lr = zopt.hyper lr
  %mu = zopt.hyper momentum
  %damp = zopt.hyper dampening
  %b1 = zopt.momentum %buf, %g, %mu, %damp : f32, f32
  // expected-note@+1 {{value #1 is computed here: 'zopt.nesterov' computes a gradient from its first operand}}
  %d = zopt.nesterov %g, %b1, %mu : f32, f32
  %p1 = zopt.apply %p, %d, %lr : f32, f32
  // expected-error@+1 {{value #1 stored into 'momentum_buffer' is not an update of 'momentum_buffer': it is derived from the gradient only}}
  zopt.yield %p1, %d into %p, %buf : f32, f32 into f32, f32
}

// -----

// amsgrad: zopt.max updates its first operand, the running maximum.
zopt.step @max_operands_swapped {
  %p = zopt.state param : f32 on cpu
  %g = zopt.state grad : f32 on cpu
  %m = zopt.state exp_avg : f32 on cpu
  %v = zopt.state exp_avg_sq : f32 on cpu
  %vm = zopt.state max_exp_avg_sq : f32 on cpu
  %lr = zopt.hyper lr
  %b1 = zopt.hyper beta1
  %b2 = zopt.hyper beta2
  %eps = zopt.hyper eps
  %m1 = zopt.ema %m, %g, %b1 : f32, f32
  %v1 = zopt.ema_sq %v, %g, %b2 : f32, f32
  // expected-note@+1 {{value #3 is computed here: 'zopt.max' updates its first operand, the running maximum}}
  %vm1 = zopt.max %v1, %vm : f32, f32
  %u = zopt.adam_direction %m1, %vm1, %b1, %b2, %eps : f32, f32
  %p1 = zopt.apply %p, %u, %lr : f32, f32
  // expected-error@+1 {{value #3 stored into 'max_exp_avg_sq' is not an update of 'max_exp_avg_sq': it is an update of 'exp_avg_sq'}}
  zopt.yield %p1, %m1, %v1, %vm1 into %p, %m, %v, %vm : f32, f32, f32, f32 into f32, f32, f32, f32
}

// -----

// With a master: a moment stored into the master (and the param).
zopt.step @moment_into_master {
  %p = zopt.state param : bf16 on cpu
  %g = zopt.state grad : bf16 on cpu
  %w = zopt.state master : f32 on cpu
  %m = zopt.state exp_avg : f32 on cpu
  %lr = zopt.hyper lr
  %b1 = zopt.hyper beta1
  // expected-note@+1 {{value #0 is computed here}}
  %m1 = zopt.ema %m, %g, %b1 : f32, bf16
  %w1 = zopt.apply %w, %m1, %lr : f32, f32
  // expected-error@+1 {{value #0 stored into 'master' is not an update of 'master': it is an update of 'exp_avg'}}
  zopt.yield %m1, %m1, %m1 into %w, %m, %p : f32, f32, f32 into f32, f32, bf16
}

// -----

// A state stored back unchanged.
zopt.step @unchanged {
  %p = zopt.state param : f32 on cpu
  %g = zopt.state grad : f32 on cpu
  %m = zopt.state exp_avg : f32 on cpu
  %lr = zopt.hyper lr
  %p1 = zopt.apply %p, %g, %lr : f32, f32
  // expected-error@+1 {{stores 'exp_avg' back unchanged (value #1): yield its new value}}
  zopt.yield %p1, %m into %p, %m : f32, f32 into f32, f32
}

// -----

// Accepted: the master may be updated from the param (the master is the
// param's precise copy) and the param receives the master's new value.
zopt.step @master_from_param {
  %p = zopt.state param : bf16 on cpu
  %g = zopt.state grad : bf16 on cpu
  %w = zopt.state master : f32 on cpu
  %lr = zopt.hyper lr
  %w1 = zopt.apply %p, %g, %lr : bf16, bf16
  zopt.yield %w1, %w1 into %w, %p : f32, f32 into f32, bf16
}

// -----

// Accepted: Lion reads the moment twice (an interpolation for the direction,
// then the update stored back); the direction goes through zopt.apply.
zopt.step @lion {
  %p = zopt.state param : f32 on cpu
  %g = zopt.state grad : f32 on cpu
  %m = zopt.state exp_avg : bf16 on cpu
  %lr = zopt.hyper lr
  %b1 = zopt.hyper beta1
  %b2 = zopt.hyper beta2
  %wd = zopt.hyper weight_decay
  %c = zopt.ema %m, %g, %b1 : bf16, f32
  %s = zopt.sign %c : f32
  %p0 = zopt.decoupled_decay %p, %lr, %wd : f32
  %p1 = zopt.apply %p0, %s, %lr : f32, f32
  %m1 = zopt.ema %m, %g, %b2 : bf16, f32
  zopt.yield %p1, %m1 into %p, %m : f32, f32 into f32, bf16
}

// -----

// Accepted: after the decompose phase values are arith ops, which are an
// update of every state their operands are (casts included).
zopt.step @decomposed {
  %p = zopt.state param : bf16 on cpu
  %g = zopt.state grad : bf16 on cpu
  %m = zopt.state exp_avg : f32 on cpu
  %c = arith.constant 0.5 : f32
  %ge = arith.extf %g : bf16 to f32
  %a = arith.mulf %m, %c : f32
  %b = arith.mulf %ge, %c : f32
  %m1 = arith.addf %a, %b : f32
  %pe = arith.extf %p : bf16 to f32
  %p1 = arith.subf %pe, %m1 : f32
  zopt.yield %p1, %m1 into %p, %m : f32, f32 into bf16, f32
}
