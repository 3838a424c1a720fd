zopt.step @g attributes {gpu_arch = "sm_90"} {
  %p = zopt.state param : f32 on gpu
  %g = zopt.state grad : f32 on gpu
  %lr = zopt.hyper lr
  %p1 = zopt.apply %p, %g, %lr : f32, f32
  zopt.yield %p1 into %p : f32 into f32
}
