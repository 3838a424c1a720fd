// zopt-kernel-check --q8-sweep (adamw_bf16_q8.test): both new moments are
// the gradient itself (ema with beta 0: 0 * m + 1 * g, exact), so the
// kernel encodes chosen f32 values against a chosen absmax.
zopt.step @q8_sweep attributes {zero_stage = 0 : i64, align = 256 : i64} {
  %p = zopt.state param : f32 on cpu
  %g = zopt.state grad : f32 on cpu
  %m = zopt.state exp_avg : f32 on cpu q8
  %v = zopt.state exp_avg_sq : f32 on cpu q8
  %lr = zopt.hyper lr
  %b1 = zopt.hyper beta1
  %b2 = zopt.hyper beta2
  %m1 = zopt.ema %m, %g, %b1 : f32, f32
  %v1 = zopt.ema %v, %g, %b2 : f32, f32
  %p1 = zopt.apply %p, %m1, %lr : f32, f32
  %p2 = zopt.apply %p1, %v1, %lr : f32, f32
  zopt.yield %p2, %m1, %v1 into %p, %m, %v : f32, f32, f32 into f32, f32, f32
}
