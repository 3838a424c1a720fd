// AdamW, f32 everything, clipping at 1.0, ZeRO stage 1.
zopt.step @adamw_f32_z1 attributes {zero_stage = 1 : i64, align = 16 : i64} {
  %p = zopt.state param : f32 on cpu
  %g = zopt.state grad : f32 on cpu
  %m = zopt.state exp_avg : f32 on cpu
  %v = zopt.state exp_avg_sq : f32 on cpu
  %lr = zopt.hyper lr
  %b1 = zopt.hyper beta1
  %b2 = zopt.hyper beta2
  %eps = zopt.hyper eps
  %wd = zopt.hyper weight_decay
  %gc = zopt.clip_by_global_norm %g max 1.0 : f32
  %p1, %m1, %v1 = zopt.adam %p, %gc, %m, %v, %lr, %b1, %b2, %eps, %wd {decoupled} : f32, f32, f32, f32
  zopt.yield %p1, %m1, %v1 into %p, %m, %v : f32, f32, f32 into f32, f32, f32
}
