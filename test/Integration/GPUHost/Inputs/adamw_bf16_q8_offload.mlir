// Offloaded AdamW with q8 moments (issue 19's cell without its master):
// bf16 params (stochastic rounding, updated in place) and grads on the GPU,
// q8 moments (per-block f32 absmax) on the CPU; align 256 (q8 blocks).
// offload.test and offload-pipeline.test run it against its all-CPU twin
// (the same with every state on the CPU).
zopt.step @adamw_bf16_q8_offload attributes {zero_stage = 2 : i64, align = 256 : i64, gpu_arch = "sm_90"} {
  %p = zopt.state param : bf16 on gpu rounding stochastic
  %g = zopt.state grad : bf16 on gpu
  %m = zopt.state exp_avg : f32 on cpu q8
  %v = zopt.state exp_avg_sq : f32 on cpu q8
  %lr = zopt.hyper lr
  %b1 = zopt.hyper beta1
  %b2 = zopt.hyper beta2
  %eps = zopt.hyper eps
  %wd = zopt.hyper weight_decay
  %gc = zopt.clip_by_global_norm %g max 1.0 : bf16
  %p1, %m1, %v1 = zopt.adam %p, %gc, %m, %v, %lr, %b1, %b2, %eps, %wd {decoupled} : bf16, f32, f32, f32
  zopt.yield %p1, %m1, %v1 into %p, %m, %v : f32, f32, f32 into bf16, f32, f32
}
