//===- zopt-opt.cpp - zopt's mlir-opt -------------------------------------===//
#include "mlir/IR/DialectRegistry.h"
#include "mlir/InitAllDialects.h"
#include "mlir/InitAllExtensions.h"
#include "mlir/InitAllPasses.h"
#include "mlir/Target/LLVMIR/Dialect/All.h"
#include "mlir/Tools/mlir-opt/MlirOptMain.h"
#include "zopt/Pipelines/Pipelines.h"
#include "zopt/Transforms/Passes.h"

int main(int argc, char **argv) {
  mlir::DialectRegistry registry;
  mlir::registerAllDialects(registry);
  mlir::registerAllExtensions(registry);
  mlir::registerAllToLLVMIRTranslations(registry);
  registry.insert<mlir::zopt::ZoptDialect, mlir::zk::ZKDialect>();
  mlir::registerAllPasses();
  mlir::zopt::registerZoptPasses();
  mlir::zopt::registerPipelines();
  return mlir::asMainReturnCode(
      mlir::MlirOptMain(argc, argv, "zopt optimizer driver\n", registry));
}
