// AdamW with a Kahan-compensated bf16 param on the GPU (examples/adamw_bf16_kahan.mlir
// with every state on the GPU): the GPU UPDATE kernel's Kahan store through the
// shared BodyEmitter.
zopt.step @adamw_bf16_kahan_gpu attributes {zero_stage = 0 : i64, align = 16 : i64, gpu_arch = "sm_80"} {
  %p = zopt.state param : bf16 on gpu kahan
  %g = zopt.state grad : bf16 on gpu
  %m = zopt.state exp_avg : f32 on gpu
  %v = zopt.state exp_avg_sq : f32 on gpu
  %lr = zopt.hyper lr
  %b1 = zopt.hyper beta1
  %b2 = zopt.hyper beta2
  %eps = zopt.hyper eps
  %wd = zopt.hyper weight_decay
  %gc = zopt.clip_by_global_norm %g max 1.0 : bf16
  %p1, %m1, %v1 = zopt.adam %p, %gc, %m, %v, %lr, %b1, %b2, %eps, %wd {decoupled} : bf16, f32, f32, f32
  zopt.yield %p1, %m1, %v1 into %p, %m, %v : f32, f32, f32 into bf16, f32, f32
}
