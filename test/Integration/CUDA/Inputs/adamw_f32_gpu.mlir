// f32 params/grads/moments on the GPU, no clipping (no SUMSQ kernel).
zopt.step @adamw_f32_gpu attributes {zero_stage = 0 : i64, align = 16 : i64, gpu_arch = "sm_90"} {
  %p = zopt.state param : f32 on gpu
  %g = zopt.state grad : f32 on gpu
  %m = zopt.state exp_avg : f32 on gpu
  %v = zopt.state exp_avg_sq : f32 on gpu
  %lr = zopt.hyper lr
  %b1 = zopt.hyper beta1
  %b2 = zopt.hyper beta2
  %eps = zopt.hyper eps
  %wd = zopt.hyper weight_decay
  %p1, %m1, %v1 = zopt.adam %p, %g, %m, %v, %lr, %b1, %b2, %eps, %wd {decoupled} : f32, f32, f32, f32
  zopt.yield %p1, %m1, %v1 into %p, %m, %v : f32, f32, f32 into f32, f32, f32
}
