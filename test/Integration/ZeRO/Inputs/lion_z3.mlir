// Lion, bf16 params and grads, f32 master, bf16 momentum, ZeRO stage 3.
zopt.step @lion_z3 attributes {zero_stage = 3 : i64, align = 16 : i64} {
  %p = zopt.state param : bf16 on cpu
  %g = zopt.state grad : bf16 on cpu
  %w = zopt.state master : f32 on cpu
  %m = zopt.state exp_avg : bf16 on cpu
  %lr = zopt.hyper lr
  %b1 = zopt.hyper beta1
  %b2 = zopt.hyper beta2 default 0.99
  %wd = zopt.hyper weight_decay
  %w1 = zopt.decoupled_decay %w, %lr, %wd : f32
  %c = zopt.ema %m, %g, %b1 : bf16, bf16
  %s = zopt.sign %c : f32
  %w2 = zopt.apply %w1, %s, %lr : f32, f32
  %m1 = zopt.ema %m, %g, %b2 : bf16, bf16
  zopt.yield %w2, %m1, %w2 into %w, %m, %p : f32, f32, f32 into f32, bf16, bf16
}
