//===- Passes.td - zopt's target passes --------------------*- tablegen -*-===//
//
// include/zopt/Target/ owns what turns the converted module into the parts
// of step.so the runtime reads: the exported descriptor (Descriptor/), the
// per-function CPU target attributes (CPU/), the CUDA fatbinaries and the
// toolkit that builds them (CUDA/), and LLVM IR, objects and linking
// (Emit.h).
//
//===----------------------------------------------------------------------===//
#ifndef ZOPT_TARGET_PASSES_TD
#define ZOPT_TARGET_PASSES_TD

include "mlir/Pass/PassBase.td"

def ZoptEmitDescriptor : Pass<"zopt-emit-descriptor", "ModuleOp"> {
  let summary = "Writes abi.h's step descriptor as the exported zopt_step_descriptor";
  let description = [{
    The one writer of the descriptor the runtime reads
    (runtime/include/zopt/abi.h, `zopt_step_descriptor`): the
    `zk.descriptor` (states, hyperparameter slots, flags; made by
    `zopt-fuse`), the kernel table the conversions recorded on it
    (`cpu_kernels` by `convert-zk-to-cpu`, then `gpu_kernels` and
    `gpu_images` by `convert-zk-to-gpu`) and the step program (the
    `zprog.program` made by `zopt-plan`, checked against the step: moved
    types, sharded states, the norm a clipped or loss-scaled step needs)
    become one exported constant byte array with its checksum. Both ops are
    erased. Runs after the conversions, for CPU and GPU steps alike.

    ```mlir
    zk.descriptor {name = "t", ..., cpu_kernels = [[1 : i32, 0 : i32, "t_prepare"], ...]}
    zprog.program for "t" { ... }
    // becomes
    llvm.mlir.global external constant @zopt_step_descriptor("ZOPTDSC1...")
    ```
  }];
  let dependentDialects = ["::mlir::LLVM::LLVMDialect"];
}

def ZoptSetTargetAttrs : Pass<"zopt-set-target-attrs", "ModuleOp"> {
  let summary = "Moves the ISA of each function onto its llvm.func target attributes";
  let description = [{
    After conversion to the LLVM dialect, a function whose name ends in
    `_avx512` (convert-zk-to-cpu names each variant `<kernel>_<isa>`) gets
    `target_cpu = "x86-64-v4"` (and a 512-bit minimum legal vector width),
    `_avx512bf16` the same plus the `+avx512bf16` target feature, `_avx2`
    gets `x86-64-v3`: one object file carries every variant and the runtime
    picks by CPU features.

    ```mlir
    llvm.func @k_avx2(...) attributes {target_cpu = "x86-64-v3"}
    ```
  }];
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
    objects are embedded as they are (PTX text for `--emit=ptx`). The
    toolkit is driven by include/zopt/Target/CUDA/Toolkit.h.

    ```mlir
    gpu.binary @s_gpu [#gpu.object<#nvvm.target<chip = "sm_90">, assembly = "...">]
    // becomes
    llvm.mlir.global external constant @s_gpu_sm_90_cuda_version(13000 : i32)
    llvm.mlir.global external constant @s_gpu_sm_90("P\EDU\BA...")
    llvm.mlir.global external constant @s_gpu_sm_90_size(3672 : i64)
    ```
  }];
  let options = [
    Option<"toolkit", "toolkit", "std::string", "\"\"",
           "CUDA toolkit whose ptxas and fatbinary build the fatbinaries "
           "(empty: embed the objects unchanged)">
  ];
  let dependentDialects = ["::mlir::LLVM::LLVMDialect"];
}

#endif
