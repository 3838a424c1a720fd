// RUN: zopt-opt %s --split-input-file --convert-zk-to-cpu="isas=avx512,avx2" | FileCheck %s
// RUN: zopt-opt %s --split-input-file --convert-zk-to-cpu | FileCheck %s --check-prefix=BF16

// One function per kernel and ISA, with the C ABI of abi.h; updates load
// through the `in` pointer table and store through `out`, a vector loop of
// two registers per iteration and a scalar tail loop; sums of squares run
// 32 f64 lanes on every ISA (abi.h's order) with a masked tail; bf16 stores
// round to nearest even in integer arithmetic (add 0x7FFF + lsb, NaN -> set
// the quiet bit). An update whose every load and store is bf16 runs in
// split order: each 32-bit word widens to its even element (shift) and odd
// one (mask), and a store puts the rounded words back (even >> 16 | odd &
// 0xFFFF0000) - no 16-bit shuffle; there the NaN case is a branch taken
// only by a vector holding a NaN; other bf16 loads widen by interleaving
// with zero and keep the high halves with one shuffle (the last case of
// this file). The functions'
// kernel-table entries ([role, isa, symbol], abi.h codes) are recorded on
// the zk.descriptor for zopt-emit-descriptor, in the order the descriptor
// lists them: PREPARE (no ISA), then per kernel its variants, best first.

zk.descriptor {name = "t", zero_stage = 0 : i64, align = 1 : i64, flags = 4 : i64,
  max_norm = 0.0 : f64, num_coeffs = 1 : i64,
  state_kinds = array<i32: 1, 2>, state_dtypes = array<i32: 2, 2>,
  state_placements = array<i32: 1, 1>, state_roundings = array<i32: 1, 1>,
  state_inits = array<i32: 1, 1>, state_access = array<i32: 3, 1>, state_flags = array<i32: 0, 0>,
  hyper_kinds = array<i32: 1>, hyper_defaults = array<f64: 0.001>,
  hyper_mins = array<f64: 0.0>, hyper_maxs = array<f64: 1.0>,
  hyper_max_exclusive = array<i32: 0>}

// CHECK: zk.descriptor {{{.*}}cpu_kernels = {{\[}}[1 : i32, 0 : i32, "t_prepare"], [2 : i32, 2 : i32, "t_update_avx512"], [2 : i32, 1 : i32, "t_update_avx2"], [3 : i32, 2 : i32, "t_sumsq_avx512"], [3 : i32, 1 : i32, "t_sumsq_avx2"]],
// BF16: zk.descriptor {{{.*}}cpu_kernels = {{\[}}[1 : i32, 0 : i32, "t_prepare"], [2 : i32, 3 : i32, "t_update_avx512bf16"], [2 : i32, 2 : i32, "t_update_avx512"], [2 : i32, 1 : i32, "t_update_avx2"], [3 : i32, 2 : i32, "t_sumsq_avx512"], [3 : i32, 1 : i32, "t_sumsq_avx2"]],
// CHECK-LABEL: func.func @t_prepare(%{{.+}}: !llvm.ptr, %{{.+}}: !llvm.ptr, %{{.+}}: !llvm.ptr)
// CHECK: llvm.load %{{.+}} : !llvm.ptr -> f64
// CHECK: arith.truncf %{{.+}} : f64 to f32
// CHECK: llvm.store %{{.+}}, %{{.+}} : f32, !llvm.ptr
zk.prepare @t_prepare {
  %lr = zk.hyper 0
  %c = arith.truncf %lr : f64 to f32
  zk.set_coeff 0, %c : f32
}

// CHECK-LABEL: func.func @t_update_avx512(
// CHECK-SAME: %[[IN:[a-z0-9]+]]: !llvm.ptr, %[[OUT:[a-z0-9]+]]: !llvm.ptr, %{{.+}}: i64, %{{.+}}: !llvm.ptr)
// CHECK-SAME: zopt.isa = "avx512"
// CHECK: llvm.getelementptr %[[IN]][0]
// CHECK: llvm.getelementptr %[[IN]][1]
// CHECK: llvm.getelementptr %[[OUT]][0]
// CHECK: scf.for %{{.+}} step %c32_i64
// CHECK: llvm.load %{{.+}} {alignment = 2 : i64} : !llvm.ptr -> vector<32xi16>
// CHECK: %[[W:.+]] = vector.bitcast %{{.+}} : vector<32xi16> to vector<16xi32>
// CHECK: %[[EV:.+]] = arith.shli %[[W]], %{{.+}} : vector<16xi32>
// CHECK: %[[OD:.+]] = arith.andi %[[W]], %{{.+}} : vector<16xi32>
// CHECK: vector.shuffle %[[EV]], %[[OD]] [0, 1, 2, {{.+}}, 30, 31] : vector<16xi32>, vector<16xi32>
// CHECK-NOT: vector<64xi16>
// CHECK: %[[X:.+]] = arith.subf %{{.+}}, %{{.+}} : vector<32xf32>
// CHECK-NOT: call_intrinsic
// One unordered compare of the two halves: a NaN anywhere takes the
// NaN-exact rounding (the select), else the finite one; on AVX-512 that is
// add 0x8000, and a tie (low half 0) clears the bf16's lowest bit. Either
// packs with one VPTERNLOGD after the shift.
// CHECK: %[[X0:.+]] = vector.extract_strided_slice %[[X]] {offsets = [0], sizes = [16]
// CHECK: %[[X1:.+]] = vector.extract_strided_slice %[[X]] {offsets = [16], sizes = [16]
// CHECK: %[[U:.+]] = arith.cmpf uno, %[[X0]], %[[X1]] : vector<16xf32>
// CHECK: %[[ANY:.+]] = vector.reduction <or>, %[[U]] : vector<16xi1> into i1
// CHECK: %[[ST:.+]] = scf.if %[[ANY]] -> (vector<32xi16>) {
// CHECK: arith.constant dense<32767> : vector<32xi32>
// CHECK: arith.constant dense<4194304> : vector<32xi32>
// CHECK: %[[R:.+]] = arith.select
// CHECK: %[[LO:.+]] = vector.shuffle %[[R]], %[[R]] [0, 1, {{.+}}, 14, 15] : vector<32xi32>, vector<32xi32>
// CHECK: %[[HI:.+]] = vector.shuffle %[[R]], %[[R]] [16, 17, {{.+}}, 30, 31] : vector<32xi32>, vector<32xi32>
// CHECK: %[[SH:.+]] = arith.shrui %[[LO]], %{{.+}} : vector<16xi32>
// CHECK: llvm.call_intrinsic "llvm.x86.avx512.pternlog.d.512"(%[[SH]], %[[HI]], %{{.+}}, %{{.+}})
// CHECK: vector.bitcast %{{.+}} : vector<16xi32> to vector<32xi16>
// CHECK: } else {
// CHECK: %[[T:.+]] = arith.addi %{{.+}}, %{{.+}} : vector<32xi32>
// CHECK: arith.constant dense<65535> : vector<32xi32>
// CHECK: %[[TIE:.+]] = arith.cmpi eq
// CHECK: arith.constant dense<-65537> : vector<32xi32>
// CHECK: %[[E:.+]] = arith.andi %[[T]], %{{.+}} : vector<32xi32>
// CHECK: %[[R2:.+]] = arith.select %[[TIE]], %[[E]], %[[T]]
// CHECK-NOT: arith.cmpf
// CHECK: vector.shuffle %[[R2]], %[[R2]] [0, 1,
// CHECK: llvm.call_intrinsic "llvm.x86.avx512.pternlog.d.512"
// CHECK: }
// CHECK-NOT: vector<64xi16>
// CHECK: llvm.store %[[ST]], %{{.+}} {alignment = 2 : i64} : vector<32xi16>, !llvm.ptr
// The tail on AVX-512: masked steps of one register (16 lanes), masks in
// element order (memory) though the lanes compute in split order.
// CHECK: scf.for %{{.+}} step %c16_i64
// CHECK: %[[TM:.+]] = vector.create_mask %{{.+}} : vector<16xi1>
// CHECK: llvm.intr.masked.load %{{.+}}, %[[TM]], %{{.+}} {alignment = 2 : i32} : (!llvm.ptr, vector<16xi1>, vector<16xi16>) -> vector<16xi16>
// CHECK: arith.subf %{{.+}}, %{{.+}} : vector<16xf32>
// CHECK: llvm.intr.masked.store %{{.+}}, %{{.+}}, %[[TM]] {alignment = 2 : i32} : vector<16xi16>, vector<16xi1> into !llvm.ptr
// CHECK-NOT: : i16, !llvm.ptr
// CHECK-LABEL: func.func @t_update_avx2
// CHECK: vector<16xi16>
// On AVX2 the finite rounding adds 0x7FFF + lsb and the pack is generic.
// CHECK: arith.cmpf uno, %{{.+}}, %{{.+}} : vector<8xf32>
// CHECK: scf.if %{{.+}} -> (vector<16xi16>) {
// CHECK: arith.select
// CHECK: } else {
// CHECK: arith.constant dense<32767> : vector<16xi32>
// CHECK-NOT: arith.select
// CHECK: arith.ori %{{.+}}, %{{.+}} : vector<8xi32>
// CHECK: }
// On AVX2 (no masked 16-bit loads or stores) the tail stays scalar.
// CHECK: scf.for %{{.+}} step %c1_i64
// CHECK: llvm.load %{{.+}} {alignment = 2 : i64} : !llvm.ptr -> i16
// CHECK: llvm.store %{{.+}}, %{{.+}} {alignment = 2 : i64} : i16, !llvm.ptr

// By default a third variant of the bf16-storing update: subnormal lanes
// found with VFPCLASSPS send the vector down the integer path, else one
// VCVTNE2PS2BF16 rounds both halves. The sumsq kernel stores nothing, so its
// best variant stays avx512.
// BF16-LABEL: func.func @t_update_avx512bf16(
// BF16-SAME: zopt.isa = "avx512bf16"
// BF16: scf.for
// BF16: llvm.call_intrinsic "llvm.x86.avx512.fpclass.ps.512"(%{{.+}}, %{{.+}}) : (vector<16xf32>, i32) -> vector<16xi1>
// BF16: llvm.call_intrinsic "llvm.x86.avx512.fpclass.ps.512"
// BF16: vector.reduction <or>, %{{.+}} : vector<16xi1> into i1
// BF16: scf.if %{{.+}} -> (vector<32xi16>) {
// BF16: arith.cmpf uno
// BF16: } else {
// BF16: llvm.call_intrinsic "llvm.x86.avx512bf16.cvtne2ps2bf16.512"(%{{.+}}, %{{.+}}) : (vector<16xf32>, vector<16xf32>) -> vector<32xbf16>
// BF16: arith.bitcast %{{.+}} : vector<32xbf16> to vector<32xi16>
// BF16: llvm.store %{{.+}}, %{{.+}} {alignment = 2 : i64} : vector<32xi16>, !llvm.ptr
// BF16-LABEL: func.func @t_update_avx512(
// BF16-LABEL: func.func @t_update_avx2(
// BF16-NOT: func.func @t_sumsq_avx512bf16
// BF16-LABEL: func.func @t_sumsq_avx512(
// BF16-NOT: func.func @t_sumsq_avx512bf16
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

// The reduction accumulates x*x in 32 f64 lanes on every ISA (lane l takes
// elements l, l + 32, ...), the tail is one masked iteration, then the lanes
// are added in order (no reassociation: LLVM's ordered reduction). The
// square of a widened f32 is exact, so mul and add may fuse (contract).
// All loads bf16: each 32-bit word is split into its even element (shift)
// and odd one (mask), so lane j holds element 2j (j < 16) or 2(j-16)+1; the
// tail mask gets that order and one shuffle restores abi.h's lane order
// before the ordered sum. Every array is prefetched 2 KiB ahead.
// CHECK-LABEL: func.func @t_sumsq_avx512(%{{.+}}: !llvm.ptr, %{{.+}}: i64, %{{.+}}: !llvm.ptr) -> f64
// CHECK: scf.for {{.+}} iter_args(%{{.+}} = %{{.+}}) -> (vector<32xf64>)
// CHECK: arith.constant 2048 : i64
// CHECK: "llvm.intr.prefetch"(%{{.+}}) <{cache = 1 : i32, hint = 3 : i32, rw = 0 : i32}>
// CHECK: %[[W:.+]] = vector.bitcast %{{.+}} : vector<32xi16> to vector<16xi32>
// CHECK: %[[EV:.+]] = arith.shli %[[W]], %{{.+}} : vector<16xi32>
// CHECK: arith.constant dense<-65536> : vector<16xi32>
// CHECK: %[[OD:.+]] = arith.andi %[[W]], %{{.+}} : vector<16xi32>
// CHECK: vector.shuffle %[[EV]], %[[OD]] [0, 1, 2, {{.+}}, 30, 31] : vector<16xi32>, vector<16xi32>
// CHECK: arith.extf %{{.+}} : vector<32xf32> to vector<32xf64>
// CHECK: arith.mulf %{{.+}}, %{{.+}} fastmath<contract> : vector<32xf64>
// CHECK: arith.addf %{{.+}}, %{{.+}} fastmath<contract> : vector<32xf64>
// CHECK: scf.if %{{.+}} -> (vector<32xf64>)
// CHECK: %[[M:.+]] = vector.create_mask %{{.+}} : vector<32xi1>
// CHECK: llvm.intr.masked.load %{{.+}}, %[[M]], %{{.+}} {alignment = 2 : i32} : (!llvm.ptr, vector<32xi1>, vector<32xi16>) -> vector<32xi16>
// CHECK: %[[PM:.+]] = vector.shuffle %[[M]], %[[M]] [0, 2, 4, {{.+}}, 28, 30, 1, 3, {{.+}}, 29, 31] : vector<32xi1>, vector<32xi1>
// CHECK: arith.select %[[PM]], %{{.+}}, %{{.+}} : vector<32xi1>, vector<32xf64>
// CHECK: %[[LANES:.+]] = vector.shuffle %[[ACC:.+]], %[[ACC]] [0, 16, 1, 17, 2, 18, {{.+}}, 14, 30, 15, 31] : vector<32xf64>, vector<32xf64>
// CHECK: vector.reduction <add>, %[[LANES]] : vector<32xf64> into f64
// CHECK-NOT: fastmath<reassoc
// The pair entry (abi.h "SUMSQ pairs", AVX-512 only): both chunks' common
// vectors in one loop, each with its own accumulators, then each chunk's
// rest, tail and ordered sum, stored to out[0] and out[1].
// CHECK-LABEL: func.func @t_sumsq_avx512_x2(%{{.+}}: !llvm.ptr, %{{.+}}: i64, %{{.+}}: !llvm.ptr, %{{.+}}: !llvm.ptr, %{{.+}}: i64, %{{.+}}: !llvm.ptr, %{{.+}}: !llvm.ptr) attributes
// CHECK: arith.minsi
// CHECK: scf.for {{.+}} iter_args(%{{.+}} = %{{.+}}, %{{.+}} = %{{.+}}) -> (vector<32xf64>, vector<32xf64>)
// CHECK: vector.reduction <add>, %{{.+}} : vector<32xf64> into f64
// CHECK: llvm.store
// CHECK: vector.reduction <add>, %{{.+}} : vector<32xf64> into f64
// CHECK: llvm.store
// CHECK-NOT: fastmath<reassoc
// CHECK-LABEL: func.func @t_sumsq_avx2(
// CHECK: -> (vector<32xf64>)
// CHECK-NOT: @t_sumsq_avx2_x2
zk.kernel @t_sumsq sumsq {
  %g = zk.load 1 : bf16
  %gf = arith.extf %g : bf16 to f32
  zk.accumulate_sumsq %gf : f32
}


// -----

// A store with rounding = 2 (stochastic): the update takes (key, first)
// after the ABI's four arguments, the element index vector is first + i +
// iota (in split order here: every access is bf16), and the 16 random bits are fmix32((index * 0x9E3779B1) ^ (key +
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
// CHECK: arith.constant dense<[0, 2, 4, {{.+}}, 28, 30, 1, 3, {{.+}}, 29, 31]> : vector<32xi32>
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
// The masked tail rounds the same way, lane j at its element's index (split
// order: the even elements, then the odd ones).
// CHECK: arith.constant dense<[0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15]> : vector<16xi32>
// CHECK: scf.for %{{.+}} step %c16_i64
// CHECK: arith.addi %[[FIRST]], %{{.+}} : i32
// CHECK: llvm.intr.masked.store %{{.+}}, %{{.+}}, %{{.+}} {alignment = 2 : i32} : vector<16xi16>, vector<16xi1> into !llvm.ptr
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

// -----

// zk.control becomes `void c_control(zopt_control *)` (abi.h CONTROL, no
// ISA: baseline x86-64): each input field loaded at its byte offset in
// zopt_control (sumsq 0, max_norm 8, scale 16, growth_interval 48,
// good_steps 56, dynamic 64 as a u32 != 0), each output stored at its own
// (norm 72, clip_coef 80, new_scale 88, new_good_steps 96, skip 104 and
// advance 108 as u32 0/1); its kernel-table entry is [6, 0, "c_control"].
zk.descriptor {name = "c", zero_stage = 0 : i64, align = 1 : i64, flags = 6 : i64,
  max_norm = 0.0 : f64, num_coeffs = 0 : i64,
  state_kinds = array<i32: 1, 2>, state_dtypes = array<i32: 1, 1>,
  state_placements = array<i32: 1, 1>, state_roundings = array<i32: 1, 1>,
  state_inits = array<i32: 1, 1>, state_access = array<i32: 3, 1>, state_flags = array<i32: 0, 0>,
  hyper_kinds = array<i32>, hyper_defaults = array<f64>,
  hyper_mins = array<f64>, hyper_maxs = array<f64>, hyper_max_exclusive = array<i32>}
// CHECK: zk.descriptor {{{.*}}cpu_kernels = {{\[}}[6 : i32, 0 : i32, "c_control"]]
// CHECK-LABEL: func.func @c_control(
// CHECK-SAME: %[[IO:.+]]: !llvm.ptr) attributes {zopt.isa = "none"}
// CHECK: %[[PS:.+]] = llvm.getelementptr %[[IO]][0] : (!llvm.ptr) -> !llvm.ptr, i8
// CHECK: %[[S:.+]] = llvm.load %[[PS]] : !llvm.ptr -> f64
// CHECK: %[[N:.+]] = math.sqrt %[[S]] : f64
// CHECK: llvm.getelementptr %[[IO]][16] : (!llvm.ptr) -> !llvm.ptr, i8
// CHECK: llvm.getelementptr %[[IO]][64] : (!llvm.ptr) -> !llvm.ptr, i8
// CHECK: %[[DW:.+]] = llvm.load %{{.+}} : !llvm.ptr -> i32
// CHECK: arith.cmpi ne, %[[DW]], %{{.+}} : i32
// CHECK: %[[PN:.+]] = llvm.getelementptr %[[IO]][72] : (!llvm.ptr) -> !llvm.ptr, i8
// CHECK: llvm.store %[[N]], %[[PN]] : f64, !llvm.ptr
// CHECK: %[[SK:.+]] = arith.extui %{{.+}} : i1 to i32
// CHECK: %[[PK:.+]] = llvm.getelementptr %[[IO]][104] : (!llvm.ptr) -> !llvm.ptr, i8
// CHECK: llvm.store %[[SK]], %[[PK]] : i32, !llvm.ptr
// CHECK: llvm.getelementptr %[[IO]][96] : (!llvm.ptr) -> !llvm.ptr, i8
// CHECK: return
zk.control @c_control {
  %s = zk.control_in sumsq : f64
  %n = math.sqrt %s : f64
  %inf = arith.constant 0x7FF0000000000000 : f64
  %a = math.absf %s : f64
  %fin = arith.cmpf olt, %a, %inf : f64
  %true = arith.constant true
  %skip = arith.xori %fin, %true : i1
  %one = arith.constant 1.0 : f64
  %S = zk.control_in scale : f64
  %d = zk.control_in dynamic : i1
  %S2 = arith.addf %S, %S : f64
  %nS = arith.select %d, %S2, %S : f64
  %good = zk.control_in good_steps : i64
  zk.control_out norm, %n : f64
  zk.control_out clip_coef, %one : f64
  zk.control_out skip, %skip : i1
  zk.control_out advance, %fin : i1
  zk.control_out new_scale, %nS : f64
  zk.control_out new_good_steps, %good : i64
}

// -----

// A bf16 param updated from an f32 gradient: not every access is bf16, so
// the update stays in element order: the bf16 load widens by interleaving
// with zero and the store keeps the high halves with one shuffle.

zk.descriptor {name = "m", zero_stage = 0 : i64, align = 1 : i64, flags = 4 : i64,
  max_norm = 0.0 : f64, num_coeffs = 1 : i64,
  state_kinds = array<i32: 1, 2>, state_dtypes = array<i32: 2, 1>,
  state_placements = array<i32: 1, 1>, state_roundings = array<i32: 1, 1>,
  state_inits = array<i32: 1, 1>, state_access = array<i32: 3, 1>, state_flags = array<i32: 0, 0>,
  hyper_kinds = array<i32: 1>, hyper_defaults = array<f64: 0.001>,
  hyper_mins = array<f64: 0.0>, hyper_maxs = array<f64: 1.0>,
  hyper_max_exclusive = array<i32: 0>}

zk.prepare @m_prepare {
  %lr = zk.hyper 0
  %c = arith.truncf %lr : f64 to f32
  zk.set_coeff 0, %c : f32
}

// CHECK-LABEL: func.func @m_update_avx512(
// CHECK: llvm.load %{{.+}} {alignment = 2 : i64} : !llvm.ptr -> vector<32xi16>
// CHECK: vector.shuffle %{{.+}}, %{{.+}} [32, 0, 32, 1, {{.+}}, 32, 31] : vector<32xi16>, vector<32xi16>
// CHECK: vector.bitcast %{{.+}} : vector<64xi16> to vector<32xf32>
// CHECK: llvm.load %{{.+}} {alignment = 4 : i64} : !llvm.ptr -> vector<32xf32>
// CHECK: arith.cmpf uno
// CHECK: vector.bitcast %{{.+}} : vector<32xi32> to vector<64xi16>
// CHECK: vector.shuffle %{{.+}}, %{{.+}} [1, 3, 5, {{.+}}, 61, 63] : vector<64xi16>, vector<64xi16>
// CHECK: llvm.store %{{.+}}, %{{.+}} {alignment = 2 : i64} : vector<32xi16>, !llvm.ptr
zk.kernel @m_update update {
  %p = zk.load 0 : bf16
  %g = zk.load 1 : f32
  %pf = arith.extf %p : bf16 to f32
  %lr = zk.coeff 0
  %d = arith.mulf %lr, %g : f32
  %p1 = arith.subf %pf, %d : f32
  zk.store 0, %p1 : f32 into bf16
}
