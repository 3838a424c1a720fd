//===- Pipelines.h - zopt's named compilation phases ------------*- C++ -*-===//
//
// include/zopt/Pipelines/ owns the order of the passes: the named phases
// (input, decompose, plan, fuse, codegen) that zopt-compile --compile-to,
// zopt-opt --zopt-pipeline and the fuzz targets all build with
// buildPipeline.
//
//===----------------------------------------------------------------------===//
#ifndef ZOPT_PIPELINES_PIPELINES_H
#define ZOPT_PIPELINES_PIPELINES_H

#include "mlir/Pass/PassManager.h"
#include "mlir/Pass/PassOptions.h"

#include <optional>
#include <string>
#include <vector>

namespace mlir::zopt {

/// The phases of the compilation, in order. `zopt-compile --compile-to=P`
/// and `zopt-opt --zopt-pipeline="compile-to=P"` stop after phase P.
enum class Phase { Input, Decompose, Plan, Fuse, Codegen };
std::optional<Phase> parsePhase(llvm::StringRef name);
llvm::StringRef phaseName(Phase p);

struct PipelineOptions : public PassPipelineOptions<PipelineOptions> {
  Option<std::string> compileTo{
      *this, "compile-to",
      llvm::cl::desc("Last phase: input, decompose, plan, fuse, codegen"),
      llvm::cl::init("codegen")};
  ListOption<std::string> isas{
      *this, "isas", llvm::cl::desc("CPU ISA variants: avx512, avx2")};
  ListOption<std::string> gpu{
      *this, "gpu", llvm::cl::desc("CUDA architectures, e.g. sm_80,sm_90")};
  Option<std::string> cudaPath{
      *this, "cuda-path", llvm::cl::desc("CUDA toolkit directory"),
      llvm::cl::init("")};
};

/// GPU code generation: empty `chips` means a CPU-only compile.
struct GpuOptions {
  std::vector<std::string> chips; // e.g. sm_80, sm_90
  std::string toolkitPath;        // CUDA toolkit (ptxas, fatbinary, libdevice)
  std::string format = "fatbin";  // fatbin: cubin + PTX per chip; isa: PTX only
};

/// Adds the passes of every phase up to and including `last`.
void buildPipeline(OpPassManager &pm, Phase last, ArrayRef<std::string> isas,
                   const GpuOptions &gpu = {});

/// Registers `zopt-pipeline` for zopt-opt.
void registerPipelines();

} // namespace mlir::zopt

#endif
