zopt.step @adamw_bf16_sr attributes {gpu_arch = "sm_90"} {
  %p = zopt.state param : bf16 on gpu rounding stochastic
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
