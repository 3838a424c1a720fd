//===- zopt-fuzz-description.cpp - libFuzzer over a description text -----===//
//
// One input is the text of one description, taken the way zopt-compile
// takes it (FuzzRunner.h). Any crash, ASan report, leak or timeout is a
// finding; a diagnostic is not. scripts/fuzz.sh builds and runs it (a fixed
// seed, a seed corpus from examples/ and the tests, a zopt dictionary).
//
//===----------------------------------------------------------------------===//
#include "FuzzRunner.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  return zopt_fuzz::runDescription(
      llvm::StringRef(reinterpret_cast<const char *>(data), size));
}
