// Lion (Chen et al. 2023) on bf16 params/grads with an f32 master and a
// bf16 momentum, built from primitives: the update direction is the sign of
// an interpolation that uses beta1, the momentum is then updated with beta2.
zopt.step @lion_bf16 {
  %p = zopt.state param : bf16 on cpu
  %g = zopt.state grad : bf16 on cpu
  %w = zopt.state master : f32 on cpu
  %m = zopt.state exp_avg : bf16 on cpu
  %lr = zopt.hyper lr
  %b1 = zopt.hyper beta1
  %b2 = zopt.hyper beta2 default 0.99
  %wd = zopt.hyper weight_decay
  %c = zopt.ema %m, %g, %b1 : bf16, bf16
  %s = zopt.sign %c : f32
  %w1 = zopt.decoupled_decay %w, %lr, %wd : f32
  %w2 = zopt.apply %w1, %s, %lr : f32, f32
  %m1 = zopt.ema %m, %g, %b2 : bf16, bf16
  zopt.yield %w2, %m1, %w2 into %w, %m, %p : f32, f32, f32 into f32, bf16, bf16
}
