// adamw_bf16_offload_6b_sr.mlir (DeepSpeed #8010's cell, stochastic
// rounding) with q8 moments (issue 19's cell): bf16 params and grads on the
// GPU; on the CPU a bf16 master rounded stochastically and the moments
// block-quantized (bitsandbytes' 8-bit Adam: one 8-bit code per element and
// one f32 absmax per block of 256; the signed dynamic map for exp_avg, the
// unsigned one for exp_avg_sq; docs/NUMERICS.md §10). The update runs on the
// CPU (the offload backend, docs/GPU.md "Offloaded steps"); align 256 lays
// every tensor on q8 block boundaries. A remainder master would need the
// bf16 param on its own placement (the CPU), so the offloaded master is
// bf16 with stochastic rounding.
// Bytes per parameter held, by placement:
//   gpu:  4 (param bf16 2, grad bf16 2: the user's tensors)
//   cpu:  4.03 of optimizer state (master bf16 2, exp_avg q8 1, exp_avg_sq
//         q8 1, two absmax 2 * 4/256 = 0.03; #8010's cell: 6), plus 4 of
//         pinned staging for the param and grad copies
zopt.step @adamw_bf16_offload_4b attributes {zero_stage = 0 : i64, align = 256 : i64, gpu_arch = "sm_90"} {
  %p = zopt.state param : bf16 on gpu rounding stochastic
  %g = zopt.state grad : bf16 on gpu
  %w = zopt.state master : bf16 on cpu rounding stochastic
  %m = zopt.state exp_avg : f32 on cpu q8
  %v = zopt.state exp_avg_sq : f32 on cpu q8
  %lr = zopt.hyper lr
  %b1 = zopt.hyper beta1
  %b2 = zopt.hyper beta2
  %eps = zopt.hyper eps
  %wd = zopt.hyper weight_decay
  %gc = zopt.clip_by_global_norm %g max 1.0 : bf16
  %m1 = zopt.ema %m, %gc, %b1 : f32, f32
  %v1 = zopt.ema_sq %v, %gc, %b2 : f32, f32
  %u = zopt.adam_direction %m1, %v1, %b1, %b2, %eps : f32, f32
  %w1 = zopt.decoupled_decay %w, %lr, %wd : bf16
  %w2 = zopt.apply %w1, %u, %lr : f32, f32
  zopt.yield %w2, %m1, %v1, %w2 into %w, %m, %v, %p : f32, f32, f32, f32 into bf16, f32, f32, bf16
}
