// Lion (Chen et al. 2023; decoupled weight decay).
// Built by zopt.steps.lion(param='bf16', master='kahan')
// Tensors: the user's param (bf16) and grad (bf16) on cpu; the optimizer's
//   states (exp_avg f32) on cpu.
// The update runs on the CPU (AVX-512/AVX2 kernels).
// Bytes per parameter and step: read 10 (g, p+c, m), write 8 (p+c, m).
zopt.step @lion_bf16_kahan_sf32 attributes {zero_stage = 0 : i64, align = 16 : i64} {
  // The user's tensors (the grad is read-only) and the optimizer's states, each
  //   with its dtype and placement.
  %p = zopt.state param : bf16 on cpu kahan   // the weight the update changes, with its Kahan compensation (a state of its own)
  %g = zopt.state grad : bf16 on cpu
  %m = zopt.state exp_avg : f32 on cpu   // momentum m
  // Hyperparameters: per-group runtime values (changing them never recompiles);
  //   a default applies when a group sets none.
  %lr = zopt.hyper lr
  %b1 = zopt.hyper beta1 default 0.9
  %b2 = zopt.hyper beta2 default 0.99
  %wd = zopt.hyper weight_decay
  // The direction is the sign of an interpolation with beta1: d = sign(b1*m +
  //   (1-b1)*g).
  %c = zopt.ema %m, %g, %b1 : f32, bf16
  %d = zopt.sign %c : f32
  // Decoupled weight decay, then the step: w = w*(1 - lr*wd) - lr*d.
  %wdec = zopt.decoupled_decay %p, %lr, %wd : bf16
  %p1 = zopt.apply %wdec, %d, %lr : f32, f32
  // The momentum is updated with beta2: m = b2*m + (1-b2)*g.
  %m1 = zopt.ema %m, %g, %b2 : f32, bf16
  // Store every new value into its state.
  zopt.yield %p1, %m1 into %p, %m : f32, f32 into bf16, f32
}

