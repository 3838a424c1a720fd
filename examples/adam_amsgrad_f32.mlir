// Adam with L2 weight decay (torch.optim.Adam) and amsgrad, all f32 on the
// CPU: the named rule zopt.adam, decomposed by the compiler into primitives.
zopt.step @adam_amsgrad_f32 {
  %p = zopt.state param : f32 on cpu
  %g = zopt.state grad : f32 on cpu
  %m = zopt.state exp_avg : f32 on cpu
  %v = zopt.state exp_avg_sq : f32 on cpu
  %vm = zopt.state max_exp_avg_sq : f32 on cpu
  %lr = zopt.hyper lr
  %b1 = zopt.hyper beta1
  %b2 = zopt.hyper beta2
  %eps = zopt.hyper eps
  %wd = zopt.hyper weight_decay
  %gd = zopt.l2_decay %g, %p, %wd : f32, f32
  %m1 = zopt.ema %m, %gd, %b1 : f32, f32
  %v1 = zopt.ema_sq %v, %gd, %b2 : f32, f32
  %vm1 = zopt.max %vm, %v1 : f32, f32
  %u = zopt.adam_direction %m1, %vm1, %b1, %b2, %eps : f32, f32
  %p1 = zopt.apply %p, %u, %lr : f32, f32
  zopt.yield %p1, %m1, %v1, %vm1 into %p, %m, %v, %vm : f32, f32, f32, f32 into f32, f32, f32, f32
}
