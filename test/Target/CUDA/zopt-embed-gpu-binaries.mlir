// RUN: zopt-opt %s --zopt-embed-gpu-binaries | FileCheck %s --check-prefix=ASIS
// RUN: %if cuda-toolkit %{ zopt-opt %s --zopt-embed-gpu-binaries=toolkit=%cuda_root | FileCheck %s --check-prefix=FATBIN %}

// Every object of a gpu.binary becomes the exported byte array
// <binary>_<chip> and its size; the module stops being a GPU container.
// Without a toolkit the object is embedded as it is (the PTX of
// --emit=ptx); with one, ptxas and fatbinary turn the PTX into a fatbinary
// (magic 0xBA55ED50, little-endian: P \ED U \BA) holding the cubin and the
// PTX, and the toolkit's CUDA version is exported beside it.

// ASIS-NOT: gpu.container_module
// ASIS-NOT: gpu.binary
// ASIS: llvm.mlir.global external constant @s_gpu_sm_90(".version 8.0\0A{{.+}}") {addr_space = 0 : i32, alignment = 16 : i64}
// ASIS-NEXT: llvm.mlir.global external constant @s_gpu_sm_90_size(74 : i64)
// ASIS-NOT: cuda_version

// FATBIN-NOT: gpu.binary
// FATBIN: llvm.mlir.global external constant @s_gpu_sm_90_cuda_version({{[1-9][0-9]*}}0 : i32)
// FATBIN-NEXT: llvm.mlir.global external constant @s_gpu_sm_90("P\EDU\BA
// FATBIN-NEXT: llvm.mlir.global external constant @s_gpu_sm_90_size({{[0-9]+}} : i64)
module attributes {gpu.container_module} {
  gpu.binary @s_gpu [#gpu.object<#nvvm.target<chip = "sm_90">, assembly = ".version 8.0\0A.target sm_90\0A.address_size 64\0A.visible .entry k()\0A{\0A\09ret;\0A}\0A">]
}
