//===- PreciseSqrt.cpp - IEEE square roots in GPU kernels -----------------===//
#include "zopt/Conversion/ZKToGPU/ZKToGPU.h"

namespace mlir::zopt {
#define GEN_PASS_DEF_ZOPTGPUPRECISESQRT
#include "zopt/Conversion/Passes.h.inc"
} // namespace mlir::zopt

using namespace mlir;

namespace {

/// libdevice's __nv_sqrtf is sqrt.approx unless __CUDA_PREC_SQRT is
/// reflected on; the CPU kernels use the IEEE square root. Calls to
/// __nv_sqrtf/__nv_sqrt become llvm.intr.sqrt (sqrt.rn.f32/f64).
struct ZoptGPUPreciseSqrt
    : public mlir::zopt::impl::ZoptGPUPreciseSqrtBase<ZoptGPUPreciseSqrt> {
  void runOnOperation() override {
    Operation *m = getOperation();
    SmallVector<LLVM::CallOp> calls;
    m->walk([&](LLVM::CallOp c) {
      if (auto callee = c.getCallee();
          callee && (*callee == "__nv_sqrtf" || *callee == "__nv_sqrt"))
        calls.push_back(c);
    });
    for (LLVM::CallOp c : calls) {
      OpBuilder b(c);
      c.getResult().replaceAllUsesWith(
          LLVM::SqrtOp::create(b, c.getLoc(), c.getArgOperands()[0]).getResult());
      c.erase();
    }
    m->walk([](LLVM::LLVMFuncOp f) {
      if (f.isExternal() &&
          (f.getName() == "__nv_sqrtf" || f.getName() == "__nv_sqrt") &&
          f.symbolKnownUseEmpty(f->getParentOp()))
        f.erase();
    });
  }
};

} // namespace
