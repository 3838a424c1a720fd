zopt.step @sr {
  %p = zopt.state param : bf16 on cpu
  %g = zopt.state grad : bf16 on cpu
  %w = zopt.state master : f32 on cpu
  %m = zopt.state exp_avg : f16 on cpu rounding stochastic
  %lr = zopt.hyper lr
  %b1 = zopt.hyper beta1
  %m1 = zopt.ema %m, %g, %b1 : f16, bf16
  %w1 = zopt.apply %w, %m1, %lr : f32, f32
  zopt.yield %w1, %m1, %w1 into %w, %m, %p : f32, f32, f32 into f32, f16, bf16
}
