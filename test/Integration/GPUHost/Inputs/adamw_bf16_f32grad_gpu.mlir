// DeepSpeed's default bf16 layout on the GPU: bf16 params, f32 gradients
// (accumulated in f32), f32 master and moments, global-norm clipping at 1.0
// (test/Integration/ZeRO/Inputs/adamw_bf16_f32grad_z2.mlir with everything
// on the GPU, ZeRO stage 0).
zopt.step @adamw_bf16_f32grad_gpu attributes {zero_stage = 0 : i64, align = 16 : i64, gpu_arch = "sm_90"} {
  %p = zopt.state param : bf16 on gpu
  %g = zopt.state grad : f32 on gpu
  %w = zopt.state master : f32 on gpu
  %m = zopt.state exp_avg : f32 on gpu
  %v = zopt.state exp_avg_sq : f32 on gpu
  %lr = zopt.hyper lr
  %b1 = zopt.hyper beta1
  %b2 = zopt.hyper beta2
  %eps = zopt.hyper eps
  %wd = zopt.hyper weight_decay
  %gc = zopt.clip_by_global_norm %g max 1.0 : f32
  %w1, %m1, %v1 = zopt.adam %w, %gc, %m, %v, %lr, %b1, %b2, %eps, %wd {decoupled} : f32, f32, f32, f32
  zopt.yield %w1, %m1, %v1, %w1 into %w, %m, %v, %p : f32, f32, f32, f32 into f32, f32, f32, bf16
}
