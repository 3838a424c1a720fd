//===- Emit.h - LLVM IR, assembly, objects and step.so ----------*- C++ -*-===//
//
// The last stage of include/zopt/Target/ (Passes.h says what the folder
// owns): the LLVM-dialect module into LLVM IR at O3, assembly or an object
// file, and the object linked into step.so.
//
//===----------------------------------------------------------------------===//
#ifndef ZOPT_TARGET_EMIT_H
#define ZOPT_TARGET_EMIT_H

#include "mlir/IR/BuiltinOps.h"
#include "llvm/IR/LLVMContext.h"
#include "llvm/IR/Module.h"

#include <memory>
#include <string>

namespace mlir::zopt {

/// Translates an LLVM-dialect module to LLVM IR and optimizes it at O3 for
/// x86-64 (functions carry their own target-cpu). Returns null and emits a
/// diagnostic on failure.
std::unique_ptr<llvm::Module> translateAndOptimize(ModuleOp m,
                                                   llvm::LLVMContext &ctx);

enum class FileKind { Assembly, Object };
/// Writes `mod` as assembly or an object file into `out`.
LogicalResult emitMachineCode(llvm::Module &mod, FileKind kind,
                              std::string &out, std::string &error);

/// Finds an ELF linker: $ZOPT_LINKER, else LLVM 22's ld.lld, else ld.lld-22,
/// ld.lld or cc on PATH. Empty if none.
std::string findLinker();
/// Links an object file into a shared library with `linker`.
LogicalResult linkSharedObject(const std::string &linker,
                               const std::string &objPath,
                               const std::string &soPath, std::string &error);

} // namespace mlir::zopt

#endif
