// Mixed precision with fp16: f16 params/grads, f32 master and moments, the
// gradients arrive multiplied by a (dynamic) loss scale S. zopt.unscale
// divides by S and makes the step skip as a whole on any non-finite gradient.
// The rule is Adam with L2 weight decay (torch.optim.Adam).
zopt.step @adam_f16_loss_scale {
  %p = zopt.state param : f16 on cpu
  %g = zopt.state grad : f16 on cpu
  %w = zopt.state master : f32 on cpu
  %m = zopt.state exp_avg : f32 on cpu
  %v = zopt.state exp_avg_sq : f32 on cpu
  %lr = zopt.hyper lr
  %b1 = zopt.hyper beta1
  %b2 = zopt.hyper beta2
  %eps = zopt.hyper eps
  %wd = zopt.hyper weight_decay
  %gs = zopt.unscale %g : f16
  %w1, %m1, %v1 = zopt.adam %w, %gs, %m, %v, %lr, %b1, %b2, %eps, %wd : f32, f32, f32, f32
  zopt.yield %w1, %m1, %v1, %w1 into %w, %m, %v, %p : f32, f32, f32, f32 into f32, f32, f32, f16
}
