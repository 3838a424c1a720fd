// The CPU-only peer of examples/adamw_bf16_offload_4b.mlir (issue 19's q8
// cell) for bench/run_offload_bench.sh: the same update with everything on
// the CPU, where a bf16 master beside the bf16 param would duplicate it
// (the verifier refuses that): the param is updated in place, rounded
// stochastically as the cell's master and param are.
// 2.03 B/param of q8 moments, 4 of param and grad.
zopt.step @adamw_bf16_4b_cpu attributes {zero_stage = 0 : i64, align = 256 : i64} {
  %p = zopt.state param : bf16 on cpu rounding stochastic
  %g = zopt.state grad : bf16 on cpu
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
  %p1 = zopt.decoupled_decay %p, %lr, %wd : bf16
  %p2 = zopt.apply %p1, %u, %lr : f32, f32
  zopt.yield %p2, %m1, %v1 into %p, %m, %v : f32, f32, f32 into bf16, f32, f32
}
