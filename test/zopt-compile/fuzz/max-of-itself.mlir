// RUN: not zopt-compile %s -o %t.so 2>&1 | FileCheck %s
// Found by zopt-fuzz-step (ZOPT_FUZZ_STRICT=1): zopt.max of a value with
// itself verified; the canonicalizer folded it to the state itself and the
// step failed after decompose ("stores 'param' back unchanged"). Now a
// located error at the input.
// CHECK: max-of-itself.mlir:[[@LINE+6]]:9: error: 'zopt.max' op takes the maximum of a value with itself, which is that value
zopt.step @fuzz attributes {gpu_arch = "sm_80"} {
  %param = zopt.state param : f32 on gpu
  %grad = zopt.state grad : f32 on gpu
  %momentum_buffer = zopt.state momentum_buffer : f32 on cpu
  %lr = zopt.hyper lr default 9.000000e-01
  %v0 = zopt.max %param, %param : f32, f32
  %v1 = zopt.momentum %momentum_buffer, %grad, %lr, %lr : f32, f32
  zopt.yield %v0, %v1 into %param, %momentum_buffer : f32, f32 into f32, f32
}
