// RUN: zopt-opt %s --convert-zk-to-cpu="isas=avx512,avx2" | FileCheck %s

// One function per kernel and ISA, with the C ABI of abi.h; a vector loop at
// the ISA's width and a scalar tail loop; bf16 stores round to nearest even
// in integer arithmetic (add 0x7FFF + lsb, keep the high half, NaN -> quiet
// NaN); the descriptor becomes the exported zopt_step_descriptor constant.

zk.descriptor {name = "t", zero_stage = 0 : i64, align = 1 : i64, flags = 4 : i64,
  max_norm = 0.0 : f64, num_coeffs = 1 : i64,
  state_kinds = array<i32: 1, 2>, state_dtypes = array<i32: 2, 2>,
  state_placements = array<i32: 1, 1>, state_roundings = array<i32: 1, 1>,
  state_inits = array<i32: 1, 1>, state_access = array<i32: 3, 1>,
  hyper_kinds = array<i32: 1>, hyper_defaults = array<f64: 0.001>,
  hyper_mins = array<f64: 0.0>, hyper_maxs = array<f64: 1.0>,
  hyper_max_exclusive = array<i32: 0>}

// CHECK-LABEL: func.func @t_prepare(%{{.+}}: !llvm.ptr, %{{.+}}: !llvm.ptr, %{{.+}}: !llvm.ptr)
// CHECK: llvm.load %{{.+}} : !llvm.ptr -> f64
// CHECK: arith.truncf %{{.+}} : f64 to f32
// CHECK: llvm.store %{{.+}}, %{{.+}} : f32, !llvm.ptr
zk.prepare @t_prepare {
  %lr = zk.hyper 0
  %c = arith.truncf %lr : f64 to f32
  zk.set_coeff 0, %c : f32
}

// CHECK-LABEL: func.func @t_update_avx512(%{{.+}}: !llvm.ptr, %{{.+}}: i64, %{{.+}}: !llvm.ptr)
// CHECK-SAME: zopt.isa = "avx512"
// CHECK: scf.for
// CHECK: llvm.load %{{.+}} {alignment = 2 : i64} : !llvm.ptr -> vector<16xi16>
// CHECK: arith.shli %{{.+}}, %{{.+}} : vector<16xi32>
// CHECK: arith.bitcast %{{.+}} : vector<16xi32> to vector<16xf32>
// CHECK: arith.subf %{{.+}}, %{{.+}} : vector<16xf32>
// CHECK: arith.constant dense<32767> : vector<16xi32>
// CHECK: arith.cmpf uno
// CHECK: arith.trunci %{{.+}} : vector<16xi32> to vector<16xi16>
// CHECK: llvm.store %{{.+}}, %{{.+}} {alignment = 2 : i64} : vector<16xi16>, !llvm.ptr
// CHECK: scf.for
// CHECK: llvm.load %{{.+}} {alignment = 2 : i64} : !llvm.ptr -> i16
// CHECK: llvm.store %{{.+}}, %{{.+}} {alignment = 2 : i64} : i16, !llvm.ptr
// CHECK-LABEL: func.func @t_update_avx2
// CHECK: vector<8xi16>
zk.kernel @t_update update {
  %p = zk.load 0 : bf16
  %g = zk.load 1 : bf16
  %pf = arith.extf %p : bf16 to f32
  %gf = arith.extf %g : bf16 to f32
  %lr = zk.coeff 0
  %d = arith.mulf %lr, %gf : f32
  %p1 = arith.subf %pf, %d : f32
  zk.store 0, %p1 : f32 into bf16
}

// The reduction accumulates x*x in f64 lanes, then reduces once.
// CHECK-LABEL: func.func @t_sumsq_avx512(%{{.+}}: !llvm.ptr, %{{.+}}: i64, %{{.+}}: !llvm.ptr) -> f64
// CHECK: scf.for {{.+}} iter_args(%{{.+}} = %{{.+}}) -> (vector<16xf64>)
// CHECK: arith.extf %{{.+}} : vector<16xf32> to vector<16xf64>
// CHECK: arith.mulf %{{.+}}, %{{.+}} : vector<16xf64>
// CHECK: vector.reduction <add>, %{{.+}} : vector<16xf64> into f64
// CHECK: scf.for {{.+}} -> (f64)
zk.kernel @t_sumsq sumsq {
  %g = zk.load 1 : bf16
  %gf = arith.extf %g : bf16 to f32
  zk.accumulate_sumsq %gf : f32
}

// CHECK: llvm.mlir.global external constant @zopt_step_descriptor("ZOPTDSC1
