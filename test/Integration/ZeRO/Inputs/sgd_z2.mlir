// SGD with Nesterov momentum, f32, no clipping, ZeRO stage 2.
zopt.step @sgd_z2 attributes {zero_stage = 2 : i64, align = 16 : i64} {
  %p = zopt.state param : f32 on cpu
  %g = zopt.state grad : f32 on cpu
  %buf = zopt.state momentum_buffer : f32 on cpu
  %lr = zopt.hyper lr
  %mu = zopt.hyper momentum
  %damp = zopt.hyper dampening
  %wd = zopt.hyper weight_decay
  %gd = zopt.l2_decay %g, %p, %wd : f32, f32
  %buf1 = zopt.momentum %buf, %gd, %mu, %damp : f32, f32
  %d = zopt.nesterov %gd, %buf1, %mu : f32, f32
  %p1 = zopt.apply %p, %d, %lr : f32, f32
  zopt.yield %p1, %buf1 into %p, %buf : f32, f32 into f32, f32
}
