// Offload with fp16 loss scaling: f16 params/grads on the GPU, f32 master
// and moments on the CPU (examples/adam_f16_loss_scale.mlir otherwise).
zopt.step @adam_f16_offload attributes {gpu_arch = "sm_90"} {
  %p = zopt.state param : f16 on gpu
  %g = zopt.state grad : f16 on gpu
  %w = zopt.state master : f32 on cpu
  %m = zopt.state exp_avg : f32 on cpu
  %v = zopt.state exp_avg_sq : f32 on cpu
  %lr = zopt.hyper lr
  %b1 = zopt.hyper beta1
  %b2 = zopt.hyper beta2
  %eps = zopt.hyper eps
  %wd = zopt.hyper weight_decay
  %gs = zopt.unscale %g : f16
  %w1, %m1, %v1 = zopt.adam %w, %gs, %m, %v, %lr, %b1, %b2, %eps, %wd : f32, f32, f32, f32
  zopt.yield %w1, %m1, %v1, %w1 into %w, %m, %v, %p : f32, f32, f32, f32 into f32, f32, f32, f16
}
