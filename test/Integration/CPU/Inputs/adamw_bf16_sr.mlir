// AdamW, pure bf16 (params, grads, moments), every bf16 store rounded
// stochastically (abi.h "Stochastic rounding").
zopt.step @adamw_bf16_sr attributes {zero_stage = 0 : i64, align = 16 : i64} {
  %p = zopt.state param : bf16 on cpu rounding stochastic
  %g = zopt.state grad : bf16 on cpu
  %m = zopt.state exp_avg : bf16 on cpu rounding stochastic
  %v = zopt.state exp_avg_sq : bf16 on cpu rounding stochastic
  %lr = zopt.hyper lr
  %b1 = zopt.hyper beta1
  %b2 = zopt.hyper beta2
  %eps = zopt.hyper eps
  %wd = zopt.hyper weight_decay
  %p1, %m1, %v1 = zopt.adam %p, %g, %m, %v, %lr, %b1, %b2, %eps, %wd {decoupled} : bf16, bf16, bf16, bf16
  zopt.yield %p1, %m1, %v1 into %p, %m, %v : f32, f32, f32 into bf16, bf16, bf16
}
