// The brief's example: AdamW with bf16 params/grads on the GPU, f32
// master and moments on the CPU (ZeRO-Offload), ZeRO-2, clip at 1.0.
zopt.step @adamw_bf16_offload attributes {zero_stage = 2 : i64, align = 4 : i64, gpu_arch = "sm_90"} {
  %p = zopt.state param : bf16 on gpu
  %g = zopt.state grad : bf16 on gpu
  %w = zopt.state master : f32 on cpu
  %m = zopt.state exp_avg : f32 on cpu
  %v = zopt.state exp_avg_sq : f32 on cpu
  %lr = zopt.hyper lr
  %b1 = zopt.hyper beta1
  %b2 = zopt.hyper beta2
  %eps = zopt.hyper eps
  %wd = zopt.hyper weight_decay
  %gc = zopt.clip_by_global_norm %g max 1.0 : bf16
  %m1 = zopt.ema %m, %gc, %b1 : f32, f32
  %v1 = zopt.ema_sq %v, %gc, %b2 : f32, f32
  %u = zopt.adam_direction %m1, %v1, %b1, %b2, %eps : f32, f32
  %w1 = zopt.decoupled_decay %w, %lr, %wd : f32
  %w2 = zopt.apply %w1, %u, %lr : f32, f32
  zopt.yield %w2, %m1, %v1, %w2 into %w, %m, %v, %p : f32, f32, f32, f32 into f32, f32, f32, bf16
}
