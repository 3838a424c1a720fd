// Benchmark layout: adamw_bf16_master without clipping (the UPDATE is the
// whole step, one pass): bf16 p/g, f32 master/moments, bf16 copy-out fused.
// Bytes per parameter: read g, w, m, v (14), write w, m, v, p (14).
zopt.step @adamw_bf16_master_noclip attributes {zero_stage = 0 : i64, align = 16 : i64} {
  %p = zopt.state param : bf16 on cpu
  %g = zopt.state grad : bf16 on cpu
  %w = zopt.state master : f32 on cpu
  %m = zopt.state exp_avg : f32 on cpu
  %v = zopt.state exp_avg_sq : f32 on cpu
  %lr = zopt.hyper lr
  %b1 = zopt.hyper beta1
  %b2 = zopt.hyper beta2
  %eps = zopt.hyper eps
  %wd = zopt.hyper weight_decay
  %m1 = zopt.ema %m, %g, %b1 : f32, bf16
  %v1 = zopt.ema_sq %v, %g, %b2 : f32, bf16
  %u = zopt.adam_direction %m1, %v1, %b1, %b2, %eps : f32, f32
  %w1 = zopt.decoupled_decay %w, %lr, %wd : f32
  %w2 = zopt.apply %w1, %u, %lr : f32, f32
  zopt.yield %w2, %m1, %v1, %w2 into %w, %m, %v, %p : f32, f32, f32, f32 into f32, f32, f32, bf16
}
