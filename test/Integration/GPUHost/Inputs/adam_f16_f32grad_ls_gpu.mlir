// f16 params with f32 gradients (accumulated in f32) on the GPU, f32 master
// and moments, loss-scaled gradients: the device skips the step on
// non-finite gradients and runs the dynamic loss scaler
// (test/Integration/CUDA/Inputs/adam_f16_loss_scale_gpu.mlir with f32 grads).
zopt.step @adam_f16_f32grad_ls_gpu attributes {zero_stage = 0 : i64, align = 16 : i64, gpu_arch = "sm_90"} {
  %p = zopt.state param : f16 on gpu
  %g = zopt.state grad : f32 on gpu
  %w = zopt.state master : f32 on gpu
  %m = zopt.state exp_avg : f32 on gpu
  %v = zopt.state exp_avg_sq : f32 on gpu
  %lr = zopt.hyper lr
  %b1 = zopt.hyper beta1
  %b2 = zopt.hyper beta2
  %eps = zopt.hyper eps
  %wd = zopt.hyper weight_decay
  %gs = zopt.unscale %g : f32
  %w1, %m1, %v1 = zopt.adam %w, %gs, %m, %v, %lr, %b1, %b2, %eps, %wd : f32, f32, f32, f32
  zopt.yield %w1, %m1, %v1, %w1 into %w, %m, %v, %p : f32, f32, f32, f32 into f32, f32, f32, f16
}
