//===- EmbedGPUBinaries.cpp - fatbinaries into step.so --------------------===//
#include "zopt/Target/Passes.h"

#include "zopt/Target/CUDA/Toolkit.h"

namespace mlir::zopt {
#define GEN_PASS_DEF_ZOPTEMBEDGPUBINARIES
#include "zopt/Target/Passes.h.inc"
} // namespace mlir::zopt

using namespace mlir;
using namespace mlir::zopt;

namespace {

/// Replaces each gpu.binary by exported byte arrays `<name>_<chip>` (one per
/// object), `const uint64_t <name>_<chip>_size` and, for a fatbinary built
/// here, `const uint32_t <name>_<chip>_cuda_version`.
struct ZoptEmbedGPUBinaries
    : public mlir::zopt::impl::ZoptEmbedGPUBinariesBase<ZoptEmbedGPUBinaries> {
  using Base::Base;
  void runOnOperation() override {
    ModuleOp m = getOperation();
    MLIRContext *ctx = &getContext();
    OpBuilder mb = OpBuilder::atBlockEnd(m.getBody());
    uint32_t version = 0;
    if (!toolkit.empty())
      version = cuda::toolkitVersion(toolkit);
    for (auto bin : llvm::make_early_inc_range(m.getOps<gpu::BinaryOp>())) {
      for (Attribute a : bin.getObjects()) {
        auto obj = cast<gpu::ObjectAttr>(a);
        auto t = dyn_cast<NVVM::NVVMTargetAttr>(obj.getTarget());
        if (!t) {
          bin.emitError("only NVVM targets can be embedded");
          return signalPassFailure();
        }
        std::string sym = (bin.getSymName() + "_" + t.getChip()).str();
        std::string bytes = obj.getObject().getValue().str();
        if (!toolkit.empty()) {
          if (obj.getFormat() != gpu::CompilationTarget::Assembly) {
            bin.emitError("zopt-embed-gpu-binaries builds fatbinaries from "
                          "PTX: run gpu-module-to-binary with format=isa");
            return signalPassFailure();
          }
          FailureOr<std::string> fat =
              cuda::buildFatbin(bin, toolkit, bytes, t.getChip(), t.getO());
          if (failed(fat))
            return signalPassFailure();
          bytes = std::move(*fat);
          LLVM::GlobalOp::create(mb, bin.getLoc(), mb.getI32Type(), true,
                                 LLVM::Linkage::External, sym + "_cuda_version",
                                 mb.getI32IntegerAttr(int32_t(version)), 4);
        }
        auto arr = LLVM::LLVMArrayType::get(IntegerType::get(ctx, 8), bytes.size());
        LLVM::GlobalOp::create(mb, bin.getLoc(), arr, /*isConstant=*/true,
                               LLVM::Linkage::External, sym,
                               mb.getStringAttr(bytes), /*alignment=*/16);
        LLVM::GlobalOp::create(mb, bin.getLoc(), mb.getI64Type(), true,
                               LLVM::Linkage::External, sym + "_size",
                               mb.getI64IntegerAttr(bytes.size()), 8);
      }
      bin.erase();
    }
    m->removeAttr(gpu::GPUDialect::getContainerModuleAttrName());
  }
};

} // namespace
