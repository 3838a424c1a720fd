// RUN: zopt-opt %s --convert-zk-to-cpu="isas=avx512" | FileCheck %s

// A store with rounding = 2 (stochastic): the update takes (key, first)
// after the ABI's four arguments, the element index vector is first + i +
// iota, and the 16 random bits are fmix32((index * 0x9E3779B1) ^ (key +
// slot * 0x27D4EB2F)) >> 16 (abi.h), added to the f32 bits before the high
// halves are kept; NaN keeps the nearest-even quiet form.

zk.descriptor {name = "t", zero_stage = 0 : i64, align = 1 : i64, flags = 8 : i64,
  max_norm = 0.0 : f64, num_coeffs = 1 : i64,
  state_kinds = array<i32: 1, 2>, state_dtypes = array<i32: 2, 2>,
  state_placements = array<i32: 1, 1>, state_roundings = array<i32: 2, 1>,
  state_inits = array<i32: 1, 1>, state_access = array<i32: 3, 1>, state_flags = array<i32: 0, 0>,
  hyper_kinds = array<i32: 1>, hyper_defaults = array<f64: 0.001>,
  hyper_mins = array<f64: 0.0>, hyper_maxs = array<f64: 1.0>,
  hyper_max_exclusive = array<i32: 0>}

zk.prepare @t_prepare {
  %lr = zk.hyper 0
  %c = arith.truncf %lr : f64 to f32
  zk.set_coeff 0, %c : f32
}

// CHECK-LABEL: func.func @t_update_avx512(
// CHECK-SAME: %{{.+}}: !llvm.ptr, %{{.+}}: !llvm.ptr, %{{.+}}: i64, %{{.+}}: !llvm.ptr, %[[KEY:[a-z0-9]+]]: i32, %[[FIRST:[a-z0-9]+]]: i32)
// CHECK: arith.constant dense<[0, 1, 2, {{.+}}, 31]> : vector<32xi32>
// CHECK: scf.for
// CHECK: arith.trunci %{{.+}} : i64 to i32
// CHECK: arith.addi %[[FIRST]], %{{.+}} : i32
// CHECK: arith.addi %[[KEY]], %{{.+}} : i32
// CHECK: arith.constant dense<-1640531535> : vector<32xi32>
// CHECK: arith.muli
// CHECK: arith.constant dense<-2048144789> : vector<32xi32>
// CHECK: arith.constant dense<-1028477387> : vector<32xi32>
// CHECK: arith.cmpf uno
// CHECK: llvm.store %{{.+}}, %{{.+}} {alignment = 2 : i64} : vector<32xi16>, !llvm.ptr
// The scalar tail rounds the same way.
// CHECK: scf.for
// CHECK: arith.addi %[[FIRST]], %{{.+}} : i32
// CHECK: llvm.store %{{.+}}, %{{.+}} {alignment = 2 : i64} : i16, !llvm.ptr
zk.kernel @t_update update {
  %p = zk.load 0 : bf16
  %g = zk.load 1 : bf16
  %pf = arith.extf %p : bf16 to f32
  %gf = arith.extf %g : bf16 to f32
  %lr = zk.coeff 0
  %d = arith.mulf %lr, %gf : f32
  %p1 = arith.subf %pf, %d : f32
  zk.store 0, %p1 {rounding = 2 : i32} : f32 into bf16
}

// The step program (made by zopt-plan) becomes the descriptor's table.
zopt.program for "t" {
  zopt.prepare on cpu
  zopt.update owned on cpu
  zopt.finish on cpu
}
