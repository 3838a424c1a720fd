// RUN: zopt-opt %s --pass-pipeline='builtin.module(gpu.module(zopt-gpu-precise-sqrt))' | FileCheck %s

// libdevice's square roots (sqrt.approx.f32 by default) become
// llvm.intr.sqrt, which NVPTX emits as the IEEE sqrt.rn, as on the CPU;
// the declarations left without a use are dropped.

// CHECK-LABEL: gpu.module @m
// CHECK-NOT: __nv_sqrt
// CHECK: llvm.func @k(%[[X:.+]]: f32, %[[Y:.+]]: f64) -> f32
// CHECK: llvm.intr.sqrt(%[[X]]) : (f32) -> f32
// CHECK: llvm.intr.sqrt(%[[Y]]) : (f64) -> f64
// CHECK-NOT: __nv_sqrt
gpu.module @m {
  llvm.func @__nv_sqrtf(f32) -> f32
  llvm.func @__nv_sqrt(f64) -> f64
  llvm.func @k(%x: f32, %y: f64) -> f32 {
    %a = llvm.call @__nv_sqrtf(%x) : (f32) -> f32
    %b = llvm.call @__nv_sqrt(%y) : (f64) -> f64
    llvm.return %a : f32
  }
}
