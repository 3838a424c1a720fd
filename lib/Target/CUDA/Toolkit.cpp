//===- Toolkit.cpp - the CUDA toolkit a GPU step is built with ------------===//
#include "zopt/Target/CUDA/Toolkit.h"

#include "mlir/IR/Diagnostics.h"
#include "llvm/Support/FileSystem.h"
#include "llvm/Support/FileUtilities.h"
#include "llvm/Support/MemoryBuffer.h"
#include "llvm/Support/Path.h"
#include "llvm/Support/Process.h"
#include "llvm/Support/Program.h"
#include "llvm/Support/raw_ostream.h"

#include <cstdlib>

using namespace mlir;
using namespace mlir::zopt;

std::string cuda::defaultToolkitPath() {
  if (const char *env = std::getenv("CUDA_HOME"); env && *env)
    return env;
  return "/usr/local/cuda";
}

ArrayRef<const char *> cuda::requiredToolkitFiles() {
  static const char *const files[] = {"bin/ptxas", "bin/fatbinary",
                                      "nvvm/libdevice/libdevice.10.bc"};
  return files;
}

const char *cuda::missingToolkitFile(StringRef toolkit) {
  for (const char *need : requiredToolkitFiles()) {
    SmallString<256> p(toolkit);
    llvm::sys::path::append(p, need);
    if (!llvm::sys::fs::exists(p))
      return need;
  }
  return nullptr;
}

uint32_t cuda::toolkitVersion(StringRef toolkit) {
  SmallString<256> ptxas(toolkit);
  llvm::sys::path::append(ptxas, "bin", "ptxas");
  SmallString<128> out;
  int fd = -1;
  if (llvm::sys::fs::createTemporaryFile("zopt-ptxas-version", "txt", fd, out))
    return 0;
  llvm::sys::Process::SafelyCloseFileDescriptor(fd);
  llvm::FileRemover rm(out);
  std::optional<StringRef> redirects[] = {std::nullopt, StringRef(out), StringRef(out)};
  StringRef args[] = {ptxas, "--version"};
  if (llvm::sys::ExecuteAndWait(ptxas, args, std::nullopt, redirects))
    return 0;
  auto buf = llvm::MemoryBuffer::getFile(out);
  if (!buf)
    return 0;
  StringRef text = (*buf)->getBuffer();
  size_t at = text.find("release ");
  if (at == StringRef::npos)
    return 0;
  StringRef v = text.drop_front(at + 8);
  unsigned major = 0, minor = 0;
  if (v.consumeInteger(10, major) || !v.consume_front(".") ||
      v.consumeInteger(10, minor))
    return 0;
  return major * 1000 + minor * 10;
}

FailureOr<std::string> cuda::buildFatbin(Operation *op, StringRef toolkit,
                                        StringRef ptx, StringRef chip,
                                        int optLevel) {
  SmallString<256> ptxas(toolkit), fatbinary(toolkit);
  llvm::sys::path::append(ptxas, "bin", "ptxas");
  llvm::sys::path::append(fatbinary, "bin", "fatbinary");
  SmallString<128> ptxFile, cubinFile, fatFile, logFile;
  for (auto [path, ext] :
       {std::pair{&ptxFile, "ptx"}, {&cubinFile, "cubin"}, {&fatFile, "fatbin"},
        {&logFile, "log"}}) {
    int fd = -1;
    if (std::error_code ec =
            llvm::sys::fs::createTemporaryFile("zopt-gpu", ext, fd, *path)) {
      op->emitError() << "cannot create a temporary file: " << ec.message();
      return failure();
    }
    llvm::sys::Process::SafelyCloseFileDescriptor(fd);
  }
  llvm::FileRemover r1(ptxFile), r2(cubinFile), r3(fatFile), r4(logFile);
  {
    std::error_code ec;
    llvm::raw_fd_ostream os(ptxFile, ec);
    if (ec) {
      op->emitError() << "cannot write " << ptxFile << ": " << ec.message();
      return failure();
    }
    os << ptx;
  }
  std::optional<StringRef> redirects[] = {std::nullopt, StringRef(logFile),
                                          StringRef(logFile)};
  auto run = [&](StringRef tool, ArrayRef<StringRef> args) -> LogicalResult {
    std::string msg;
    if (!llvm::sys::ExecuteAndWait(tool, args, std::nullopt, redirects, 0, 0,
                                   &msg))
      return success();
    auto log = llvm::MemoryBuffer::getFile(logFile);
    op->emitError() << llvm::sys::path::filename(tool) << " failed"
                    << (msg.empty() ? "" : ": ") << msg << "\n"
                    << (log ? (*log)->getBuffer() : StringRef());
    return failure();
  };
  std::string opt = std::to_string(optLevel);
  if (failed(run(ptxas, {ptxas, "-arch", chip, "--opt-level", opt, ptxFile,
                         "-o", cubinFile})))
    return failure();
  StringRef sm = chip;
  sm.consume_front("sm_");
  std::string elf = ("--image3=kind=elf,sm=" + sm + ",file=" + cubinFile).str();
  std::string ptxImg = ("--image3=kind=ptx,sm=" + sm + ",file=" + ptxFile).str();
  if (failed(run(fatbinary, {fatbinary, "-64", "--compress=false", elf, ptxImg,
                             "--create", fatFile})))
    return failure();
  auto buf = llvm::MemoryBuffer::getFile(fatFile);
  if (!buf) {
    op->emitError() << "cannot read " << fatFile;
    return failure();
  }
  return (*buf)->getBuffer().str();
}
