//===- Passes.td - zopt's conversions ----------------------*- tablegen -*-===//
//
// include/zopt/Conversion/ owns the lowerings out of the zk dialect, one
// folder per lowering (ZKToCPU/, ZKToGPU/), with their shared kernel-body
// emission in lib/Conversion/ZKCommon/ (as MLIR's GPUCommon). What the
// runtime reads (the descriptor) is written by lib/Target/, not here.
//
//===----------------------------------------------------------------------===//
#ifndef ZOPT_CONVERSION_PASSES_TD
#define ZOPT_CONVERSION_PASSES_TD

include "mlir/Pass/PassBase.td"

//===----------------------------------------------------------------------===//
// ZKToCPU
//===----------------------------------------------------------------------===//

def ConvertZKToCPU : Pass<"convert-zk-to-cpu", "ModuleOp"> {
  let summary = "Generates vectorized CPU functions from zk kernels";
  let description = [{
    Each `zk.kernel` becomes one function per ISA variant with the C ABI of
    runtime/include/zopt/abi.h: an `scf.for` over full vectors and a tail.
    Update kernels take two registers' worth per iteration (32 x f32 for
    AVX-512, 16 x f32 for AVX2), their tail masked steps of one register
    on AVX-512 and a scalar loop on AVX2; sum-of-squares kernels one
    masked iteration. bf16 loads
    widen exactly by a shuffle with zero; bf16 stores round to nearest even
    in integer arithmetic (bit-exact, NaN-preserving) and pack two registers
    with one shuffle; f16 uses the hardware conversions. The `avx512bf16`
    variant (only for update kernels that store bf16) rounds with the
    hardware conversion instead, falling back to the integer form for a
    vector holding a subnormal. `zk.prepare` becomes an f64 host function.
    The functions' kernel-table entries are recorded on the `zk.descriptor`
    (`cpu_kernels`) for `zopt-emit-descriptor`.

    ```mlir
    zk.kernel @k update { ... }
    // becomes
    func.func @k_avx512(%states: !llvm.ptr, %n: i64, %coeffs: !llvm.ptr)
    func.func @k_avx2(%states: !llvm.ptr, %n: i64, %coeffs: !llvm.ptr)
    ```
  }];
  let options = [
    ListOption<"isas", "isas", "std::string",
               "ISA variants to emit: avx512bf16, avx512, avx2 (default: all)">
  ];
  let dependentDialects = ["::mlir::func::FuncDialect", "::mlir::scf::SCFDialect",
                           "::mlir::LLVM::LLVMDialect", "::mlir::vector::VectorDialect",
                           "::mlir::arith::ArithDialect", "::mlir::math::MathDialect"];
}

//===----------------------------------------------------------------------===//
// ZKToGPU
//===----------------------------------------------------------------------===//

def ConvertZKToGPU : Pass<"convert-zk-to-gpu", "ModuleOp"> {
  let summary = "Generates one CUDA module (gpu.module) from the zk kernels of a GPU step";
  let description = [{
    Runs only when the optimizer states live on the GPU (the descriptor's
    placements); a CPU step is left to `convert-zk-to-cpu`. Every
    `zk.kernel` becomes a `gpu.func` kernel in `gpu.module @<step>_gpu`
    (one `#nvvm.target` per chip) with the launch ABI of abi.h's "GPU
    kernels" section: UPDATE is one persistent grid-stride launch over a
    segment table with 16-byte vector accesses and a scalar tail; SUMSQ is a
    two-stage f64 reduction (block partials, last-block-done) that writes the
    norm, clip coefficient and skip flag to a device buffer and recomputes
    the coefficient table; `zk.prepare` is also compiled as a kernel (the
    host keeps it for `convert-zk-to-cpu`, which runs after this pass). The
    kernel-table entries are recorded on the `zk.descriptor`
    (`gpu_kernels`, `gpu_images`) for `zopt-emit-descriptor`.

    ```mlir
    zk.kernel @s_update update { ... }
    // becomes
    gpu.module @s_gpu [#nvvm.target<O = 3, chip = "sm_90", features = "+ptx80">] {
      gpu.func @s_update(%states: !llvm.ptr, %segs: !llvm.ptr, %n: i64,
                         %coeffs: !llvm.ptr, %sg: !llvm.ptr) kernel { ... }
    }
    ```
  }];
  let options = [
    ListOption<"chips", "chips", "std::string",
               "CUDA architectures to compile for, e.g. sm_80,sm_90">,
    Option<"features", "features", "std::string", "\"+ptx80\"",
           "PTX features of every target">
  ];
  let dependentDialects = ["::mlir::gpu::GPUDialect", "::mlir::NVVM::NVVMDialect",
                           "::mlir::scf::SCFDialect", "::mlir::LLVM::LLVMDialect",
                           "::mlir::memref::MemRefDialect",
                           "::mlir::arith::ArithDialect", "::mlir::math::MathDialect"];
}

def ZoptGPUPreciseSqrt : Pass<"zopt-gpu-precise-sqrt", "::mlir::gpu::GPUModuleOp"> {
  let summary = "IEEE square roots in GPU kernels (after convert-gpu-to-nvvm)";
  let description = [{
    libdevice's `__nv_sqrtf` is `sqrt.approx.f32` by default; the CPU kernels
    use the correctly rounded square root. Calls to `__nv_sqrtf` and
    `__nv_sqrt` become `llvm.intr.sqrt`, which NVPTX emits as `sqrt.rn`.

    ```mlir
    %r = llvm.call @__nv_sqrtf(%x) : (f32) -> f32
    // becomes
    %r = llvm.intr.sqrt(%x) : (f32) -> f32
    ```
  }];
  let dependentDialects = ["::mlir::LLVM::LLVMDialect"];
}

#endif
