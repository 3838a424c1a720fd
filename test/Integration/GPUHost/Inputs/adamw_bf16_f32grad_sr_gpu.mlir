// Pure bf16 with f32 gradients on the GPU: bf16 params and moments, every
// bf16 store rounded stochastically, f32 gradients (accumulated in f32), no
// master (test/zopt-compile/Inputs/stochastic-gpu.mlir with f32 grads).
zopt.step @adamw_bf16_f32grad_sr attributes {gpu_arch = "sm_90"} {
  %p = zopt.state param : bf16 on gpu rounding stochastic
  %g = zopt.state grad : f32 on gpu
  %m = zopt.state exp_avg : bf16 on gpu rounding stochastic
  %v = zopt.state exp_avg_sq : bf16 on gpu rounding stochastic
  %lr = zopt.hyper lr
  %b1 = zopt.hyper beta1
  %b2 = zopt.hyper beta2
  %eps = zopt.hyper eps
  %wd = zopt.hyper weight_decay
  %p1, %m1, %v1 = zopt.adam %p, %g, %m, %v, %lr, %b1, %b2, %eps, %wd {decoupled} : bf16, f32, bf16, bf16
  zopt.yield %p1, %m1, %v1 into %p, %m, %v : f32, f32, f32 into bf16, bf16, bf16
}
