// AdamW; bf16 params/grads with a *remainder* f32 master (Transformer
// Engine's store_param_remainders) and f32 moments, all on the CPU;
// global-norm clipping at 1.0. The master is stored as the int16 low half
// of its bits; the bf16 param is its high half, rounded to nearest (ties
// away), and the two rebuild the f32 master exactly (docs/NUMERICS.md §9).
// Bytes per param held: param 2 + grad 2 + remainder 2 + m 4 + v 4 = 14
// (examples/adamw_bf16_master.mlir, an f32 master: 16); the master costs 2
// bytes instead of 4. Bytes per parameter and step: read g, p, rem, m, v
// (14), write p, rem, m, v (12): 26 (an f32 master: 28).
zopt.step @adamw_bf16_remainder attributes {zero_stage = 0 : i64, align = 16 : i64} {
  %p = zopt.state param : bf16 on cpu
  %g = zopt.state grad : bf16 on cpu
  %w = zopt.state master : f32 on cpu remainder
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
