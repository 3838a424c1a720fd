//===- ConvertZKToGPU.cpp - zk kernels into one CUDA module ---------------===//
//
// When the step's optimizer states live on the GPU, every zk.kernel and the
// zk.prepare body go into one `gpu.module @<step>_gpu` (targets: one
// #nvvm.target per requested SM) with the kernels of GPUKernels.h (abi.h's
// "GPU kernels" section). The kernel-table entries are recorded on the
// zk.descriptor (gpu_kernels, gpu_images) for zopt-emit-descriptor; the
// host keeps the zk.prepare and the zk.control (inlined into SUMSQ and
// FINISH here) for convert-zk-to-cpu. The fatbinaries are
// built and embedded by zopt-embed-gpu-binaries (lib/Target/CUDA) after
// gpu-module-to-binary.
//
//===----------------------------------------------------------------------===//
#include "zopt/Conversion/ZKToGPU/ZKToGPU.h"

#include "GPUKernels.h"
#include "zopt/Dialect/ZK/IR/ZKOps.h"
#include "zopt/abi.h"

#include "mlir/AsmParser/AsmParser.h"

namespace mlir::zopt {
#define GEN_PASS_DEF_CONVERTZKTOGPU
#include "zopt/Conversion/Passes.h.inc"
} // namespace mlir::zopt

using namespace mlir;
using namespace mlir::zopt;
using namespace mlir::zopt::gpu_kernels;

namespace {

struct ConvertZKToGPU
    : public mlir::zopt::impl::ConvertZKToGPUBase<ConvertZKToGPU> {
  using Base::Base;
  void runOnOperation() override {
    ModuleOp m = getOperation();
    MLIRContext *ctx = &getContext();
    auto descs = llvm::to_vector(m.getOps<zk::DescriptorOp>());
    auto preps = llvm::to_vector(m.getOps<zk::PrepareOp>());
    auto controls = llvm::to_vector(m.getOps<zk::ControlOp>());
    if (descs.size() != 1 || preps.size() != 1) {
      m.emitError("expected exactly one zk.descriptor and one zk.prepare");
      return signalPassFailure();
    }
    zk::DescriptorOp d = descs.front();
    // The update runs where the optimizer states live (the plan made them
    // agree); with only param/grad, where the param is.
    ArrayRef<int32_t> kinds = d.getStateKinds(), places = d.getStatePlacements();
    int32_t device = 0;
    for (auto [k, p] : llvm::zip(kinds, places))
      if (k != ZOPT_STATE_PARAM && k != ZOPT_STATE_GRAD)
        device = p;
    if (!device)
      for (auto [k, p] : llvm::zip(kinds, places))
        if (k == ZOPT_STATE_PARAM)
          device = p;
    if (device != ZOPT_PLACE_GPU)
      return; // a CPU step: convert-zk-to-cpu does everything
    if (chips.empty()) {
      d.emitError("the optimizer states are on the GPU but no GPU "
                  "architecture was given (gpu_arch / --gpu)");
      return signalPassFailure();
    }

    Step st{d.getName().str(),    int64_t(kinds.size()),
            int64_t(d.getHyperKinds().size()), int64_t(d.getNumCoeffs()),
            uint32_t(d.getFlags()), d.getMaxNorm().convertToDouble(),
            preps.front(), kinds, d.getStateDtypes(), d.getStateInits(),
            controls.empty() ? zk::ControlOp() : controls.front()};
    SmallVector<Attribute> targets, images;
    for (const std::string &chip : chips) {
      int sm = 0;
      if (!StringRef(chip).starts_with("sm_") ||
          StringRef(chip).drop_front(3).take_while(llvm::isDigit).getAsInteger(10, sm) ||
          sm < 70) {
        d.emitError("unknown GPU architecture '") << chip
            << "'; expected sm_70 or newer, e.g. sm_80, sm_90";
        return signalPassFailure();
      }
      Attribute t = parseAttribute(
          ("#nvvm.target<O = 3, chip = \"" + chip + "\", features = \"" +
           features + "\">"),
          ctx);
      if (!t) {
        d.emitError("cannot make an NVVM target for '") << chip << "'";
        return signalPassFailure();
      }
      targets.push_back(t);
      images.push_back(ArrayAttr::get(
          ctx, {IntegerAttr::get(IntegerType::get(ctx, 32), sm),
                StringAttr::get(ctx, st.name + "_gpu_" + chip)}));
    }

    if (controls.size() != 1) {
      d.emitError("a GPU step needs exactly one zk.control (its SUMSQ and "
                  "FINISH kernels evaluate it), found ")
          << controls.size();
      return signalPassFailure();
    }
    m->setAttr(gpu::GPUDialect::getContainerModuleAttrName(),
               UnitAttr::get(ctx));
    OpBuilder mb = OpBuilder::atBlockEnd(m.getBody());
    auto gm = gpu::GPUModuleOp::create(mb, d.getLoc(), st.name + "_gpu",
                                       ArrayAttr::get(ctx, targets));
    OpBuilder gb = OpBuilder::atBlockEnd(gm.getBody());
    SmallVector<Attribute> entries;
    auto entry = [&](zopt_kernel_role role, StringRef sym) {
      entries.push_back(ArrayAttr::get(
          ctx, {IntegerAttr::get(IntegerType::get(ctx, 32), role),
                StringAttr::get(ctx, sym)}));
    };
    buildPrepareKernel(gb, d.getLoc(), st);
    entry(ZOPT_KERNEL_PREPARE, st.name + "_prepare_gpu");
    for (auto k : llvm::make_early_inc_range(m.getOps<zk::KernelOp>())) {
      if (k.getRole() == zk::KernelRole::sumsq) {
        if (failed(buildSumsqKernel(gb, k, st)))
          return signalPassFailure();
        entry(ZOPT_KERNEL_SUMSQ, k.getSymName());
      } else {
        buildUpdateKernel(gb, k, st);
        entry(ZOPT_KERNEL_UPDATE, k.getSymName());
      }
      k.erase();
    }
    if (failed(buildFinishKernel(gb, d.getLoc(), st)))
      return signalPassFailure();
    entry(ZOPT_KERNEL_FINISH, st.name + "_finish");
    // This FINISH strides its per-tensor counts over any grid (abi.h).
    d.setFlags(d.getFlags() | ZOPT_FLAG_FINISH_GRID);
    // INIT has no kernel-table role: the runtime finds it by its name.
    buildInitKernel(gb, d.getLoc(), st);
    d.setGpuKernelsAttr(ArrayAttr::get(ctx, entries));
    d.setGpuImagesAttr(ArrayAttr::get(ctx, images));
  }
};

} // namespace
