// DeepSpeed #8010's offload cell: AdamW over bf16 params and grads on the
// GPU, with a bf16 master and bf16 moments on the CPU, where the update runs
// (ZeRO-Offload: the grads are copied to the host, updated there, the params
// copied back). Global-norm clipping at 1.0.
// Bytes per parameter held, by placement:
//   gpu:  4 (param bf16 2, grad bf16 2: the user's tensors)
//   cpu:  6 of optimizer state (master bf16 2, exp_avg bf16 2, exp_avg_sq
//         bf16 2), plus 4 of pinned staging for the param and grad copies
// A bf16 master rounds every update to nearest even; the variant with
// stochastic rounding of the master and moments is
// adamw_bf16_offload_6b_sr.mlir (same bytes).
zopt.step @adamw_bf16_offload_6b attributes {zero_stage = 0 : i64, align = 16 : i64, gpu_arch = "sm_90"} {
  %p = zopt.state param : bf16 on gpu
  %g = zopt.state grad : bf16 on gpu
  %w = zopt.state master : bf16 on cpu
  %m = zopt.state exp_avg : bf16 on cpu
  %v = zopt.state exp_avg_sq : bf16 on cpu
  %lr = zopt.hyper lr
  %b1 = zopt.hyper beta1
  %b2 = zopt.hyper beta2
  %eps = zopt.hyper eps
  %wd = zopt.hyper weight_decay
  %gc = zopt.clip_by_global_norm %g max 1.0 : bf16
  %m1 = zopt.ema %m, %gc, %b1 : bf16, f32
  %v1 = zopt.ema_sq %v, %gc, %b2 : bf16, f32
  %u = zopt.adam_direction %m1, %v1, %b1, %b2, %eps : f32, f32
  %w1 = zopt.decoupled_decay %w, %lr, %wd : bf16
  %w2 = zopt.apply %w1, %u, %lr : f32, f32
  zopt.yield %w2, %m1, %v1, %w2 into %w, %m, %v, %p : f32, f32, f32, f32 into bf16, bf16, bf16, bf16
}
