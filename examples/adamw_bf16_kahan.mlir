// AdamW; bf16 params/grads with a *Kahan compensation* instead of a master
// (optimi's kahan_sum, "Revisiting BFloat16 Training") and f32 moments, all
// on the CPU; global-norm clipping at 1.0. The rule computes the new param
// in f32 from the bf16 param; its store adds the update to the param
// together with the rounding error the previous stores left in the bf16
// compensation, which keeps the new error (abi.h "Kahan-compensated
// params", docs/NUMERICS.md §11). Approximate where a remainder master is
// exact, at the same bytes.
// State bytes per param: param 2 + compensation 2 + m 4 + v 4 = 12 (a
// remainder master: 12; an f32 master: 14).
// Bytes per parameter and step: read g, p, c, m, v (14), write p, c, m, v (12).
zopt.step @adamw_bf16_kahan attributes {zero_stage = 0 : i64, align = 16 : i64} {
  %p = zopt.state param : bf16 on cpu kahan
  %g = zopt.state grad : bf16 on cpu
  %m = zopt.state exp_avg : f32 on cpu
  %v = zopt.state exp_avg_sq : f32 on cpu
  %lr = zopt.hyper lr
  %b1 = zopt.hyper beta1
  %b2 = zopt.hyper beta2
  %eps = zopt.hyper eps
  %wd = zopt.hyper weight_decay
  %gc = zopt.clip_by_global_norm %g max 1.0 : bf16
  %p1, %m1, %v1 = zopt.adam %p, %gc, %m, %v, %lr, %b1, %b2, %eps, %wd {decoupled} : bf16, f32, f32, f32
  zopt.yield %p1, %m1, %v1 into %p, %m, %v : f32, f32, f32 into bf16, f32, f32
}
