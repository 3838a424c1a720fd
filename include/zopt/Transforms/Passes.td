//===- Passes.td - zopt passes -----------------------------*- tablegen -*-===//
#ifndef ZOPT_TRANSFORMS_PASSES_TD
#define ZOPT_TRANSFORMS_PASSES_TD

include "mlir/Pass/PassBase.td"

def ZoptDecompose : Pass<"zopt-decompose", "ModuleOp"> {
  let summary = "Expands named rules and primitives into per-element math";
  let description = [{
    Named rules (`zopt.adam`) become primitives; primitives become `arith`
    and `math` ops: f32 math per element, with the coefficients that depend
    only on hyperparameters and the step count computed in f64 from
    `zopt.hyper` / `zopt.global` values. `zopt.unscale` and
    `zopt.clip_by_global_norm` are left for `zopt-plan`.

    ```mlir
    %m1 = zopt.ema %m, %g, %b1 : f32, f32
    // becomes
    %one = arith.constant 1.0 : f64
    %c = arith.subf %one, %b1 : f64
    %b1f = arith.truncf %b1 : f64 to f32
    %cf = arith.truncf %c : f64 to f32
    %0 = arith.mulf %b1f, %m : f32
    %1 = arith.mulf %cf, %g : f32
    %m1 = arith.addf %0, %1 : f32
    ```
  }];
  let dependentDialects = ["::mlir::arith::ArithDialect", "::mlir::math::MathDialect"];
  let statistics = [
    Statistic<"numRules", "rules", "Named rules expanded">,
    Statistic<"numPrimitives", "primitives", "Primitives expanded">
  ];
}

def ZoptPlan : Pass<"zopt-plan", "ModuleOp"> {
  let summary = "Decides placement, partitioning and the global reductions";
  let description = [{
    Decides where the fused update runs (where the optimizer states live),
    records the ZeRO partition of the flat per-group buffers
    (`zopt.partition`), numbers the state and hyperparameter slots of the
    descriptor, and turns `zopt.clip_by_global_norm` and `zopt.unscale` into
    multiplications by runtime globals plus one `zopt.reduce_sumsq` over the
    value the global norm / non-finite check is taken of.

    ```mlir
    %gc = zopt.clip_by_global_norm %g max 1.0 : f32
    // becomes
    zopt.reduce_sumsq %g : f32
    %c = zopt.global clip_coef
    %cf = arith.truncf %c : f64 to f32
    %gc = arith.mulf %g, %cf : f32
    ```
  }];
  let dependentDialects = ["::mlir::arith::ArithDialect"];
}

def ZoptFuse : Pass<"zopt-fuse", "ModuleOp"> {
  let summary = "Splits the step into a descriptor, a prepare function and fused kernels";
  let description = [{
    Values that do not depend on any state are uniform per group: they move
    into `zk.prepare` (computed in f64 once per group and step) and reach
    the kernels as `zk.coeff` slots. What depends on state becomes the body
    of one `zk.kernel ... update` (one pass over memory) and, when the plan
    asked for a reduction, one `zk.kernel ... sumsq`.

    ```mlir
    zopt.step @s { ... }
    // becomes
    zk.descriptor {...}
    zk.prepare @s_prepare { ... }
    zk.kernel @s_update update { ... }
    ```
  }];
  let dependentDialects = ["::mlir::zk::ZKDialect", "::mlir::arith::ArithDialect"];
  let statistics = [
    Statistic<"numCoeffs", "coefficients", "Uniform values passed as coefficients">
  ];
}

def ConvertZKToCPU : Pass<"convert-zk-to-cpu", "ModuleOp"> {
  let summary = "Generates vectorized CPU functions from zk kernels";
  let description = [{
    Each `zk.kernel` becomes one function per ISA variant with the C ABI of
    runtime/include/zopt/abi.h: an `scf.for` over full vectors and a scalar
    tail. Update kernels take two registers' worth per iteration (32 x f32
    for AVX-512, 16 x f32 for AVX2), sum-of-squares kernels one. bf16 loads
    widen exactly by a shuffle with zero; bf16 stores round to nearest even
    in integer arithmetic (bit-exact, NaN-preserving) and pack two registers
    with one shuffle; f16 uses the hardware conversions. The `avx512bf16`
    variant (only for update kernels that store bf16) rounds with the
    hardware conversion instead, falling back to the integer form for a
    vector holding a subnormal. `zk.prepare` becomes an f64 host function,
    and `zk.descriptor` the exported `zopt_step_descriptor` constant.

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
    the coefficient table; `zk.prepare` is also compiled as a kernel. The
    kernel-table entries are recorded on the `zk.descriptor` for
    `convert-zk-to-cpu`, which must run after this pass.

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

def ZoptEmbedGPUBinaries : Pass<"zopt-embed-gpu-binaries", "ModuleOp"> {
  let summary = "Turns gpu.binary objects into exported byte arrays of step.so";
  let description = [{
    After `gpu-module-to-binary` with `format=isa` (PTX): with `toolkit`
    set, each object's PTX is compiled by the toolkit's `ptxas` (for the
    object's chip, `--opt-level` of its target) and packed with the PTX by
    `fatbinary --compress=false` (CUDA 13's fatbinary compresses the PTX
    with zstd by default, which drivers older than CUDA 13 cannot read;
    uncompressed, the PTX can be JIT-compiled by any driver that knows its
    ISA version). Every object of `gpu.binary @<m>` for
    `#nvvm.target<chip = "sm_XX">` becomes the exported constant byte array
    `<m>_sm_XX` plus `const uint64_t <m>_sm_XX_size` and, for fatbinaries,
    `const uint32_t <m>_sm_XX_cuda_version` (the toolkit's CUDA version,
    1000 * major + 10 * minor, e.g. 13000): the symbols the descriptor's
    GPU_IMAGE entries name (abi.h "GPU kernels"). Without `toolkit` the
    objects are embedded as they are (PTX text for `--emit=ptx`).
  }];
  let options = [
    Option<"toolkit", "toolkit", "std::string", "\"\"",
           "CUDA toolkit whose ptxas and fatbinary build the fatbinaries "
           "(empty: embed the objects unchanged)">
  ];
  let dependentDialects = ["::mlir::LLVM::LLVMDialect"];
}

def ZoptGPUPreciseSqrt : Pass<"zopt-gpu-precise-sqrt", "::mlir::gpu::GPUModuleOp"> {
  let summary = "IEEE square roots in GPU kernels (after convert-gpu-to-nvvm)";
  let description = [{
    libdevice's `__nv_sqrtf` is `sqrt.approx.f32` by default; the CPU kernels
    use the correctly rounded square root. Calls to `__nv_sqrtf` and
    `__nv_sqrt` become `llvm.intr.sqrt`, which NVPTX emits as `sqrt.rn`.
  }];
  let dependentDialects = ["::mlir::LLVM::LLVMDialect"];
}

def ZoptSetTargetAttrs : Pass<"zopt-set-target-attrs", "ModuleOp"> {
  let summary = "Moves the ISA of each function onto its llvm.func target attributes";
  let description = [{
    After conversion to the LLVM dialect, a function tagged
    `zopt.isa = "avx512"` gets `target_cpu = "x86-64-v4"` (and a 512-bit
    minimum legal vector width), `"avx512bf16"` the same plus the
    `+avx512bf16` target feature, `"avx2"` gets `x86-64-v3`: one object file
    carries every variant and the runtime picks by CPU features.

    ```mlir
    llvm.func @k_avx2(...) attributes {target_cpu = "x86-64-v3"}
    ```
  }];
}

#endif
