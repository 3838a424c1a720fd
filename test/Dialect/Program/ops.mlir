// RUN: zopt-opt %s --split-input-file | FileCheck %s
// RUN: zopt-opt %s --split-input-file | zopt-opt --split-input-file | FileCheck %s
// RUN: zopt-opt %s --split-input-file --mlir-print-op-generic | zopt-opt --split-input-file | FileCheck %s

// Every zprog op prints and parses back, in the custom and the generic form.

// A ZeRO-2 program with clipping: reduce into the owners' shards, the norm
// of the owned blocks, the owned update, the params gathered unless skipped.
// CHECK-LABEL: zprog.program for "zero2" {
// CHECK-NEXT: zprog.reduce_scatter grad : bf16 accumulate f32
// CHECK-NEXT: zprog.prepare on cpu
// CHECK-NEXT: zprog.norm_partials owned on cpu
// CHECK-NEXT: zprog.norm
// CHECK-NEXT: zprog.update owned on cpu
// CHECK-NEXT: zprog.all_gather param : bf16 unless_skipped
// CHECK-NEXT: zprog.finish on cpu
// CHECK-NEXT: }
zprog.program for "zero2" {
  zprog.reduce_scatter grad : bf16 accumulate f32
  zprog.prepare on cpu
  zprog.norm_partials owned on cpu
  zprog.norm
  zprog.update owned on cpu
  zprog.all_gather param : bf16 unless_skipped
  zprog.finish on cpu
}

// -----

// An offloaded ZeRO-0 step: copies in first, the all-reduce (reduce_scatter
// + all_gather of the grad), the update of every element on the host, the
// new params back unless skipped.
// CHECK-LABEL: zprog.program for "offload" {
// CHECK-NEXT: zprog.copy grad : f16 from gpu to cpu
// CHECK-NEXT: zprog.copy param : f32 from gpu to cpu
// CHECK-NEXT: zprog.reduce_scatter grad : f16 accumulate f32
// CHECK-NEXT: zprog.all_gather grad : f16
// CHECK-NEXT: zprog.prepare on cpu
// CHECK-NEXT: zprog.update all on cpu
// CHECK-NEXT: zprog.copy param : f32 from cpu to gpu unless_skipped
// CHECK-NEXT: zprog.finish on cpu
zprog.program for "offload" {
  zprog.copy grad : f16 from gpu to cpu
  zprog.copy param : f32 from gpu to cpu
  zprog.reduce_scatter grad : f16 accumulate f32
  zprog.all_gather grad : f16
  zprog.prepare on cpu
  zprog.update all on cpu
  zprog.copy param : f32 from cpu to gpu unless_skipped
  zprog.finish on cpu
}

// -----

// A GPU step: every op on the device.
// CHECK-LABEL: zprog.program for "gpu" {
// CHECK: zprog.norm_partials all on gpu
// CHECK: zprog.update all on gpu
// CHECK: zprog.finish on gpu
zprog.program for "gpu" {
  zprog.reduce_scatter grad : f32 accumulate f32
  zprog.all_gather grad : f32
  zprog.prepare on gpu
  zprog.norm_partials all on gpu
  zprog.norm
  zprog.update all on gpu
  zprog.finish on gpu
}
