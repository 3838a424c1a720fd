// Plain Adam with L2 weight decay (torch.optim.Adam, amsgrad=False), f32.
zopt.step @adam_f32 {
  %p = zopt.state param : f32 on cpu
  %g = zopt.state grad : f32 on cpu
  %m = zopt.state exp_avg : f32 on cpu
  %v = zopt.state exp_avg_sq : f32 on cpu
  %lr = zopt.hyper lr
  %b1 = zopt.hyper beta1
  %b2 = zopt.hyper beta2
  %eps = zopt.hyper eps
  %wd = zopt.hyper weight_decay
  %p1, %m1, %v1 = zopt.adam %p, %g, %m, %v, %lr, %b1, %b2, %eps, %wd : f32, f32, f32, f32
  zopt.yield %p1, %m1, %v1 into %p, %m, %v : f32, f32, f32 into f32, f32, f32
}
