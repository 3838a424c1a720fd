// SGD without momentum, L2 weight decay, bf16 param/grad updated in place
// (no master): p = RNE(p - lr * (g + wd * p)).
zopt.step @sgd_bf16 {
  %p = zopt.state param : bf16 on cpu
  %g = zopt.state grad : bf16 on cpu
  %lr = zopt.hyper lr
  %wd = zopt.hyper weight_decay
  %gd = zopt.l2_decay %g, %p, %wd : bf16, bf16
  %p1 = zopt.apply %p, %gd, %lr : bf16, f32
  zopt.yield %p1 into %p : f32 into bf16
}
