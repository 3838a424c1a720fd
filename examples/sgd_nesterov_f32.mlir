// SGD with momentum and Nesterov (torch.optim.SGD, nesterov=True), f32.
// Built from primitives only: zopt.momentum starts the buffer as the first
// gradient (t = 1), then buf = mu*buf + (1-dampening)*g.
zopt.step @sgd_nesterov_f32 {
  %p = zopt.state param : f32 on cpu
  %g = zopt.state grad : f32 on cpu
  %buf = zopt.state momentum_buffer : f32 on cpu
  %lr = zopt.hyper lr
  %mu = zopt.hyper momentum
  %damp = zopt.hyper dampening
  %wd = zopt.hyper weight_decay
  %gd = zopt.l2_decay %g, %p, %wd : f32, f32
  %b1 = zopt.momentum %buf, %gd, %mu, %damp : f32, f32
  %d = zopt.nesterov %gd, %b1, %mu : f32, f32
  %p1 = zopt.apply %p, %d, %lr : f32, f32
  zopt.yield %p1, %b1 into %p, %buf : f32, f32 into f32, f32
}
