// bf16 params/grads and bf16 moments, no master, on the GPU; no clipping.
zopt.step @adamw_bf16_pure_gpu attributes {zero_stage = 0 : i64, align = 16 : i64, gpu_arch = "sm_90"} {
  %p = zopt.state param : bf16 on gpu
  %g = zopt.state grad : bf16 on gpu
  %m = zopt.state exp_avg : bf16 on gpu
  %v = zopt.state exp_avg_sq : bf16 on gpu
  %lr = zopt.hyper lr
  %b1 = zopt.hyper beta1
  %b2 = zopt.hyper beta2
  %eps = zopt.hyper eps
  %wd = zopt.hyper weight_decay
  %p1, %m1, %v1 = zopt.adam %p, %g, %m, %v, %lr, %b1, %b2, %eps, %wd {decoupled} : bf16, bf16, bf16, bf16
  zopt.yield %p1, %m1, %v1 into %p, %m, %v : f32, f32, f32 into bf16, bf16, bf16
}
