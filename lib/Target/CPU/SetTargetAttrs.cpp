//===- SetTargetAttrs.cpp - per-function ISA into llvm.func attributes ----===//
//
// lib/Target/CPU/ owns zopt-set-target-attrs (include/zopt/Target/Passes.td):
// each CPU kernel function's ISA variant (the `_<isa>` suffix of its name,
// convert-zk-to-cpu's; a SUMSQ pair entry's `_<isa>_x2`) becomes its
// target-cpu, target-features and vector width, so that one object holds the
// x86-64-v3, v4 and avx512bf16 variants.
//===----------------------------------------------------------------------===//
#include "zopt/Target/Passes.h"

namespace mlir::zopt {
#define GEN_PASS_DEF_ZOPTSETTARGETATTRS
#include "zopt/Target/Passes.h.inc"
} // namespace mlir::zopt

using namespace mlir;

namespace {
struct ZoptSetTargetAttrs
    : public mlir::zopt::impl::ZoptSetTargetAttrsBase<ZoptSetTargetAttrs> {
  void runOnOperation() override {
    MLIRContext *ctx = &getContext();
    getOperation().walk([&](LLVM::LLVMFuncOp f) {
      StringRef name = f.getSymName();
      name.consume_back("_x2"); // abi.h "SUMSQ pairs": sym_x2 is sym's ISA
      const char *cpu = nullptr, *width = nullptr;
      if (name.ends_with("_avx512bf16")) {
        cpu = "x86-64-v4";
        width = "512";
        f.setTargetFeaturesAttr(
            LLVM::TargetFeaturesAttr::get(ctx, "+avx512bf16"));
      } else if (name.ends_with("_avx512")) {
        cpu = "x86-64-v4";
        width = "512";
      } else if (name.ends_with("_avx2")) {
        cpu = "x86-64-v3";
        width = "256";
      }
      if (!cpu)
        return;
      f.setTargetCpuAttr(StringAttr::get(ctx, cpu));
      auto kv = [&](StringRef k, StringRef v) -> Attribute {
        return ArrayAttr::get(ctx, {StringAttr::get(ctx, k),
                                    StringAttr::get(ctx, v)});
      };
      f.setPassthroughAttr(ArrayAttr::get(
          ctx, {kv("min-legal-vector-width", width),
                kv("prefer-vector-width", width)}));
    });
  }
};
} // namespace
