//===- Toolkit.h - the CUDA toolkit a GPU step is built with ----*- C++ -*-===//
//
// include/zopt/Target/CUDA/ owns zopt's use of the CUDA toolkit, apart from
// kernel building (lib/Conversion/ZKToGPU): where the toolkit is, the files
// GPU code generation needs from it (ptxas, fatbinary, libdevice), its CUDA
// version, and PTX -> cubin (ptxas) -> an uncompressed fatbinary with the
// cubin and the PTX. zopt-embed-gpu-binaries (Target/Passes.td) runs it.
//
//===----------------------------------------------------------------------===//
#ifndef ZOPT_TARGET_CUDA_TOOLKIT_H
#define ZOPT_TARGET_CUDA_TOOLKIT_H

#include "mlir/IR/Operation.h"
#include "mlir/Support/LLVM.h"

#include <cstdint>
#include <string>

namespace mlir::zopt::cuda {

/// The toolkit used when none is given: $CUDA_HOME if set and non-empty,
/// else /usr/local/cuda.
std::string defaultToolkitPath();

/// The files under a toolkit that GPU code generation needs: bin/ptxas,
/// bin/fatbinary and nvvm/libdevice/libdevice.10.bc.
ArrayRef<const char *> requiredToolkitFiles();

/// The first of requiredToolkitFiles() missing under `toolkit`, or null.
const char *missingToolkitFile(StringRef toolkit);

/// The CUDA version of the toolkit (1000 * major + 10 * minor, as
/// cuDriverGetVersion counts) from `ptxas --version` ("release 13.0"), or 0.
uint32_t toolkitVersion(StringRef toolkit);

/// PTX -> cubin (the toolkit's ptxas, for `chip`, at `optLevel`) ->
/// fatbinary with the cubin and the PTX, uncompressed (`fatbinary
/// --compress=false`: CUDA 13 compresses the PTX with zstd by default, which
/// older drivers cannot read). Errors are emitted on `op`.
FailureOr<std::string> buildFatbin(Operation *op, StringRef toolkit,
                                   StringRef ptx, StringRef chip,
                                   int optLevel);

} // namespace mlir::zopt::cuda

#endif
