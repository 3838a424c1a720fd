//===- zopt-opt.cpp - zopt's mlir-opt -------------------------------------===//
//
// mlir-opt with the zopt dialects, passes and pipelines. Two guards keep any
// input from crashing it: the input's bracket nesting is bounded before the
// recursive-descent parser sees it (docs/Dialects/Zopt.md, "Limits"), and
// the driver runs on a thread with a known, large stack.
//
//===----------------------------------------------------------------------===//
#include "mlir/IR/DialectRegistry.h"
#include "mlir/IR/MLIRContext.h"
#include "mlir/InitAllDialects.h"
#include "mlir/InitAllExtensions.h"
#include "mlir/InitAllPasses.h"
#include "mlir/Support/FileUtilities.h"
#include "mlir/Target/LLVMIR/Dialect/All.h"
#include "mlir/Tools/mlir-opt/MlirOptMain.h"
#include "llvm/Support/InitLLVM.h"
#include "llvm/Support/SourceMgr.h"
#include "llvm/Support/ToolOutputFile.h"
#include "llvm/Support/thread.h"
#include "zopt/Conversion/Passes.h"
#include "zopt/Dialect/Program/IR/ProgramOps.h"
#include "zopt/Dialect/ZK/IR/ZKOps.h"
#include "zopt/Dialect/Zopt/IR/ZoptDescription.h"
#include "zopt/Dialect/Zopt/Transforms/Passes.h"
#include "zopt/Pipelines/Pipelines.h"
#include "zopt/Target/Passes.h"

using namespace mlir;

/// MlirOptMain(argc, argv, in, out, registry) with the nesting check
/// between reading the input and parsing it.
static int run(int argc, char **argv, StringRef inputFilename,
               StringRef outputFilename, DialectRegistry &registry) {
  MlirOptMainConfig config = MlirOptMainConfig::createFromCLOptions();
  if (config.shouldShowDialects() || config.shouldListPasses())
    return asMainReturnCode(
        MlirOptMain(argc, argv, inputFilename, outputFilename, registry));
  std::string err;
  std::unique_ptr<llvm::MemoryBuffer> file = openInputFile(inputFilename, &err);
  if (!file) {
    llvm::errs() << err << "\n";
    return 1;
  }
  {
    MLIRContext ctx(MLIRContext::Threading::DISABLED);
    llvm::SourceMgr sm;
    sm.AddNewSourceBuffer(
        llvm::MemoryBuffer::getMemBuffer(file->getMemBufferRef(),
                                         /*RequiresNullTerminator=*/false),
        llvm::SMLoc());
    SourceMgrDiagnosticHandler handler(sm, &ctx);
    if (failed(zopt::checkNesting(sm, sm.getMainFileID(), &ctx)))
      return 1;
  }
  auto output = openOutputFile(outputFilename, &err);
  if (!output) {
    llvm::errs() << err << "\n";
    return 1;
  }
  if (failed(MlirOptMain(output->os(), std::move(file), registry, config)))
    return 1;
  output->keep();
  return 0;
}

int main(int argc, char **argv) {
  llvm::InitLLVM init(argc, argv);
  DialectRegistry registry;
  registerAllDialects(registry);
  registerAllExtensions(registry);
  registerAllToLLVMIRTranslations(registry);
  registry.insert<zopt::ZoptDialect, zprog::ZProgDialect, zk::ZKDialect>();
  registerAllPasses();
  zopt::registerZoptPasses();
  zopt::registerZoptConversionPasses();
  zopt::registerZoptTargetPasses();
  zopt::registerPipelines();
  auto [inputFilename, outputFilename] =
      registerAndParseCLIOptions(argc, argv, "zopt optimizer driver\n", registry);
  int rc = 1;
  llvm::thread worker(std::optional<unsigned>(zopt::kDriverStackBytes),
                      [&, in = inputFilename, out = outputFilename] {
                        rc = run(argc, argv, in, out, registry);
                      });
  worker.join();
  return rc;
}
