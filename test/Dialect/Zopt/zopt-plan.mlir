// RUN: zopt-opt %s --split-input-file --zopt-plan | FileCheck %s

// Every read of the grad becomes g * grad_scale (1 / (S * D): the loss scale
// and the divisor, the world size by default, so the reduced gradient is
// the ranks' mean). Clipping becomes a reduction marker over the value it
// clips plus a multiplication by the runtime clip coefficient; the step
// records max_norm, where the update runs, which buffers ZeRO-2 partitions,
// and state slots.
// CHECK-LABEL: zopt.step @clip
// CHECK-SAME: zopt.device = #zopt<placement cpu>
// CHECK-SAME: zopt.max_norm = 5.000000e-01 : f64
// CHECK-SAME: zopt.partitioned = ["exp_avg", "grad"]
// CHECK: zopt.state param : bf16 on cpu {zopt.slot = 0 : i64}
// CHECK: %[[G:.+]] = zopt.state grad : bf16 on cpu {zopt.slot = 1 : i64}
// CHECK: %[[S:.+]] = zopt.global grad_scale
// CHECK: %[[GF:.+]] = arith.extf %[[G]] : bf16 to f32
// CHECK: %[[SF:.+]] = arith.truncf %[[S]] : f64 to f32
// CHECK: %[[GS:.+]] = arith.mulf %[[GF]], %[[SF]] : f32
// CHECK: zopt.state exp_avg : f32 on cpu {zopt.slot = 2 : i64}
// CHECK: zopt.reduce_sumsq %[[GS]] : f32
// CHECK: %[[C:.+]] = zopt.global clip_coef
// CHECK: %[[CF:.+]] = arith.truncf %[[C]] : f64 to f32
// CHECK: arith.mulf %[[GS]], %[[CF]] : f32
// CHECK-NOT: zopt.clip_by_global_norm
// The ZeRO-2 program: grads reduced into their owners' shards, the norm of
// the owned blocks, the update of the owned shards, the params gathered
// unless the step was skipped.
// CHECK: zprog.program for "clip" {
// CHECK-NEXT: zprog.reduce_scatter grad : bf16 accumulate f32
// CHECK-NEXT: zprog.prepare on cpu
// CHECK-NEXT: zprog.norm_partials owned on cpu
// CHECK-NEXT: zprog.norm
// CHECK-NEXT: zprog.update owned on cpu
// CHECK-NEXT: zprog.all_gather param : bf16 unless_skipped
// CHECK-NEXT: zprog.finish on cpu
// CHECK-NEXT: }
zopt.step @clip attributes {zero_stage = 2 : i64} {
  %p = zopt.state param : bf16 on cpu
  %g = zopt.state grad : bf16 on cpu
  %m = zopt.state exp_avg : f32 on cpu
  %lr = zopt.hyper lr
  %b1 = zopt.hyper beta1
  %gc = zopt.clip_by_global_norm %g max 0.5 : bf16
  %m1 = zopt.ema %m, %gc, %b1 : f32, f32
  %p1 = zopt.apply %p, %m1, %lr : bf16, f32
  zopt.yield %p1, %m1 into %p, %m : f32, f32 into bf16, f32
}

// -----

// Loss scaling alone: the scaled grad (1/S folded into grad_scale) is the
// value of the non-finite check; the step is marked as loss-scaled. ZeRO
// stage 0 (the default): every rank updates every element after the grads
// are reduced and gathered (DDP's all-reduce).
// CHECK-LABEL: zopt.step @scaled
// CHECK-SAME: zopt.loss_scale
// CHECK: %[[S:.+]] = zopt.global grad_scale
// CHECK: %[[SF:.+]] = arith.truncf %[[S]] : f64 to f32
// CHECK: %[[U:.+]] = arith.mulf %{{.+}}, %[[SF]] : f32
// CHECK: zopt.reduce_sumsq %[[U]] : f32
// CHECK-NOT: zopt.unscale
// CHECK: zprog.program for "scaled" {
// CHECK-NEXT: zprog.reduce_scatter grad : f16 accumulate f32
// CHECK-NEXT: zprog.all_gather grad : f16
// CHECK-NEXT: zprog.prepare on cpu
// CHECK-NEXT: zprog.norm_partials all on cpu
// CHECK-NEXT: zprog.norm
// CHECK-NEXT: zprog.update all on cpu
// CHECK-NEXT: zprog.finish on cpu
zopt.step @scaled {
  %p = zopt.state param : f16 on cpu
  %g = zopt.state grad : f16 on cpu
  %w = zopt.state master : f32 on cpu
  %lr = zopt.hyper lr
  %gs = zopt.unscale %g : f16
  %w1 = zopt.apply %w, %gs, %lr : f32, f32
  zopt.yield %w1, %w1 into %w, %p : f32, f32 into f32, f16
}

// -----

// Loss scaling and clipping: one reduction, over the unscaled gradient.
// CHECK-LABEL: zopt.step @both
// CHECK: zopt.global grad_scale
// CHECK: %[[U:.+]] = arith.mulf
// CHECK: zopt.reduce_sumsq %[[U]] : f32
// CHECK-NOT: zopt.reduce_sumsq
// CHECK: zopt.global clip_coef
zopt.step @both {
  %p = zopt.state param : f16 on cpu
  %g = zopt.state grad : f16 on cpu
  %w = zopt.state master : f32 on cpu
  %lr = zopt.hyper lr
  %gs = zopt.unscale %g : f16
  %gc = zopt.clip_by_global_norm %gs max 1.0 : f32
  %w1 = zopt.apply %w, %gc, %lr : f32, f32
  zopt.yield %w1, %w1 into %w, %p : f32, f32 into f32, f16
}

// -----

// An f32 grad is scaled without a widening; no clipping and no loss scaling:
// no norm in the program.
// CHECK-LABEL: zopt.step @plain
// CHECK: %[[G:.+]] = zopt.state grad : f32
// CHECK: %[[S:.+]] = zopt.global grad_scale
// CHECK: %[[SF:.+]] = arith.truncf %[[S]] : f64 to f32
// CHECK: %[[GS:.+]] = arith.mulf %[[G]], %[[SF]] : f32
// CHECK: zopt.apply %{{.+}}, %[[GS]], %{{.+}} : f32, f32
// CHECK: zprog.program for "plain" {
// CHECK-NOT: norm
// CHECK: zprog.update all on cpu
zopt.step @plain {
  %p = zopt.state param : f32 on cpu
  %g = zopt.state grad : f32 on cpu
  %lr = zopt.hyper lr
  %p1 = zopt.apply %p, %g, %lr : f32, f32
  zopt.yield %p1 into %p : f32 into f32
}

// -----

// The step program of each ZeRO stage and of offloaded steps: what one step
// does on every rank, in order (abi.h "The step program").

// ZeRO-1: the optimizer states are sharded; the grads are reduced and then
// gathered (every rank keeps the full mean gradient, like DeepSpeed's
// stage 1); each rank updates its shards; the params are gathered.
// CHECK-LABEL: zopt.step @zero1
// CHECK-SAME: zopt.partitioned = ["master", "exp_avg", "exp_avg_sq"]
// CHECK: zprog.program for "zero1" {
// CHECK-NEXT: zprog.reduce_scatter grad : bf16 accumulate f32
// CHECK-NEXT: zprog.all_gather grad : bf16
// CHECK-NEXT: zprog.prepare on cpu
// CHECK-NEXT: zprog.norm_partials owned on cpu
// CHECK-NEXT: zprog.norm
// CHECK-NEXT: zprog.update owned on cpu
// CHECK-NEXT: zprog.all_gather param : bf16 unless_skipped
// CHECK-NEXT: zprog.finish on cpu
// CHECK-NEXT: }
zopt.step @zero1 attributes {zero_stage = 1 : i64} {
  %p = zopt.state param : bf16 on cpu
  %g = zopt.state grad : bf16 on cpu
  %w = zopt.state master : f32 on cpu
  %m = zopt.state exp_avg : f32 on cpu
  %v = zopt.state exp_avg_sq : f32 on cpu
  %lr = zopt.hyper lr
  %b1 = zopt.hyper beta1
  %b2 = zopt.hyper beta2
  %eps = zopt.hyper eps
  %wd = zopt.hyper weight_decay
  %gc = zopt.clip_by_global_norm %g max 1.0 : bf16
  %w1, %m1, %v1 = zopt.adam %w, %gc, %m, %v, %lr, %b1, %b2, %eps, %wd {decoupled} : f32, f32, f32, f32
  zopt.yield %w1, %m1, %v1, %w1 into %w, %m, %v, %p : f32, f32, f32, f32 into f32, f32, f32, bf16
}

// -----

// ZeRO-2: the grads are only reduced into their owners' shards.
// CHECK-LABEL: zopt.step @zero2
// CHECK-SAME: zopt.partitioned = ["master", "exp_avg", "exp_avg_sq", "grad"]
// CHECK: zprog.program for "zero2" {
// CHECK-NEXT: zprog.reduce_scatter grad : bf16 accumulate f32
// CHECK-NEXT: zprog.prepare on cpu
// CHECK-NEXT: zprog.norm_partials owned on cpu
// CHECK-NEXT: zprog.norm
// CHECK-NEXT: zprog.update owned on cpu
// CHECK-NEXT: zprog.all_gather param : bf16 unless_skipped
// CHECK-NEXT: zprog.finish on cpu
zopt.step @zero2 attributes {zero_stage = 2 : i64} {
  %p = zopt.state param : bf16 on cpu
  %g = zopt.state grad : bf16 on cpu
  %w = zopt.state master : f32 on cpu
  %m = zopt.state exp_avg : f32 on cpu
  %v = zopt.state exp_avg_sq : f32 on cpu
  %lr = zopt.hyper lr
  %b1 = zopt.hyper beta1
  %b2 = zopt.hyper beta2
  %eps = zopt.hyper eps
  %wd = zopt.hyper weight_decay
  %gc = zopt.clip_by_global_norm %g max 1.0 : bf16
  %w1, %m1, %v1 = zopt.adam %w, %gc, %m, %v, %lr, %b1, %b2, %eps, %wd {decoupled} : f32, f32, f32, f32
  zopt.yield %w1, %m1, %v1, %w1 into %w, %m, %v, %p : f32, f32, f32, f32 into f32, f32, f32, bf16
}

// -----

// ZeRO-3: the params are partitioned too and stay sharded after the update
// (no gather in the program: the forward gathers them on demand).
// CHECK-LABEL: zopt.step @zero3
// CHECK-SAME: zopt.partitioned = ["exp_avg", "exp_avg_sq", "grad", "param"]
// CHECK: zprog.program for "zero3" {
// CHECK-NEXT: zprog.reduce_scatter grad : f32 accumulate f32
// CHECK-NEXT: zprog.prepare on cpu
// CHECK-NEXT: zprog.update owned on cpu
// CHECK-NEXT: zprog.finish on cpu
// CHECK-NEXT: }
zopt.step @zero3 attributes {zero_stage = 3 : i64} {
  %p = zopt.state param : f32 on cpu
  %g = zopt.state grad : f32 on cpu
  %m = zopt.state exp_avg : f32 on cpu
  %v = zopt.state exp_avg_sq : f32 on cpu
  %lr = zopt.hyper lr
  %b1 = zopt.hyper beta1
  %b2 = zopt.hyper beta2
  %eps = zopt.hyper eps
  %wd = zopt.hyper weight_decay
  %p1, %m1, %v1 = zopt.adam %p, %g, %m, %v, %lr, %b1, %b2, %eps, %wd {decoupled} : f32, f32, f32, f32
  zopt.yield %p1, %m1, %v1 into %p, %m, %v : f32, f32, f32 into f32, f32, f32
}

// -----

// Offload (ZeRO-Offload: param and grad on the GPU, the master and moments
// on the CPU): the grads come to the host first, the new params go back
// last unless the step was skipped; the update does not read the bf16
// param (it has a master), so it is not copied in.
// CHECK-LABEL: zopt.step @offload
// CHECK: zprog.program for "offload" {
// CHECK-NEXT: zprog.copy grad : bf16 from gpu to cpu
// CHECK-NEXT: zprog.reduce_scatter grad : bf16 accumulate f32
// CHECK-NEXT: zprog.prepare on cpu
// CHECK-NEXT: zprog.norm_partials owned on cpu
// CHECK-NEXT: zprog.norm
// CHECK-NEXT: zprog.update owned on cpu
// CHECK-NEXT: zprog.all_gather param : bf16 unless_skipped
// CHECK-NEXT: zprog.copy param : bf16 from cpu to gpu unless_skipped
// CHECK-NEXT: zprog.finish on cpu
zopt.step @offload attributes {zero_stage = 2 : i64, gpu_arch = "sm_90"} {
  %p = zopt.state param : bf16 on gpu
  %g = zopt.state grad : bf16 on gpu
  %w = zopt.state master : f32 on cpu
  %m = zopt.state exp_avg : f32 on cpu
  %v = zopt.state exp_avg_sq : f32 on cpu
  %lr = zopt.hyper lr
  %b1 = zopt.hyper beta1
  %b2 = zopt.hyper beta2
  %eps = zopt.hyper eps
  %wd = zopt.hyper weight_decay
  %gc = zopt.clip_by_global_norm %g max 1.0 : bf16
  %w1, %m1, %v1 = zopt.adam %w, %gc, %m, %v, %lr, %b1, %b2, %eps, %wd {decoupled} : f32, f32, f32, f32
  zopt.yield %w1, %m1, %v1, %w1 into %w, %m, %v, %p : f32, f32, f32, f32 into f32, f32, f32, bf16
}

// -----

// Offload without a master: the update reads the param, so it comes to the
// host with the grad.
// CHECK-LABEL: zopt.step @offload_nomaster
// CHECK: zprog.program for "offload_nomaster" {
// CHECK-NEXT: zprog.copy grad : bf16 from gpu to cpu
// CHECK-NEXT: zprog.copy param : bf16 from gpu to cpu
// CHECK-NEXT: zprog.reduce_scatter grad : bf16 accumulate f32
zopt.step @offload_nomaster attributes {zero_stage = 2 : i64, gpu_arch = "sm_90"} {
  %p = zopt.state param : bf16 on gpu
  %g = zopt.state grad : bf16 on gpu
  %m = zopt.state exp_avg : bf16 on cpu
  %v = zopt.state exp_avg_sq : bf16 on cpu
  %lr = zopt.hyper lr
  %b1 = zopt.hyper beta1
  %b2 = zopt.hyper beta2
  %eps = zopt.hyper eps
  %wd = zopt.hyper weight_decay
  %p1, %m1, %v1 = zopt.adam %p, %g, %m, %v, %lr, %b1, %b2, %eps, %wd {decoupled} : bf16, bf16, bf16, bf16
  zopt.yield %p1, %m1, %v1 into %p, %m, %v : f32, f32, f32 into bf16, bf16, bf16
}

// -----

// A GPU step: the same program, every op on the device (world size 1 for
// now: the runtime refuses more ranks for GPU-updated steps).
// CHECK-LABEL: zopt.step @gpu
// CHECK-SAME: zopt.device = #zopt<placement gpu>
// CHECK: zprog.program for "gpu" {
// CHECK-NEXT: zprog.reduce_scatter grad : f32 accumulate f32
// CHECK-NEXT: zprog.all_gather grad : f32
// CHECK-NEXT: zprog.prepare on gpu
// CHECK-NEXT: zprog.norm_partials all on gpu
// CHECK-NEXT: zprog.norm
// CHECK-NEXT: zprog.update all on gpu
// CHECK-NEXT: zprog.finish on gpu
zopt.step @gpu attributes {gpu_arch = "sm_90"} {
  %p = zopt.state param : f32 on gpu
  %g = zopt.state grad : f32 on gpu
  %m = zopt.state exp_avg : f32 on gpu
  %lr = zopt.hyper lr
  %b1 = zopt.hyper beta1
  %gc = zopt.clip_by_global_norm %g max 1.0 : f32
  %m1 = zopt.ema %m, %gc, %b1 : f32, f32
  %p1 = zopt.apply %p, %m1, %lr : f32, f32
  zopt.yield %p1, %m1 into %p, %m : f32, f32 into f32, f32
}
