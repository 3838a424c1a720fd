//===- Q8Blocks.h - the block loop of CPU UPDATE kernels with q8 -*- C++ -*-===//
//
// convert-zk-to-cpu's UPDATE kernels with q8 moments (abi.h "q8 moments",
// docs/NUMERICS.md §10): the loop over 256-element blocks around the
// shared kernel body (Q8Blocks.cpp). ConvertZKToCPU.cpp owns the rest.
//
//===----------------------------------------------------------------------===//
#ifndef ZOPT_LIB_CONVERSION_ZKTOCPU_Q8BLOCKS_H
#define ZOPT_LIB_CONVERSION_ZKTOCPU_Q8BLOCKS_H

#include "../ZKCommon/BodyEmitter.h"

#include "mlir/Dialect/Func/IR/FuncOps.h"

namespace mlir::zopt {

/// Emits at `b` (in `fn`) the body of an UPDATE kernel with q8 moments over
/// n elements: per block, the absmax loaded, the body at `lanes` (vecE) and
/// one element (sclE) with the new moments buffered and their |max|
/// reduced, the new absmax stored and the codes encoded. `beforeVec` /
/// `beforeScalar` run at the top of each body iteration.
void emitQ8Blocks(OpBuilder &b, Location loc, func::FuncOp fn, Block &body,
                  Value inTable, Value outTable, Value n, int lanes,
                  BodyEmitter &vecE, BodyEmitter &sclE,
                  function_ref<void(Value)> beforeVec,
                  function_ref<void(Value)> beforeScalar);

} // namespace mlir::zopt

#endif
