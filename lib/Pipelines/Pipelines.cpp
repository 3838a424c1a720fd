//===- Pipelines.cpp - zopt's named compilation phases --------------------===//
#include "zopt/Pipelines/Pipelines.h"

#include "mlir/Conversion/ArithToLLVM/ArithToLLVM.h"
#include "mlir/Conversion/ControlFlowToLLVM/ControlFlowToLLVM.h"
#include "mlir/Conversion/FuncToLLVM/ConvertFuncToLLVMPass.h"
#include "mlir/Conversion/GPUToNVVM/GPUToNVVMPass.h"
#include "mlir/Dialect/GPU/Transforms/Passes.h"
#include "mlir/Conversion/MathToLLVM/MathToLLVM.h"
#include "mlir/Conversion/ReconcileUnrealizedCasts/ReconcileUnrealizedCasts.h"
#include "mlir/Conversion/SCFToControlFlow/SCFToControlFlow.h"
#include "mlir/Conversion/VectorToLLVM/ConvertVectorToLLVMPass.h"
#include "mlir/Pass/PassRegistry.h"
#include "mlir/Transforms/Passes.h"
#include "zopt/Conversion/Passes.h"
#include "zopt/Dialect/Zopt/Transforms/Passes.h"
#include "zopt/Target/CUDA/Toolkit.h"
#include "zopt/Target/Passes.h"


using namespace mlir;
using namespace mlir::zopt;

static const char *const kPhaseNames[] = {"input", "decompose", "plan", "fuse",
                                          "codegen"};

std::optional<Phase> mlir::zopt::parsePhase(StringRef name) {
  for (unsigned i = 0; i < std::size(kPhaseNames); ++i)
    if (name == kPhaseNames[i])
      return Phase(i);
  return std::nullopt;
}

StringRef mlir::zopt::phaseName(Phase p) { return kPhaseNames[int(p)]; }

void mlir::zopt::buildPipeline(OpPassManager &pm, Phase last,
                               ArrayRef<std::string> isas,
                               const GpuOptions &gpu) {
  // input: parsing and verification happen before any pass.
  if (last < Phase::Decompose)
    return;
  pm.addPass(createZoptDecompose());
  pm.addPass(createCanonicalizerPass());
  pm.addPass(createCSEPass());
  if (last < Phase::Plan)
    return;
  pm.addPass(createZoptPlan());
  pm.addPass(createCSEPass());
  if (last < Phase::Fuse)
    return;
  pm.addPass(createZoptFuse());
  pm.addPass(createCanonicalizerPass());
  pm.addPass(createCSEPass());
  if (last < Phase::Codegen)
    return;
  if (!gpu.chips.empty()) {
    ConvertZKToGPUOptions g;
    g.chips = llvm::to_vector(gpu.chips);
    pm.addPass(createConvertZKToGPU(g));
  }
  ConvertZKToCPUOptions cpu;
  cpu.isas = llvm::to_vector(isas);
  pm.addPass(createConvertZKToCPU(cpu));
  pm.addPass(createZoptEmitDescriptor());
  pm.addPass(createCanonicalizerPass());
  pm.addPass(createSCFToControlFlowPass());
  if (!gpu.chips.empty()) {
    // Device code: NVVM, then PTX per chip (gpu-module-to-binary, format
    // isa), then cubin (ptxas) + PTX in an uncompressed fatbinary per chip
    // (zopt-embed-gpu-binaries runs the toolkit's tools itself: MLIR's own
    // fatbinary call cannot pass --compress=false), embedded as byte arrays.
    // An explicit toolkit path makes a missing libdevice a hard error (never
    // an unresolved call).
    pm.addNestedPass<gpu::GPUModuleOp>(createConvertGpuOpsToNVVMOps());
    pm.addNestedPass<gpu::GPUModuleOp>(createZoptGPUPreciseSqrt());
    pm.addNestedPass<gpu::GPUModuleOp>(createReconcileUnrealizedCastsPass());
    GpuModuleToBinaryPassOptions bin;
    // Never empty: without a path, libdevice would be skipped silently.
    bin.toolkitPath = gpu.toolkitPath;
    if (bin.toolkitPath.empty())
      bin.toolkitPath = cuda::defaultToolkitPath();
    bin.compilationTarget = "isa";
    pm.addPass(createGpuModuleToBinaryPass(bin));
    ZoptEmbedGPUBinariesOptions embed;
    if (gpu.format == "fatbin")
      embed.toolkit = bin.toolkitPath;
    pm.addPass(createZoptEmbedGPUBinaries(embed));
  }
  pm.addPass(createConvertVectorToLLVMPass());
  pm.addPass(createConvertMathToLLVMPass());
  pm.addPass(createArithToLLVMConversionPass());
  pm.addPass(createConvertFuncToLLVMPass());
  pm.addPass(createConvertControlFlowToLLVMPass());
  pm.addPass(createReconcileUnrealizedCastsPass());
  pm.addPass(createZoptSetTargetAttrs());
}

void mlir::zopt::registerPipelines() {
  PassPipelineRegistration<PipelineOptions>(
      "zopt-pipeline",
      "zopt's phases up to compile-to (input, decompose, plan, fuse, codegen)",
      [](OpPassManager &pm, const PipelineOptions &opts) {
        auto phase = parsePhase(opts.compileTo);
        if (!phase) {
          llvm::errs() << "zopt-pipeline: unknown phase '" << opts.compileTo
                       << "'\n";
          phase = Phase::Codegen;
        }
        GpuOptions gpu;
        gpu.chips.assign(opts.gpu.begin(), opts.gpu.end());
        gpu.toolkitPath = opts.cudaPath;
        buildPipeline(pm, *phase, llvm::to_vector(opts.isas), gpu);
      });
}
