// AdamW with q8 moments and a remainder master on the GPU
// (examples/adamw_bf16_q8.mlir with every state on the GPU): the GPU UPDATE
// kernel decodes and encodes through the shared BodyEmitter (q8-ptx.test).
zopt.step @adamw_bf16_q8_gpu attributes {zero_stage = 0 : i64, align = 16 : i64, gpu_arch = "sm_80"} {
  %p = zopt.state param : bf16 on gpu
  %g = zopt.state grad : bf16 on gpu
  %w = zopt.state master : f32 on gpu remainder
  %m = zopt.state exp_avg : f32 on gpu q8
  %v = zopt.state exp_avg_sq : f32 on gpu q8
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
