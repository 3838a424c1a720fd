// AdamW, pure bf16 (params, grads, moments) with stochastic rounding of
// every bf16 store, clipping at 1.0, ZeRO stage 2.
zopt.step @adamw_bf16_sr_z2 attributes {zero_stage = 2 : i64, align = 16 : i64} {
  %p = zopt.state param : bf16 on cpu rounding stochastic
  %g = zopt.state grad : bf16 on cpu
  %m = zopt.state exp_avg : bf16 on cpu rounding stochastic
  %v = zopt.state exp_avg_sq : bf16 on cpu rounding stochastic
  %lr = zopt.hyper lr
  %b1 = zopt.hyper beta1
  %b2 = zopt.hyper beta2
  %eps = zopt.hyper eps
  %wd = zopt.hyper weight_decay
  %gc = zopt.clip_by_global_norm %g max 1.0 : bf16
  %p1, %m1, %v1 = zopt.adam %p, %gc, %m, %v, %lr, %b1, %b2, %eps, %wd {decoupled} : bf16, f32, bf16, bf16
  zopt.yield %p1, %m1, %v1 into %p, %m, %v : f32, f32, f32 into bf16, bf16, bf16
}
