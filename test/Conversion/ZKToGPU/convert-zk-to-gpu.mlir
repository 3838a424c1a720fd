// RUN: zopt-opt %s --split-input-file --convert-zk-to-gpu="chips=sm_80,sm_90" --convert-zk-to-cpu="isas=avx2" | FileCheck %s

// A step whose states are on the GPU: one gpu.module with one NVVM target
// per chip and five kernels (prepare, update, sumsq, finish, init) with the
// launch ABI of abi.h, each declaring its block size (nvvm.reqntid); the
// update walks the chunk work list (block b takes chunks b, b + gridDim.x,
// ...): per chunk its begin/segment/n, the segment's group and state
// pointers, the scalar head after which every used pointer is 16-byte
// aligned (from the narrowest state's misalignment, checked against every
// pointer), then 16-byte vector accesses (8 x bf16) through global-space
// pointers over the middle and one scalar loop over head and tail; the host
// keeps only the f64 prepare and the descriptor, on which the kernel table
// is recorded for zopt-emit-descriptor: the host PREPARE, the GPU kernels
// ([role, entry], abi.h codes) and one image per chip ([sm, symbol]).

zk.descriptor {name = "t", zero_stage = 0 : i64, align = 1 : i64, flags = 5 : i64,
  max_norm = 1.0 : f64, num_coeffs = 2 : i64,
  state_kinds = array<i32: 1, 2>, state_dtypes = array<i32: 2, 2>,
  state_placements = array<i32: 2, 2>, state_roundings = array<i32: 1, 1>,
  state_inits = array<i32: 1, 1>, state_access = array<i32: 3, 1>, state_flags = array<i32: 0, 0>,
  hyper_kinds = array<i32: 1>, hyper_defaults = array<f64: 0.001>,
  hyper_mins = array<f64: 0.0>, hyper_maxs = array<f64: 1.0>,
  hyper_max_exclusive = array<i32: 0>}

// CHECK: zk.descriptor {{{.*}}cpu_kernels = {{\[}}[1 : i32, 0 : i32, "t_prepare"], [6 : i32, 0 : i32, "t_control"]], flags = 133 : i64, gpu_images = {{\[}}[80 : i32, "t_gpu_sm_80"], [90 : i32, "t_gpu_sm_90"]], gpu_kernels = {{\[}}[1 : i32, "t_prepare_gpu"], [2 : i32, "t_update"], [3 : i32, "t_sumsq"], [5 : i32, "t_finish"]],
// CHECK-LABEL: gpu.module @t_gpu [#nvvm.target<O = 3, chip = "sm_80", features = "+ptx80">, #nvvm.target<O = 3, chip = "sm_90", features = "+ptx80">]
// PREPARE: (hypers, globals, segs, tensor_t, num_rows, coeffs), a row per
// segment: its group (word 2 of the segment) selects the hyperparameters
// and globals, the tensor's own t (tensor_t) is the STEP global.
// CHECK: gpu.func @t_prepare_gpu(%{{.+}}: !llvm.ptr, %{{.+}}: !llvm.ptr, %{{.+}}: !llvm.ptr, %{{.+}}: !llvm.ptr, %{{.+}}: i64, %{{.+}}: !llvm.ptr) kernel attributes {nvvm.reqntid = array<i32: 64, 1, 1>}
// CHECK: scf.for
// CHECK: arith.addi %{{.+}}, %c2_i64
// The clip coefficient (global 1) comes from the globals table here.
// CHECK: llvm.getelementptr %{{.+}}[1] : (!llvm.ptr<1>) -> !llvm.ptr<1>, f64
// CHECK: llvm.store %{{.+}}, %{{.+}} : f32, !llvm.ptr<1>
// CHECK: gpu.return
zk.prepare @t_prepare {
  %lr = zk.hyper 0
  %c = arith.truncf %lr : f64 to f32
  zk.set_coeff 0, %c : f32
  %clip = zk.global 1
  %cc = arith.truncf %clip : f64 to f32
  zk.set_coeff 1, %cc : f32
}

// UPDATE: (states, segs, chunks, num_chunks, coeffs, sg, active).
// CHECK-LABEL: gpu.func @t_update(%{{[a-z0-9]+}}: !llvm.ptr, %{{[a-z0-9]+}}: !llvm.ptr, %{{[a-z0-9]+}}: !llvm.ptr, %{{[a-z0-9]+}}: i64, %{{[a-z0-9]+}}: !llvm.ptr, %{{[a-z0-9]+}}: !llvm.ptr, %{{[a-z0-9]+}}: !llvm.ptr) kernel attributes {nvvm.reqntid = array<i32: 256, 1, 1>}
// CHECK: llvm.addrspacecast %{{.+}} : !llvm.ptr to !llvm.ptr<1>
// The skip flag of the step globals (byte 28).
// CHECK: llvm.getelementptr %{{.+}}[7] : (!llvm.ptr<1>) -> !llvm.ptr<1>, i32
// CHECK: gpu.block_id  x
// CHECK: gpu.grid_dim  x
// CHECK: scf.for %[[C:.+]] = %{{.+}} to %{{.+}} step %{{.+}}  : i64 {
// The chunk: begin (i64 2c), segment (i32 4c + 2), n (i32 4c + 3).
// CHECK: llvm.getelementptr %{{.+}} : (!llvm.ptr<1>, i64) -> !llvm.ptr<1>, i64
// CHECK: llvm.load %{{.+}} : !llvm.ptr<1> -> i64
// CHECK: llvm.getelementptr %{{.+}} : (!llvm.ptr<1>, i64) -> !llvm.ptr<1>, i32
// CHECK: llvm.getelementptr %{{.+}} : (!llvm.ptr<1>, i64) -> !llvm.ptr<1>, i32
// The head: the narrowest state's distance to 16 bytes, in elements.
// CHECK: llvm.ptrtoint
// CHECK: arith.andi %{{.+}}, %c15_i64{{.*}} : i64
// CHECK: arith.divui
// CHECK: arith.minui
// CHECK: arith.select
// A chunk of a tensor the step does not update (active[segment] == 0) is
// left alone.
// CHECK: llvm.load %{{.+}} : !llvm.ptr<1> -> i8
// CHECK: arith.cmpi ne, %{{.+}}, %c0_i8 : i8
// CHECK: scf.if
// CHECK: scf.for
// CHECK: llvm.load %{{.+}} {alignment = 16 : i64} : !llvm.ptr<1> -> vector<8xi16>
// CHECK: arith.constant dense<32767> : vector<8xi32>
// CHECK: llvm.store %{{.+}}, %{{.+}} {alignment = 16 : i64} : vector<8xi16>, !llvm.ptr<1>
// One scalar loop over the head and the tail.
// CHECK: scf.for
// CHECK: arith.cmpi ult
// CHECK: arith.select
// CHECK: llvm.load %{{.+}} {alignment = 2 : i64} : !llvm.ptr<1> -> i16
// CHECK: llvm.store %{{.+}}, %{{.+}} {alignment = 2 : i64} : i16, !llvm.ptr<1>
// CHECK: gpu.return
zk.kernel @t_update update {
  %p = zk.load 0 : bf16
  %g = zk.load 1 : bf16
  %pf = arith.extf %p : bf16 to f32
  %gf = arith.extf %g : bf16 to f32
  %lr = zk.coeff 0
  %clip = zk.coeff 1
  %gc = arith.mulf %gf, %clip : f32
  %d = arith.mulf %lr, %gc : f32
  %p1 = arith.subf %pf, %d : f32
  zk.store 0, %p1 : f32 into bf16
}

// The step's control (as zopt-fuse writes it for a clipping step): the
// SUMSQ kernel's last block inlines its norm, clip and skip, FINISH its
// advance; the host gets it as t_control (abi.h CONTROL).
zk.control @t_control {
  %s = zk.control_in sumsq : f64
  %n = math.sqrt %s : f64
  %a = math.absf %s : f64
  %inf = arith.constant 0x7FF0000000000000 : f64
  %fin = arith.cmpf olt, %a, %inf : f64
  %true = arith.constant true
  %skip = arith.xori %fin, %true : i1
  %m = zk.control_in max_norm : f64
  %eps = arith.constant 1.0e-6 : f64
  %d = arith.addf %n, %eps : f64
  %q = arith.divf %m, %d : f64
  %one = arith.constant 1.0 : f64
  %lt = arith.cmpf olt, %q, %one : f64
  %c = arith.select %lt, %q, %one : f64
  %clip = arith.select %skip, %one, %c : f64
  zk.control_out norm, %n : f64
  zk.control_out clip_coef, %clip : f64
  zk.control_out skip, %skip : i1
  zk.control_out advance, %fin : i1
  %S = zk.control_in scale : f64
  %good = zk.control_in good_steps : i64
  zk.control_out new_scale, %S : f64
  zk.control_out new_good_steps, %good : i64
}

// Two-stage reduction: f64 per thread, a shared-memory tree, the block's
// partial, then the last block (atomic counter) sums the partials in order,
// writes the control's norm / clip / skip and recomputes the coefficient
// table. The control's max_norm is not the compiled 1.0 but a load of the
// step globals' max_norm (word 5, zopt_gpu_step_globals; the runtime writes
// it: zopt_optimizer_set_max_norm), the same step globals the norm goes to.
// CHECK-LABEL: gpu.func @t_sumsq(
// CHECK-SAME: workgroup(%{{.+}} : memref<256xf64, #gpu.address_space<workgroup>>, %{{.+}} : memref<1xi32, #gpu.address_space<workgroup>>) kernel attributes {nvvm.reqntid = array<i32: 256, 1, 1>}
// CHECK: arith.mulf %{{.+}}, %{{.+}} : vector<8xf64>
// CHECK: gpu.barrier
// CHECK: nvvm.memory.barrier <gpu>
// CHECK: llvm.atomicrmw add %{{.+}}, %{{.+}} acq_rel : !llvm.ptr<1>, i32
// CHECK: llvm.load volatile %{{.+}} : !llvm.ptr<1> -> f64
// CHECK: math.sqrt %{{.+}} : f64
// CHECK: math.absf
// CHECK: arith.cmpf olt, %{{.+}}, %{{.+}} : f64
// CHECK: arith.xori
// CHECK-NEXT: %[[MNP:.+]] = llvm.getelementptr %[[SG:.+]][5] : (!llvm.ptr<1>) -> !llvm.ptr<1>, f64
// CHECK-NEXT: %[[MN:.+]] = llvm.load %[[MNP]] : !llvm.ptr<1> -> f64
// CHECK-NEXT: arith.constant 9.9999999999999995E-7 : f64
// CHECK-NEXT: %[[DEN:.+]] = arith.addf
// CHECK-NEXT: arith.divf %[[MN]], %[[DEN]] : f64
// CHECK: llvm.getelementptr %[[SG]][0] : (!llvm.ptr<1>) -> !llvm.ptr<1>, f64
// CHECK: gpu.barrier
// CHECK: scf.for
// CHECK: gpu.return
zk.kernel @t_sumsq sumsq {
  %g = zk.load 1 : bf16
  %gf = arith.extf %g : bf16 to f32
  zk.accumulate_sumsq %gf : f32
}

// FINISH (blocks of 32, any grid: the descriptor's flags gain
// ZOPT_FLAG_FINISH_GRID, 5 | 128 = 133 above) and INIT: no state is
// initialized from the param in this step, so INIT does nothing.
// FINISH: (globals, num_groups, sg, sc, tensor_t, active, num_rows).
// CHECK-LABEL: gpu.func @t_finish(%{{.+}}: !llvm.ptr, %{{.+}}: i64, %{{.+}}: !llvm.ptr, %{{.+}}: !llvm.ptr, %{{.+}}: !llvm.ptr, %{{.+}}: !llvm.ptr, %{{.+}}: i64)
// CHECK-SAME: kernel attributes {nvvm.reqntid = array<i32: 32, 1, 1>}
// The control on sg->sumsq (0 without step globals): advance = finite.
// CHECK: scf.if %{{.+}} -> (f64)
// CHECK: math.absf
// CHECK: arith.cmpf olt
// CHECK: scf.if
// When it advances: the grid's threads stride over the tensors (from
// blockIdx * blockDim + threadIdx by gridDim * blockDim; t + 1 where
// active), then block 0's over the groups (STEP + 1 where
// active[num_rows + g]).
// CHECK: gpu.grid_dim x
// CHECK: scf.for
// CHECK: llvm.load %{{.+}} : !llvm.ptr<1> -> i8
// CHECK: arith.addf %{{.+}}, %cst{{.*}} : f64
// CHECK: scf.if
// CHECK: scf.for
// CHECK: arith.addi
// CHECK: llvm.load %{{.+}} : !llvm.ptr<1> -> i8
// CHECK-LABEL: gpu.func @t_init_gpu(
// CHECK-SAME: kernel attributes {nvvm.reqntid = array<i32: 256, 1, 1>}
// CHECK-NEXT: gpu.return
// CHECK: func.func @t_prepare(%{{.+}}: !llvm.ptr, %{{.+}}: !llvm.ptr, %{{.+}}: !llvm.ptr) attributes {zopt.isa = "none"}
// CHECK: func.func @t_control(%{{.+}}: !llvm.ptr) attributes {zopt.isa = "none"}
// CHECK-NOT: func.func @t_update

// -----

// A CPU step is left to convert-zk-to-cpu: no gpu.module, no GPU entries.
// CHECK-NOT: gpu_kernels
zk.descriptor {name = "c", zero_stage = 0 : i64, align = 1 : i64, flags = 0 : i64,
  max_norm = 0.0 : f64, num_coeffs = 1 : i64,
  state_kinds = array<i32: 1, 2>, state_dtypes = array<i32: 1, 1>,
  state_placements = array<i32: 1, 1>, state_roundings = array<i32: 1, 1>,
  state_inits = array<i32: 1, 1>, state_access = array<i32: 3, 1>, state_flags = array<i32: 0, 0>,
  hyper_kinds = array<i32: 1>, hyper_defaults = array<f64: 0.001>,
  hyper_mins = array<f64: 0.0>, hyper_maxs = array<f64: 1.0>,
  hyper_max_exclusive = array<i32: 0>}
zk.prepare @c_prepare {
  %lr = zk.hyper 0
  %c = arith.truncf %lr : f64 to f32
  zk.set_coeff 0, %c : f32
}
// CHECK-NOT: gpu.module
// CHECK: func.func @c_update_avx2(%{{.+}}: !llvm.ptr, %{{.+}}: i64, %{{.+}}: !llvm.ptr)
// CHECK-SAME: zopt.isa = "avx2"
zk.kernel @c_update update {
  %p = zk.load 0 : f32
  %g = zk.load 1 : f32
  %lr = zk.coeff 0
  %d = arith.mulf %lr, %g : f32
  %p1 = arith.subf %p, %d : f32
  zk.store 0, %p1 : f32 into f32
}


// -----

// With loss scaling FINISH rewrites every group's gradient scale 1 / (S * D)
// after the scaler's update, keeping each group's sign: a group stepped
// with maximize (ZOPT_GROUP_MAXIMIZE) holds a negative scale, written by
// the host, and keeps it.
zk.descriptor {name = "s", zero_stage = 0 : i64, align = 1 : i64, flags = 6 : i64,
  max_norm = 0.0 : f64, num_coeffs = 2 : i64,
  state_kinds = array<i32: 1, 2>, state_dtypes = array<i32: 1, 3>,
  state_placements = array<i32: 2, 2>, state_roundings = array<i32: 1, 1>,
  state_inits = array<i32: 1, 1>, state_access = array<i32: 3, 1>, state_flags = array<i32: 0, 0>,
  hyper_kinds = array<i32: 1>, hyper_defaults = array<f64: 0.001>,
  hyper_mins = array<f64: 0.0>, hyper_maxs = array<f64: 1.0>,
  hyper_max_exclusive = array<i32: 0>}
zk.prepare @s_prepare {
  %lr = zk.hyper 0
  %c = arith.truncf %lr : f64 to f32
  zk.set_coeff 0, %c : f32
  %gs = zk.global 2
  %gc = arith.truncf %gs : f64 to f32
  zk.set_coeff 1, %gc : f32
}
zk.control @s_control {
  %s = zk.control_in sumsq : f64
  %n = math.sqrt %s : f64
  %a = math.absf %s : f64
  %inf = arith.constant 0x7FF0000000000000 : f64
  %fin = arith.cmpf olt, %a, %inf : f64
  %true = arith.constant true
  %skip = arith.xori %fin, %true : i1
  %one = arith.constant 1.0 : f64
  zk.control_out norm, %n : f64
  zk.control_out clip_coef, %one : f64
  zk.control_out skip, %skip : i1
  zk.control_out advance, %fin : i1
  %S = zk.control_in scale : f64
  %good = zk.control_in good_steps : i64
  %min = zk.control_in min_scale : f64
  %bf = zk.control_in backoff_factor : f64
  %b = arith.mulf %S, %bf : f64
  %blt = arith.cmpf olt, %b, %min : f64
  %bc = arith.select %blt, %min, %b : f64
  %c1 = arith.constant 1 : i64
  %g1 = arith.addi %good, %c1 : i64
  %iv = zk.control_in growth_interval : i64
  %grow = arith.cmpi sge, %g1, %iv : i64
  %gf = zk.control_in growth_factor : f64
  %gS = arith.mulf %S, %gf : f64
  %ga = math.absf %gS : f64
  %gfin = arith.cmpf olt, %ga, %inf : f64
  %gok = arith.andi %grow, %gfin : i1
  %tS = arith.select %gok, %gS, %S : f64
  %c0 = arith.constant 0 : i64
  %tG = arith.select %grow, %c0, %g1 : i64
  %dyn = zk.control_in dynamic : i1
  %nS0 = arith.select %skip, %bc, %tS : f64
  %nS = arith.select %dyn, %nS0, %S : f64
  %nG0 = arith.select %skip, %c0, %tG : i64
  %nG = arith.select %dyn, %nG0, %good : i64
  zk.control_out new_scale, %nS : f64
  zk.control_out new_good_steps, %nG : i64
}
zk.kernel @s_update update {
  %p = zk.load 0 : f32
  %g = zk.load 1 : f16
  %gf = arith.extf %g : f16 to f32
  %lr = zk.coeff 0
  %s = zk.coeff 1
  %gs = arith.mulf %gf, %s : f32
  %d = arith.mulf %lr, %gs : f32
  %p1 = arith.subf %p, %d : f32
  zk.store 0, %p1 : f32 into f32
}
zk.kernel @s_sumsq sumsq {
  %g = zk.load 1 : f16
  %gf = arith.extf %g : f16 to f32
  %s = zk.coeff 1
  %gs = arith.mulf %gf, %s : f32
  zk.accumulate_sumsq %gs : f32
}
// CHECK-LABEL: gpu.func @s_finish(
// last_scale (word 6) = scale (word 0), then the control's new scale.
// CHECK: llvm.getelementptr %{{.+}}[6] : (!llvm.ptr<1>) -> !llvm.ptr<1>, f64
// CHECK: arith.cmpi sge
// CHECK: arith.select
// The scale 1 / (S * D), S the scaler's new scale, D its divisor (word 8).
// CHECK: llvm.getelementptr %{{.+}}[8] : (!llvm.ptr<1>) -> !llvm.ptr<1>, f64
// CHECK: %[[SD:.+]] = arith.mulf
// CHECK: %[[INV:.+]] = arith.divf %{{.+}}, %[[SD]] : f64
// Per group g: globals[3 g + 2] = old < 0 ? -inv : inv.
// CHECK: scf.for
// CHECK: arith.muli %{{.+}}, %c3_i64
// CHECK: arith.addi %{{.+}}, %c2_i64
// CHECK: %[[AT:.+]] = llvm.getelementptr
// CHECK: %[[OLD:.+]] = llvm.load %[[AT]] : !llvm.ptr<1> -> f64
// CHECK: %[[NEG:.+]] = arith.cmpf olt, %[[OLD]], %{{.+}} : f64
// CHECK: %[[MINUS:.+]] = arith.negf %[[INV]] : f64
// CHECK: %[[NEW:.+]] = arith.select %[[NEG]], %[[MINUS]], %[[INV]] : f64
// CHECK: llvm.store %[[NEW]], %[[AT]] : f64, !llvm.ptr<1>
// CHECK: gpu.return
