// AdamW (torch.optim.AdamW) with every state f32 on the CPU, written with the
// named rule zopt.adam; `zopt-compile --compile-to=decompose` shows the
// primitives it expands to. Bytes per parameter and step: read p, g, m, v
// (16), write p, m, v (12).
zopt.step @adamw_f32 attributes {zero_stage = 0 : i64, align = 16 : i64} {
  %p = zopt.state param : f32 on cpu
  %g = zopt.state grad : f32 on cpu
  %m = zopt.state exp_avg : f32 on cpu
  %v = zopt.state exp_avg_sq : f32 on cpu
  %lr = zopt.hyper lr
  %b1 = zopt.hyper beta1
  %b2 = zopt.hyper beta2
  %eps = zopt.hyper eps
  %wd = zopt.hyper weight_decay
  %p1, %m1, %v1 = zopt.adam %p, %g, %m, %v, %lr, %b1, %b2, %eps, %wd {decoupled} : f32, f32, f32, f32
  zopt.yield %p1, %m1, %v1 into %p, %m, %v : f32, f32, f32 into f32, f32, f32
}
