//===- FuzzRunner.h - one description through zopt-compile's path ---------===//
//
// Shared by the fuzz targets: parseDescription (limits, parse,
// description-level rules, verifier, warnings), then every phase (decompose,
// plan, fuse, codegen for the three CPU variants; for GPU-placed states,
// PTX through the NVPTX backend when a CUDA toolkit's libdevice is there,
// else the phases up to fuse), then LLVM IR and O3.
//
// ZOPT_FUZZ_STRICT=1 also aborts when a description the verifier accepted
// fails in a later phase (the verifier should have refused it, with a
// located error, instead). ZOPT_FUZZ_VERBOSE=1 prints the diagnostics.
//
//===----------------------------------------------------------------------===//
#ifndef ZOPT_FUZZ_RUNNER_H
#define ZOPT_FUZZ_RUNNER_H

#include "mlir/Dialect/Arith/IR/Arith.h"
#include "mlir/Dialect/Func/IR/FuncOps.h"
#include "mlir/Dialect/GPU/IR/GPUDialect.h"
#include "mlir/Dialect/LLVMIR/LLVMDialect.h"
#include "mlir/Dialect/LLVMIR/NVVMDialect.h"
#include "mlir/Dialect/Math/IR/Math.h"
#include "mlir/Dialect/SCF/IR/SCF.h"
#include "mlir/Dialect/Vector/IR/VectorOps.h"
#include "mlir/IR/MLIRContext.h"
#include "mlir/InitAllExtensions.h"
#include "mlir/Pass/PassManager.h"
#include "mlir/Target/LLVM/NVVM/Target.h"
#include "mlir/Target/LLVMIR/Dialect/All.h"
#include "llvm/Support/FileSystem.h"
#include "llvm/Support/SourceMgr.h"
#include "zopt/Dialect/Program/IR/ProgramOps.h"
#include "zopt/Dialect/ZK/IR/ZKOps.h"
#include "zopt/Dialect/Zopt/IR/ZoptDescription.h"
#include "zopt/Dialect/Zopt/IR/ZoptOps.h"
#include "zopt/Pipelines/Pipelines.h"
#include "zopt/Target/Emit.h"

#include <cstdint>
#include <cstdlib>

/// ASan defaults of the fuzz targets. allow_user_poisoning=0: LLVM's
/// BumpPtrAllocator poisons a new slab when ASan is on, in code compiled
/// into the instrumented zopt libraries (inline allocator functions reached
/// from attribute storage constructors), and libMLIR.so, which is not
/// instrumented, then hands out memory from that slab without unpoisoning
/// it: a false "use-after-poison" in StringAttr::get (seen in Fuse).
/// ASan's own checks of heap, stack and globals stay on.
extern "C" const char *__asan_default_options() {
  return "allow_user_poisoning=0:detect_leaks=1";
}

namespace zopt_fuzz {
using namespace mlir;

inline DialectRegistry &registry() {
  static DialectRegistry *r = [] {
    auto *reg = new DialectRegistry();
    registerAllExtensions(*reg);
    registerAllToLLVMIRTranslations(*reg);
    NVVM::registerNVVMTargetInterfaceExternalModels(*reg);
    return reg;
  }();
  return *r;
}

/// The CUDA toolkit, if it has libdevice (PTX needs no ptxas).
inline const std::string &cudaToolkit() {
  static std::string tk = [] {
    std::string t = "/usr/local/cuda";
    if (const char *env = std::getenv("CUDA_HOME"); env && *env)
      t = env;
    return llvm::sys::fs::exists(t + "/nvvm/libdevice/libdevice.10.bc")
               ? t
               : std::string();
  }();
  return tk;
}

inline bool strict() {
  static bool s = [] {
    const char *e = std::getenv("ZOPT_FUZZ_STRICT");
    return e && *e && *e != '0';
  }();
  return s;
}

/// Runs one description through zopt-compile's path; a diagnostic is a
/// normal outcome, a crash or sanitizer report is a finding.
inline int runDescription(llvm::StringRef text) {
  MLIRContext ctx(registry(), MLIRContext::Threading::DISABLED);
  ctx.loadDialect<gpu::GPUDialect, NVVM::NVVMDialect, zopt::ZoptDialect,
                  zprog::ZProgDialect, zk::ZKDialect, arith::ArithDialect,
                  math::MathDialect, func::FuncDialect, scf::SCFDialect,
                  vector::VectorDialect, LLVM::LLVMDialect>();
  ctx.printOpOnDiagnostic(false);
  // Diagnostics are expected output for bad inputs: count them, print
  // nothing (ZOPT_FUZZ_VERBOSE=1 prints them).
  static bool verbose = std::getenv("ZOPT_FUZZ_VERBOSE") != nullptr;
  llvm::SourceMgr sm;
  sm.AddNewSourceBuffer(
      llvm::MemoryBuffer::getMemBufferCopy(text, "input"),
      llvm::SMLoc());
  std::unique_ptr<SourceMgrDiagnosticHandler> printer;
  std::unique_ptr<ScopedDiagnosticHandler> quiet;
  if (verbose)
    printer = std::make_unique<SourceMgrDiagnosticHandler>(sm, &ctx);
  else
    quiet = std::make_unique<ScopedDiagnosticHandler>(
        &ctx, [](Diagnostic &) { return success(); });
  zopt::registerDescriptionHints(&ctx);

  OwningOpRef<ModuleOp> module = zopt::parseDescription(sm, &ctx);
  if (!module)
    return 0;

  // Where the kernels run, as zopt-compile decides it.
  const bool onGpu = zopt::kernelsOnGpu(*module);
  std::string arch = "sm_90";
  module->walk([&](zopt::StepOp step) {
    if (auto a = step.getGpuArch())
      arch = a->str();
  });
  zopt::Phase last = zopt::Phase::Codegen;
  zopt::GpuOptions gpu;
  if (onGpu) {
    if (cudaToolkit().empty()) {
      last = zopt::Phase::Fuse;
    } else {
      gpu.chips = {arch};
      gpu.toolkitPath = cudaToolkit();
      gpu.format = "isa"; // PTX in process, no ptxas
    }
  }
  PassManager pm(&ctx);
  zopt::buildPipeline(pm, last, {"avx512bf16", "avx512", "avx2"}, gpu);
  if (failed(pm.run(*module))) {
    if (strict()) {
      llvm::errs() << "zopt-fuzz-description: a verified description failed "
                      "in a later phase (ZOPT_FUZZ_STRICT)\n";
      std::abort();
    }
    return 0;
  }
  if (last < zopt::Phase::Codegen)
    return 0;
  llvm::LLVMContext llctx;
  std::unique_ptr<llvm::Module> llmod = zopt::translateAndOptimize(*module, llctx);
  if (!llmod && strict()) {
    llvm::errs() << "zopt-fuzz-description: LLVM IR translation failed "
                    "(ZOPT_FUZZ_STRICT)\n";
    std::abort();
  }
  return 0;
}

} // namespace zopt_fuzz

#endif
