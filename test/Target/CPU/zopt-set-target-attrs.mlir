// RUN: zopt-opt %s --zopt-set-target-attrs | FileCheck %s

// Each ISA variant convert-zk-to-cpu names <kernel>_<isa> gets its own
// target CPU and vector width (and the AVX512_BF16 feature); one object
// carries every variant. A function without an ISA suffix is left alone.

// CHECK-LABEL: llvm.func @k_avx512bf16()
// CHECK-SAME: passthrough = {{\[}}["min-legal-vector-width", "512"], ["prefer-vector-width", "512"]]
// CHECK-SAME: target_cpu = "x86-64-v4"
// CHECK-SAME: target_features = #llvm.target_features<["+avx512bf16"]>
llvm.func @k_avx512bf16() {
  llvm.return
}

// CHECK-LABEL: llvm.func @k_avx512()
// CHECK-SAME: passthrough = {{\[}}["min-legal-vector-width", "512"], ["prefer-vector-width", "512"]]
// CHECK-SAME: target_cpu = "x86-64-v4"
// CHECK-NOT: target_features
llvm.func @k_avx512() {
  llvm.return
}

// CHECK-LABEL: llvm.func @k_avx2()
// CHECK-SAME: passthrough = {{\[}}["min-legal-vector-width", "256"], ["prefer-vector-width", "256"]]
// CHECK-SAME: target_cpu = "x86-64-v3"
llvm.func @k_avx2() {
  llvm.return
}

// CHECK-LABEL: llvm.func @k_prepare() {
llvm.func @k_prepare() {
  llvm.return
}
