//===- zopt-compile.cpp - step.mlir -> step.so ----------------------------===//
//
//   zopt-compile step.mlir -o step.so
//   zopt-compile step.mlir --compile-to=fuse          (print MLIR after fuse)
//   zopt-compile step.mlir --emit=asm --cpu=x86-64-v3 -o -
//
//===----------------------------------------------------------------------===//
#include "mlir/Dialect/Arith/IR/Arith.h"
#include "mlir/Dialect/Func/IR/FuncOps.h"
#include "mlir/Dialect/GPU/IR/GPUDialect.h"
#include "mlir/Dialect/LLVMIR/NVVMDialect.h"
#include "mlir/InitAllExtensions.h"
#include "mlir/Target/LLVMIR/Dialect/All.h"
#include "mlir/Target/LLVM/NVVM/Target.h"
#include "mlir/Dialect/LLVMIR/LLVMDialect.h"
#include "mlir/Dialect/Math/IR/Math.h"
#include "mlir/Dialect/SCF/IR/SCF.h"
#include "mlir/Dialect/Vector/IR/VectorOps.h"
#include "mlir/IR/AsmState.h"
#include "mlir/IR/MLIRContext.h"
#include "mlir/Parser/Parser.h"
#include "mlir/Pass/PassManager.h"
#include "mlir/Support/FileUtilities.h"
#include "mlir/Support/Timing.h"
#include "llvm/Support/CommandLine.h"
#include "llvm/Support/FileSystem.h"
#include "llvm/Support/InitLLVM.h"
#include "llvm/Support/Path.h"
#include "llvm/Support/SourceMgr.h"
#include "llvm/Support/ToolOutputFile.h"
#include "llvm/Support/thread.h"
#include "zopt/Dialect/Program/IR/ProgramOps.h"
#include "zopt/Dialect/ZK/IR/ZKOps.h"
#include "zopt/Dialect/Zopt/IR/ZoptDescription.h"
#include "zopt/Dialect/Zopt/IR/ZoptOps.h"
#include "zopt/Pipelines/Pipelines.h"
#include "zopt/Target/CUDA/Toolkit.h"
#include "zopt/Target/Emit.h"

using namespace mlir;
namespace cl = llvm::cl;

static cl::OptionCategory cat("zopt-compile options");
static cl::opt<std::string> inputFile(cl::Positional, cl::desc("<step.mlir>"),
                                      cl::init("-"), cl::cat(cat));
static cl::opt<std::string> outputFile("o", cl::desc("Output file ('-': stdout)"),
                                       cl::value_desc("file"), cl::init(""),
                                       cl::cat(cat));
static cl::opt<std::string>
    emitKind("emit", cl::desc("What to write: mlir, llvm, asm, obj, so (default), "
                             "ptx (the GPU kernels of the first --gpu chip)"),
             cl::init("so"), cl::cat(cat));
static cl::opt<std::string> compileTo(
    "compile-to",
    cl::desc("Stop after a phase and print its MLIR: input, decompose, plan, "
             "fuse, codegen"),
    cl::init(""), cl::cat(cat));
static cl::opt<std::string>
    cpu("cpu",
        cl::desc("CPU variants to emit: auto (AVX-512 with AVX512_BF16, "
                 "AVX-512 and AVX2, the best picked at load time), "
                 "avx512bf16 (that one only), x86-64-v4 (AVX-512 only), "
                 "x86-64-v3 (AVX2 only)"),
        cl::init("auto"), cl::cat(cat));
static cl::list<std::string>
    gpuArchs("gpu",
             cl::desc("CUDA architectures for GPU-placed states, e.g. "
                      "--gpu=sm_80,sm_90 (default: the step's gpu_arch)"),
             cl::CommaSeparated, cl::cat(cat));
static cl::opt<std::string>
    cudaPath("cuda-path",
             cl::desc("CUDA toolkit (ptxas, fatbinary, nvvm/libdevice); "
                      "default: $CUDA_HOME, else /usr/local/cuda"),
             cl::init(""), cl::cat(cat));
static cl::opt<bool> timing("timing", cl::desc("Report the time of each phase"),
                            cl::init(false), cl::cat(cat));
static cl::opt<std::string> sourceName(
    "source-name",
    cl::desc("Name of the input in diagnostics (default: the file name, "
             "'<stdin>' for '-')"),
    cl::value_desc("name"), cl::init(""), cl::cat(cat));

static int fail(const llvm::Twine &msg) {
  llvm::errs() << "zopt-compile: error: " << msg << "\n";
  return 1;
}

static LogicalResult writeOutput(StringRef path, StringRef data, bool binary) {
  std::string err;
  auto out = openOutputFile(path.empty() ? "-" : path, &err);
  if (!out) {
    llvm::errs() << "zopt-compile: error: " << err << "\n";
    return failure();
  }
  (void)binary;
  out->os() << data;
  out->keep();
  return success();
}

static int compile();

int main(int argc, char **argv) {
  llvm::InitLLVM init(argc, argv);
  cl::HideUnrelatedOptions(cat);
  cl::ParseCommandLineOptions(
      argc, argv,
      "zopt-compile: compiles a zopt.step description into step.so\n\n"
      "  zopt-compile step.mlir -o step.so\n");
  // Parse and compile on a thread with a known, large stack: the input's
  // bracket nesting is bounded before parsing (docs/Dialects/Zopt.md,
  // "Limits"), and recursion the bound does not count stays far from the
  // end of this stack.
  int rc = 1;
  llvm::thread worker(std::optional<unsigned>(zopt::kDriverStackBytes), [&rc] { rc = compile(); });
  worker.join();
  return rc;
}

static int compile() {
  std::vector<std::string> isas;
  if (cpu == "auto")
    isas = {"avx512bf16", "avx512", "avx2"};
  else if (cpu == "avx512bf16")
    isas = {"avx512bf16"};
  else if (cpu == "x86-64-v4" || cpu == "avx512")
    isas = {"avx512"};
  else if (cpu == "x86-64-v3" || cpu == "avx2")
    isas = {"avx2"};
  else
    return fail("unknown --cpu='" + cpu +
                "'; expected auto, avx512bf16, x86-64-v4 or x86-64-v3");

  std::optional<zopt::Phase> last;
  if (!compileTo.empty()) {
    last = zopt::parsePhase(compileTo);
    if (!last)
      return fail("unknown --compile-to='" + compileTo +
                  "'; expected input, decompose, plan, fuse or codegen");
    if (emitKind.getNumOccurrences() && emitKind != "mlir")
      return fail("--compile-to prints MLIR; it cannot be combined with --emit=" +
                  emitKind);
  }
  if (!last && !llvm::is_contained({"mlir", "llvm", "asm", "obj", "so", "ptx"},
                                   std::string(emitKind)))
    return fail("unknown --emit='" + emitKind +
                "'; expected mlir, llvm, asm, obj, so or ptx");
  if (!last && emitKind == "so" && (outputFile.empty() || outputFile == "-"))
    return fail("--emit=so needs an output file: -o step.so");
  for (const std::string &chip : gpuArchs)
    if (!zopt::isKnownGpuArch(chip))
      return fail("unknown --gpu='" + chip +
                  "'; expected CUDA architectures among " +
                  zopt::knownGpuArchs());

  DefaultTimingManager tm;
  tm.setEnabled(timing);
  TimingScope root = tm.getRootScope();

  DialectRegistry registry;
  registerAllExtensions(registry);
  registerAllToLLVMIRTranslations(registry);
  NVVM::registerNVVMTargetInterfaceExternalModels(registry);
  MLIRContext ctx(registry);
  ctx.loadDialect<gpu::GPUDialect, NVVM::NVVMDialect, zopt::ZoptDialect,
                  zprog::ZProgDialect, zk::ZKDialect, arith::ArithDialect,
                  math::MathDialect, func::FuncDialect, scf::SCFDialect,
                  vector::VectorDialect, LLVM::LLVMDialect>();
  // Diagnostics name the description's line and column and show its line;
  // the failing op's generic form is not appended (it is not what the user
  // wrote).
  ctx.printOpOnDiagnostic(false);
  llvm::SourceMgr sm;
  SourceMgrDiagnosticHandler diag(sm, &ctx);
  zopt::registerDescriptionHints(&ctx);
  std::string err;
  auto file = openInputFile(inputFile, &err);
  if (!file)
    return fail(err);
  if (!sourceName.empty())
    file = llvm::MemoryBuffer::getMemBufferCopy(file->getBuffer(), sourceName);
  sm.AddNewSourceBuffer(std::move(file), llvm::SMLoc());

  OwningOpRef<ModuleOp> module;
  {
    TimingScope t = root.nest("parse + verify (input)");
    module = zopt::parseDescription(sm, &ctx);
  }
  if (!module)
    return 1; // diagnostics already printed with their locations

  // GPU: the architectures of --gpu, else the step's gpu_arch; the toolkit
  // is checked up front when a state is on the GPU.
  zopt::GpuOptions gpuOpts;
  gpuOpts.chips.assign(gpuArchs.begin(), gpuArchs.end());
  module->walk([&](zopt::StepOp step) {
    if (gpuOpts.chips.empty() && !gpuArchs.getNumOccurrences())
      if (auto arch = step.getGpuArch())
        gpuOpts.chips.push_back(arch->str());
  });
  // The kernels run where the optimizer states live (else the param).
  const bool onGpu = zopt::kernelsOnGpu(*module);
  if (!onGpu)
    gpuOpts.chips.clear(); // a CPU-only compile, exactly as without GPU
  if (onGpu) {
    std::string tk = cudaPath;
    if (tk.empty())
      tk = zopt::cuda::defaultToolkitPath();
    if (const char *need = zopt::cuda::missingToolkitFile(tk))
      return fail("the step has states on the GPU, but the CUDA toolkit at '" +
                  tk + "' has no " + need +
                  " (set --cuda-path or CUDA_HOME to a CUDA 12+ toolkit)");
    gpuOpts.toolkitPath = tk;
    if (gpuOpts.chips.empty())
      return fail("the step has states on the GPU but no architecture: set "
                  "gpu_arch on zopt.step or pass --gpu=sm_90");
  }
  if (!last && emitKind == "ptx") {
    if (!onGpu)
      return fail("--emit=ptx needs a step whose optimizer states are on the GPU");
    gpuOpts.chips.resize(1);
    gpuOpts.format = "isa";
  }

  zopt::Phase stop = last.value_or(zopt::Phase::Codegen);
  if (!last && emitKind == "mlir")
    stop = zopt::Phase::Codegen;
  PassManager pm(&ctx);
  pm.enableTiming(root);
  zopt::buildPipeline(pm, stop, isas, gpuOpts);
  if (failed(pm.run(*module)))
    return 1;

  if (!last && emitKind == "ptx") {
    std::string suffix = "_gpu_" + gpuOpts.chips.front();
    for (auto g : module->getOps<LLVM::GlobalOp>())
      if (g.getSymName().ends_with(suffix))
        if (auto v = dyn_cast_or_null<StringAttr>(g.getValueOrNull()))
          return failed(writeOutput(outputFile, v.getValue(), false));
    return fail("no PTX was generated");
  }
  if (last || emitKind == "mlir") {
    std::string text;
    llvm::raw_string_ostream os(text);
    module->print(os);
    return failed(writeOutput(outputFile, text, false));
  }

  llvm::LLVMContext llctx;
  std::unique_ptr<llvm::Module> llmod;
  {
    TimingScope t = root.nest("LLVM IR + O3");
    llmod = zopt::translateAndOptimize(*module, llctx);
  }
  if (!llmod)
    return 1;
  if (emitKind == "llvm") {
    std::string text;
    llvm::raw_string_ostream os(text);
    llmod->print(os, nullptr);
    return failed(writeOutput(outputFile, text, false));
  }
  std::string code;
  {
    TimingScope t = root.nest("machine code");
    if (failed(zopt::emitMachineCode(*llmod,
                                     emitKind == "asm" ? zopt::FileKind::Assembly
                                                       : zopt::FileKind::Object,
                                     code, err)))
      return fail(err);
  }
  if (emitKind == "asm" || emitKind == "obj")
    return failed(writeOutput(outputFile, code, emitKind == "obj"));

  // --emit=so: object into a temporary file, then link.
  TimingScope t = root.nest("link");
  std::string linker = zopt::findLinker();
  if (linker.empty())
    return fail("no linker found: install lld-22 (scripts/setup-deps.sh) or "
                "set ZOPT_LINKER to an ELF linker");
  llvm::SmallString<128> objPath;
  int fd;
  if (auto ec = llvm::sys::fs::createTemporaryFile("zopt-step", "o", fd, objPath))
    return fail("cannot create a temporary object file: " + ec.message());
  {
    llvm::raw_fd_ostream os(fd, /*shouldClose=*/true);
    os << code;
  }
  LogicalResult linked =
      zopt::linkSharedObject(linker, objPath.str().str(), outputFile, err);
  llvm::sys::fs::remove(objPath);
  if (failed(linked))
    return fail(err);
  return 0;
}
