// RUN: not zopt-compile %s -o %t.so 2>&1 | FileCheck %s
// Found by zopt-fuzz-description (ZOPT_FUZZ_STRICT=1): the verifier
// accepted a step whose update ignores the gradient; the canonicalizer then
// deleted the unused grad state and the step failed after the decompose
// phase with "declares no 'grad' state". Now a located error at the input.
// CHECK: unused-grad.mlir:[[@LINE+3]]:8: error: 'zopt.state' op the gradient never reaches a stored value: the update does not depend on it
zopt.step @s {
  %p = zopt.state param : f32 on cpu
  %g = zopt.state grad : f32 on cpu
  %lr = zopt.hyper lr
  %wd = zopt.hyper weight_decay
  %p1 = zopt.decoupled_decay %p, %lr, %wd : f32
  zopt.yield %p1 into %p : f32 into f32
}
