// SGD with Nesterov momentum (torch.optim.SGD, nesterov=True).
// Built by zopt.steps.sgd(param='bf16', master='kahan', momentum=0.9,
//   nesterov=True)
// Tensors: the user's param (bf16) and grad (bf16) on cpu; the optimizer's
//   states (momentum_buffer f32) on cpu.
// The update runs on the CPU (AVX-512/AVX2 kernels).
// Bytes per parameter and step: read 10 (g, p+c, buf), write 8 (p+c, buf).
zopt.step @sgd_nesterov_bf16_kahan_sf32 attributes {zero_stage = 0 : i64, align = 16 : i64} {
  // The user's tensors (the grad is read-only) and the optimizer's states, each
  //   with its dtype and placement.
  %p = zopt.state param : bf16 on cpu kahan   // the weight the update changes, with its Kahan compensation (a state of its own)
  %g = zopt.state grad : bf16 on cpu
  %buf = zopt.state momentum_buffer : f32 on cpu   // momentum buffer
  // Hyperparameters: per-group runtime values (changing them never recompiles);
  //   a default applies when a group sets none.
  %lr = zopt.hyper lr
  %mu = zopt.hyper momentum default 0.9
  %damp = zopt.hyper dampening
  %wd = zopt.hyper weight_decay
  // L2 weight decay folded into the gradient: g += wd * w.
  %gd = zopt.l2_decay %g, %p, %wd : bf16, bf16
  // buf = g at the first step, then buf = mu*buf + (1-dampening)*g.
  %buf1 = zopt.momentum %buf, %gd, %mu, %damp : f32, f32
  // Nesterov: d = g + mu*buf.
  %d = zopt.nesterov %gd, %buf1, %mu : f32, f32
  // w = w - lr*d.
  %p1 = zopt.apply %p, %d, %lr : bf16, f32
  // Store every new value into its state.
  zopt.yield %p1, %buf1 into %p, %buf : f32, f32 into bf16, f32
}

