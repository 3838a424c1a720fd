// The layout DeepSpeed needed a PR for: bf16 params/grads as the master and
// bf16 moments, all held on the CPU (about 6 bytes/param offloaded: p, m, v),
// partitioned under ZeRO-2 with NCCL-friendly alignment, clip at 1.0.
// Bytes per parameter and step: read p, g, m, v (8), write p, m, v (6).
zopt.step @adamw_bf16_zero2 attributes {zero_stage = 2 : i64, align = 64 : i64} {
  %p = zopt.state param : bf16 on cpu
  %g = zopt.state grad : bf16 on cpu
  %m = zopt.state exp_avg : bf16 on cpu
  %v = zopt.state exp_avg_sq : bf16 on cpu
  %lr = zopt.hyper lr
  %b1 = zopt.hyper beta1
  %b2 = zopt.hyper beta2
  %eps = zopt.hyper eps
  %wd = zopt.hyper weight_decay
  %gc = zopt.clip_by_global_norm %g max 1.0 : bf16
  %p1, %m1, %v1 = zopt.adam %p, %gc, %m, %v, %lr, %b1, %b2, %eps, %wd {decoupled} : bf16, f32, bf16, bf16
  zopt.yield %p1, %m1, %v1 into %p, %m, %v : f32, f32, f32 into bf16, bf16, bf16
}
