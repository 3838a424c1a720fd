// adamw_bf16_offload_6b.mlir (DeepSpeed #8010's cell) with stochastic
// rounding: the bf16 master and moments on the CPU, and the bf16 params
// copied back to the GPU, are rounded stochastically (reproducibly: a
// counter hash of the seed, the step and the element, docs/NUMERICS.md), so
// that updates smaller than half a bf16 ulp are not lost on average.
// Bytes per parameter held, by placement (as the round-to-nearest cell):
//   gpu:  4 (param bf16 2, grad bf16 2: the user's tensors)
//   cpu:  6 of optimizer state (master bf16 2, exp_avg bf16 2, exp_avg_sq
//         bf16 2), plus 4 of pinned staging for the param and grad copies
zopt.step @adamw_bf16_offload_6b_sr attributes {zero_stage = 0 : i64, align = 16 : i64, gpu_arch = "sm_90"} {
  %p = zopt.state param : bf16 on gpu rounding stochastic
  %g = zopt.state grad : bf16 on gpu
  %w = zopt.state master : bf16 on cpu rounding stochastic
  %m = zopt.state exp_avg : bf16 on cpu rounding stochastic
  %v = zopt.state exp_avg_sq : bf16 on cpu rounding stochastic
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
