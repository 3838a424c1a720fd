// AdamW; bf16 params/grads with a *remainder* f32 master and *q8* moments
// (block-quantized, bitsandbytes' 8-bit Adam: one 8-bit code per element
// and one f32 absmax per block of 256; the signed dynamic map for exp_avg,
// the unsigned one for exp_avg_sq), all on the CPU; global-norm clipping
// at 1.0 (docs/NUMERICS.md §9, §10). The rule reads the decoded moments;
// the param update uses the new moments before quantization.
// Bytes per param held: param 2 + grad 2 + remainder 2 + m 1 + v 1 + two
// absmax 2 * 4/256 = 8.03 (examples/adamw_bf16_remainder.mlir, f32
// moments: 14); offloaded, with params and grads on the GPU, the host holds
// remainder + m + v = 4.03 (issue 19's cell; #8010's is 6).
// Bytes per parameter and step: read g, p, rem, m, v (8.03), write p, rem,
// m, v (6.03): 14.06 (f32 moments: 26).
// The runtime runs it on the CPU (docs/NUMERICS.md §10; ZeRO lays shards
// on q8 block boundaries); zopt-kernel-check checks its UPDATE kernels.
zopt.step @adamw_bf16_q8 attributes {zero_stage = 0 : i64, align = 256 : i64} {
  %p = zopt.state param : bf16 on cpu
  %g = zopt.state grad : bf16 on cpu
  %w = zopt.state master : f32 on cpu remainder
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
  %w1 = zopt.decoupled_decay %w, %lr, %wd : f32
  %w2 = zopt.apply %w1, %u, %lr : f32, f32
  zopt.yield %w2, %m1, %v1, %w2 into %w, %m, %v, %p : f32, f32, f32, f32 into f32, f32, f32, bf16
}
