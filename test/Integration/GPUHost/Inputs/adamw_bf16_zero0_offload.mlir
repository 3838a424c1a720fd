// ZeRO-Offload of the bf16 layout: bf16 params/grads on the GPU, bf16
// moments on the CPU, no master: the update reads the params, so they are
// copied from the GPU every step. ZeRO-0: nothing sharded, the reduced grad
// gathered whole and every element updated on every rank.
zopt.step @adamw_bf16_zero0_offload attributes {zero_stage = 0 : i64, align = 64 : i64, gpu_arch = "sm_90"} {
  %p = zopt.state param : bf16 on gpu
  %g = zopt.state grad : bf16 on gpu
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
