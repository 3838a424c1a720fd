// SGD with momentum and dampening, no Nesterov (torch.optim.SGD), f32.
zopt.step @sgd_momentum_f32 {
  %p = zopt.state param : f32 on cpu
  %g = zopt.state grad : f32 on cpu
  %buf = zopt.state momentum_buffer : f32 on cpu
  %lr = zopt.hyper lr
  %mu = zopt.hyper momentum
  %damp = zopt.hyper dampening
  %wd = zopt.hyper weight_decay
  %gd = zopt.l2_decay %g, %p, %wd : f32, f32
  %b1 = zopt.momentum %buf, %gd, %mu, %damp : f32, f32
  %p1 = zopt.apply %p, %b1, %lr : f32, f32
  zopt.yield %p1, %b1 into %p, %buf : f32, f32 into f32, f32
}
