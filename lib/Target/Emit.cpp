//===- Emit.cpp - LLVM IR, assembly, objects and step.so ------------------===//
#include "zopt/Target/Emit.h"

#include "mlir/Target/LLVMIR/Dialect/Builtin/BuiltinToLLVMIRTranslation.h"
#include "mlir/Target/LLVMIR/Dialect/LLVMIR/LLVMToLLVMIRTranslation.h"
#include "mlir/Target/LLVMIR/Export.h"
#include "llvm/IR/LegacyPassManager.h"
#include "llvm/MC/TargetRegistry.h"
#include "llvm/Passes/PassBuilder.h"
#include "llvm/Support/FileSystem.h"
#include "llvm/Support/Path.h"
#include "llvm/Support/Program.h"
#include "llvm/Support/TargetSelect.h"
#include "llvm/Support/raw_ostream.h"
#include "llvm/Target/TargetMachine.h"
#include "llvm/Target/TargetOptions.h"
#include "llvm/TargetParser/Triple.h"

#include <cstdlib>
#include <mutex>

using namespace mlir;

static const char *const kTriple = "x86_64-unknown-linux-gnu";

static std::unique_ptr<llvm::TargetMachine> makeTargetMachine(std::string &err) {
  static std::once_flag once;
  std::call_once(once, [] {
    LLVMInitializeX86TargetInfo();
    LLVMInitializeX86Target();
    LLVMInitializeX86TargetMC();
    LLVMInitializeX86AsmPrinter();
    LLVMInitializeX86AsmParser();
  });
  llvm::Triple triple(kTriple);
  const llvm::Target *target = llvm::TargetRegistry::lookupTarget(triple, err);
  if (!target)
    return nullptr;
  llvm::TargetOptions opts;
  // Baseline x86-64: every kernel function names its own target-cpu.
  return std::unique_ptr<llvm::TargetMachine>(target->createTargetMachine(
      triple, "x86-64", "", opts, llvm::Reloc::PIC_, std::nullopt,
      llvm::CodeGenOptLevel::Aggressive));
}

std::unique_ptr<llvm::Module>
mlir::zopt::translateAndOptimize(ModuleOp m, llvm::LLVMContext &ctx) {
  DialectRegistry registry;
  registerBuiltinDialectTranslation(registry);
  registerLLVMDialectTranslation(registry);
  m->getContext()->appendDialectRegistry(registry);
  std::unique_ptr<llvm::Module> mod = translateModuleToLLVMIR(m, ctx, "zopt");
  if (!mod) {
    m.emitError("translation to LLVM IR failed");
    return nullptr;
  }
  std::string err;
  auto tm = makeTargetMachine(err);
  if (!tm) {
    m.emitError("no x86-64 target: ") << err;
    return nullptr;
  }
  mod->setTargetTriple(llvm::Triple(kTriple));
  mod->setDataLayout(tm->createDataLayout());

  llvm::LoopAnalysisManager lam;
  llvm::FunctionAnalysisManager fam;
  llvm::CGSCCAnalysisManager cam;
  llvm::ModuleAnalysisManager mam;
  llvm::PassBuilder pb(tm.get());
  pb.registerModuleAnalyses(mam);
  pb.registerCGSCCAnalyses(cam);
  pb.registerFunctionAnalyses(fam);
  pb.registerLoopAnalyses(lam);
  pb.crossRegisterProxies(lam, fam, cam, mam);
  llvm::ModulePassManager mpm =
      pb.buildPerModuleDefaultPipeline(llvm::OptimizationLevel::O3);
  mpm.run(*mod, mam);
  return mod;
}

LogicalResult mlir::zopt::emitMachineCode(llvm::Module &mod, FileKind kind,
                                          std::string &out,
                                          std::string &error) {
  auto tm = makeTargetMachine(error);
  if (!tm)
    return failure();
  llvm::raw_string_ostream os(out);
  llvm::buffer_ostream bos(os);
  llvm::legacy::PassManager pm;
  if (tm->addPassesToEmitFile(pm, bos, nullptr,
                              kind == FileKind::Object
                                  ? llvm::CodeGenFileType::ObjectFile
                                  : llvm::CodeGenFileType::AssemblyFile)) {
    error = "the x86-64 target cannot emit this file type";
    return failure();
  }
  pm.run(mod);
  return success();
}

std::string mlir::zopt::findLinker() {
  if (const char *env = std::getenv("ZOPT_LINKER"); env && *env)
    return env;
  std::string inTools = std::string(ZOPT_LLVM_TOOLS_DIR) + "/ld.lld";
  if (llvm::sys::fs::can_execute(inTools))
    return inTools;
  for (const char *name : {"ld.lld-22", "ld.lld", "cc"})
    if (auto p = llvm::sys::findProgramByName(name))
      return *p;
  return "";
}

LogicalResult mlir::zopt::linkSharedObject(const std::string &linker,
                                           const std::string &objPath,
                                           const std::string &soPath,
                                           std::string &error) {
  bool isCC = llvm::sys::path::filename(linker) == "cc" ||
              llvm::sys::path::filename(linker).contains("gcc") ||
              llvm::sys::path::filename(linker).contains("clang");
  std::vector<std::string> args = {linker, "-shared", "-o", soPath, objPath};
  if (isCC) {
    args.push_back("-lm");
  } else {
    // lld: pow() of the prepare function comes from libm, found where
    // Debian keeps it; missing is fine (resolved from the process).
    for (const char *dir : {"/lib/x86_64-linux-gnu", "/usr/lib/x86_64-linux-gnu"})
      if (llvm::sys::fs::exists(std::string(dir) + "/libm.so.6")) {
        args.push_back(std::string(dir) + "/libm.so.6");
        break;
      }
  }
  SmallVector<StringRef> argv(args.begin(), args.end());
  std::string msg;
  int rc = llvm::sys::ExecuteAndWait(linker, argv, std::nullopt, {}, 0, 0, &msg);
  if (rc != 0) {
    error = "linker '" + linker + "' failed (exit " + std::to_string(rc) + ")" +
            (msg.empty() ? "" : ": " + msg);
    return failure();
  }
  return success();
}
