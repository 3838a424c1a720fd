// RUN: not zopt-compile %s -o %t.so 2>&1 | FileCheck %s
// RUN: sed -e 's/ default 0.0//' %s > %t.nodefault.mlir
// RUN: zopt-compile %t.nodefault.mlir -o %t.so 2>&1 | count 0
// Found by zopt-fuzz-step (ZOPT_FUZZ_STRICT=1). A description that gives
// bias_correction a default (here 0: no bias correction unless a group sets
// it) and uses Adam's direction verified, then failed after decompose with
// "conflicting defaults for hyperparameter 'bias_correction'": the decompose
// phase declares the slot again, without a default. The IR verifier now
// lets a declaration without a default defer to the others, but the
// description's declaration, used by no operand, is then deleted with its
// default, which silently became 1. Refused until the decompose phase keeps
// the description's declaration; without the default it compiles, with no
// warning (Adam's direction does read the slot).
// CHECK: bias-correction-default.mlir:[[@LINE+10]]:9: error: 'zopt.hyper' op the default of 'bias_correction' would be lost
zopt.step @adam_no_bc {
  %p = zopt.state param : f32 on cpu
  %g = zopt.state grad : f32 on cpu
  %m = zopt.state exp_avg : f32 on cpu
  %v = zopt.state exp_avg_sq : f32 on cpu
  %lr = zopt.hyper lr
  %b1 = zopt.hyper beta1
  %b2 = zopt.hyper beta2
  %eps = zopt.hyper eps
  %bc = zopt.hyper bias_correction default 0.0
  %m1 = zopt.ema %m, %g, %b1 : f32, f32
  %v1 = zopt.ema_sq %v, %g, %b2 : f32, f32
  %u = zopt.adam_direction %m1, %v1, %b1, %b2, %eps : f32, f32
  %p1 = zopt.apply %p, %u, %lr : f32, f32
  zopt.yield %p1, %m1, %v1 into %p, %m, %v : f32, f32, f32 into f32, f32, f32
}
