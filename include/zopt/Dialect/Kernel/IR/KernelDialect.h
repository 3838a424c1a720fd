//===- KernelDialect.h - zk dialect -----------------------------*- C++ -*-===//
#ifndef ZOPT_DIALECT_KERNEL_IR_KERNELDIALECT_H
#define ZOPT_DIALECT_KERNEL_IR_KERNELDIALECT_H

#include "mlir/Bytecode/BytecodeOpInterface.h"
#include "mlir/Dialect/Arith/IR/Arith.h"
#include "mlir/Dialect/Math/IR/Math.h"
#include "mlir/IR/Builders.h"
#include "mlir/IR/BuiltinOps.h"
#include "mlir/IR/Dialect.h"
#include "mlir/IR/OpDefinition.h"
#include "mlir/IR/SymbolTable.h"
#include "mlir/Interfaces/SideEffectInterfaces.h"

#include "zopt/Dialect/Kernel/IR/KernelDialect.h.inc"
#include "zopt/Dialect/Kernel/IR/KernelEnums.h.inc"
#define GET_ATTRDEF_CLASSES
#include "zopt/Dialect/Kernel/IR/KernelAttrs.h.inc"

#define GET_OP_CLASSES
#include "zopt/Dialect/Kernel/IR/Kernel.h.inc"

#endif
