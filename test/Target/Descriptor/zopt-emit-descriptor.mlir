// RUN: zopt-opt %s --split-input-file --zopt-emit-descriptor | FileCheck %s
// RUN: zopt-opt %s --split-input-file --zopt-emit-descriptor | %python %S/Inputs/decode-descriptor.py %S/../../.. | FileCheck %s --check-prefix=DESC

// The zk.descriptor, the kernel tables the conversions recorded on it and
// the zprog.program become abi.h's zopt_step_descriptor: one exported
// constant (read back here through python/zopt/_lib.py's mirror of the
// struct, checksum recomputed); both ops are erased.

// A ZeRO-2 CPU step with clipping: the grad and master are sharded
// (state flag 1), the program's ops carry the abi.h codes (2 reduce-scatter
// of state 1 as bf16 into f32, 6 prepare, 4 norm partials over the owned
// range 1, 5 norm, 7 update, 3 gather of the param unless skipped, 8 finish)
// and run on the CPU (1).
// CHECK-NOT: zk.descriptor
// CHECK-NOT: zprog.program
// CHECK: llvm.mlir.global external constant @zopt_step_descriptor("ZOPTDSC1
// CHECK-SAME: {addr_space = 0 : i32, alignment = 8 : i64}
// DESC:      magic ZOPTDSC1 abi 4 size {{[0-9]+}} checksum ok
// DESC-NEXT: name z2 stage 2 align 16 flags 5 max_norm 1 coeffs 3
// DESC-NEXT: state 0: kind 1 dtype 2 placement 1 rounding 1 init 1 access 3 flags 0
// DESC-NEXT: state 1: kind 2 dtype 2 placement 1 rounding 1 init 1 access 1 flags 1
// DESC-NEXT: state 2: kind 3 dtype 1 placement 1 rounding 1 init 3 access 3 flags 1
// DESC-NEXT: hyper 0: kind 1 default 0.001 min 0 max inf exclusive 0
// DESC-NEXT: kernel 0: role 1 isa 0 device 1 z2_prepare
// DESC-NEXT: kernel 1: role 2 isa 2 device 1 z2_update_avx512
// DESC-NEXT: kernel 2: role 2 isa 1 device 1 z2_update_avx2
// DESC-NEXT: kernel 3: role 3 isa 2 device 1 z2_sumsq_avx512
// DESC-NEXT: program 0: code 2 state 1 range 0 dtype 2 accum 1 src 1 dst 1 flags 0
// DESC-NEXT: program 1: code 6 state 0 range 0 dtype 0 accum 0 src 1 dst 1 flags 0
// DESC-NEXT: program 2: code 4 state 0 range 1 dtype 0 accum 0 src 1 dst 1 flags 0
// DESC-NEXT: program 3: code 5 state 0 range 0 dtype 0 accum 0 src 1 dst 1 flags 0
// DESC-NEXT: program 4: code 7 state 0 range 1 dtype 0 accum 0 src 1 dst 1 flags 0
// DESC-NEXT: program 5: code 3 state 0 range 0 dtype 2 accum 0 src 1 dst 1 flags 1
// DESC-NEXT: program 6: code 8 state 0 range 0 dtype 0 accum 0 src 1 dst 1 flags 0
zk.descriptor {name = "z2", zero_stage = 2 : i64, align = 16 : i64, flags = 5 : i64,
  max_norm = 1.0 : f64, num_coeffs = 3 : i64,
  state_kinds = array<i32: 1, 2, 3>, state_dtypes = array<i32: 2, 2, 1>,
  state_placements = array<i32: 1, 1, 1>, state_roundings = array<i32: 1, 1, 1>,
  state_inits = array<i32: 1, 1, 3>, state_access = array<i32: 3, 1, 3>,
  state_flags = array<i32: 0, 1, 1>,
  hyper_kinds = array<i32: 1>, hyper_defaults = array<f64: 0.001>,
  hyper_mins = array<f64: 0.0>, hyper_maxs = array<f64: 0x7FF0000000000000>,
  hyper_max_exclusive = array<i32: 0>,
  cpu_kernels = [[1 : i32, 0 : i32, "z2_prepare"], [2 : i32, 2 : i32, "z2_update_avx512"],
                 [2 : i32, 1 : i32, "z2_update_avx2"], [3 : i32, 2 : i32, "z2_sumsq_avx512"]]}
zprog.program for "z2" {
  zprog.reduce_scatter grad : bf16 accumulate f32
  zprog.prepare on cpu
  zprog.norm_partials owned on cpu
  zprog.norm
  zprog.update owned on cpu
  zprog.all_gather param : bf16 unless_skipped
  zprog.finish on cpu
}

// -----

// A GPU step: the host PREPARE, then the GPU kernels (device 2, no ISA)
// and one image per architecture (role 4, isa = the SM number); every
// program op on the GPU (2).
// DESC:      magic ZOPTDSC1 abi 4 size {{[0-9]+}} checksum ok
// DESC-NEXT: name g stage 0 align 1 flags 0 max_norm 0 coeffs 1
// DESC-NEXT: state 0: kind 1 dtype 1 placement 2 rounding 1 init 1 access 3 flags 0
// DESC-NEXT: state 1: kind 2 dtype 1 placement 2 rounding 1 init 1 access 1 flags 0
// DESC-NEXT: hyper 0: kind 1 default 0.001 min 0 max 1 exclusive 0
// DESC-NEXT: kernel 0: role 1 isa 0 device 1 g_prepare
// DESC-NEXT: kernel 1: role 1 isa 0 device 2 g_prepare_gpu
// DESC-NEXT: kernel 2: role 2 isa 0 device 2 g_update
// DESC-NEXT: kernel 3: role 5 isa 0 device 2 g_finish
// DESC-NEXT: kernel 4: role 4 isa 80 device 2 g_gpu_sm_80
// DESC-NEXT: kernel 5: role 4 isa 90 device 2 g_gpu_sm_90
// DESC-NEXT: program 0: code 2 state 1 range 0 dtype 1 accum 1 src 2 dst 2 flags 0
// DESC-NEXT: program 1: code 3 state 1 range 0 dtype 1 accum 0 src 2 dst 2 flags 0
// DESC-NEXT: program 2: code 6 state 0 range 0 dtype 0 accum 0 src 2 dst 2 flags 0
// DESC-NEXT: program 3: code 7 state 0 range 2 dtype 0 accum 0 src 2 dst 2 flags 0
// DESC-NEXT: program 4: code 8 state 0 range 0 dtype 0 accum 0 src 2 dst 2 flags 0
zk.descriptor {name = "g", zero_stage = 0 : i64, align = 1 : i64, flags = 0 : i64,
  max_norm = 0.0 : f64, num_coeffs = 1 : i64,
  state_kinds = array<i32: 1, 2>, state_dtypes = array<i32: 1, 1>,
  state_placements = array<i32: 2, 2>, state_roundings = array<i32: 1, 1>,
  state_inits = array<i32: 1, 1>, state_access = array<i32: 3, 1>, state_flags = array<i32: 0, 0>,
  hyper_kinds = array<i32: 1>, hyper_defaults = array<f64: 0.001>,
  hyper_mins = array<f64: 0.0>, hyper_maxs = array<f64: 1.0>,
  hyper_max_exclusive = array<i32: 0>,
  cpu_kernels = [[1 : i32, 0 : i32, "g_prepare"]],
  gpu_kernels = [[1 : i32, "g_prepare_gpu"], [2 : i32, "g_update"], [5 : i32, "g_finish"]],
  gpu_images = [[80 : i32, "g_gpu_sm_80"], [90 : i32, "g_gpu_sm_90"]]}
zprog.program for "g" {
  zprog.reduce_scatter grad : f32 accumulate f32
  zprog.all_gather grad : f32
  zprog.prepare on gpu
  zprog.update all on gpu
  zprog.finish on gpu
}
