// backend/cuda/cuda_internal.h - the parts of the CUDA backend (cuda.h),
// one concern per file, and what they share; nothing outside this folder
// includes it:
//
//   cuda.cpp     the Backend (backend/backend.h) over the parts below
//   module.cpp   the step's GPU image for this device, its kernels
//                (parameters, block sizes, occupancy); the backend's state
//                made at create and its tensors' pointers checked
//   tables.cpp   device memory (the caller's allocator or cuMemAlloc), the
//                layout of the groups' flat buffers, the device tables
//                (segments, work list, hyperparameters, globals, scaler,
//                active mask) built at finalize, pushed and pulled; a
//                state's copies; free
//   rebind.cpp   tensors' memory moved after finalize: the device's
//                state pointer table rewritten, stream-ordered (also
//                inside a CUDA graph capture)
//   launch.cpp   a step: its program's ops as launches on the optimizer's
//                stream, the program checked, the step's result read back
//   linked.cpp   a GPU step as a part of a linked step: its sum of
//                squares to the host, the shared decision into the step
//                globals, the coefficients again with its clip
//
// device.h is what this backend shares with the offload backend (driver,
// context, events, streams).
#ifndef ZOPT_RUNTIME_BACKEND_CUDA_INTERNAL_H
#define ZOPT_RUNTIME_BACKEND_CUDA_INTERNAL_H

#include "backend/cuda/device.h"

namespace zopt {

// The CUDA backend's state of optimizer o (cuda.cpp).
GpuState *G(const zopt_optimizer *o);

// module.cpp
zopt_status gpu_create(zopt_optimizer *o, GpuState **out);
zopt_status gpu_check_tensor(const zopt_optimizer *o, int tensor, void *param, void *grad, const char *fn);

// tables.cpp
zopt_status gpu_set_allocator(zopt_optimizer *o, const zopt_device_allocator *a);
zopt_status gpu_finalize(zopt_optimizer *o);
// State si of tensor t on the device (Backend::state_ptr), and the bytes of
// its group's flat buffer (a PER_BLOCK state, a q8 absmax: one element per
// ZOPT_Q8_BLOCK, each segment at a block boundary).
void *gpu_state_ptr(const zopt_optimizer *o, int t, int si);
size_t gpu_state_bytes(const zopt_optimizer *o, const Group &gr, int si);
zopt_status gpu_push(zopt_optimizer *o);
zopt_status read_device_state(zopt_optimizer *o, zopt_gpu_step_globals *sg, zopt_gpu_scaler *sc, const char *what);
zopt_status gpu_pull(zopt_optimizer *o);
void gpu_hypers_changed(zopt_optimizer *o);
zopt_status gpu_set_hyper(zopt_optimizer *o, int group, int hi, double value);
zopt_status gpu_set_max_norm(zopt_optimizer *o, double value);
// The step globals' max_norm (abi.h), which the kernels' CONTROL reads.
inline CUdeviceptr sg_max_norm(const GpuState *g) { return g->d_sg + offsetof(zopt_gpu_step_globals, max_norm); }
zopt_status gpu_copy(const zopt_optimizer *o, int t, int si, void *host, size_t bytes, bool to_device);
zopt_status gpu_refresh_master(zopt_optimizer *o, int first, int count);
void gpu_free(zopt_optimizer *o);

// rebind.cpp
zopt_status gpu_memory_moved(zopt_optimizer *o, const int32_t *tensors, int64_t n);
// Before a step's first launch (gpu_begin_step): the table uploaded whole
// after a failed write or after a capture wrote entries by value, and the
// check that every active tensor has gradient memory.
zopt_status gpu_ptrs_before_step(zopt_optimizer *o, bool capturing);
// Whether some tensor has no gradient memory (g->null_grads: the step then
// checks that no such tensor is active).
void gpu_note_null_grads(const zopt_optimizer *o, GpuState *g);

// launch.cpp
zopt_status validate_program(const zopt_optimizer *o);
zopt_status gpu_begin_step(zopt_optimizer *o, bool *capturing);
zopt_status gpu_run_op(zopt_optimizer *o, size_t i);
zopt_status gpu_end_step(zopt_optimizer *o, bool cap, zopt_step_result *result);
zopt_status gpu_result(zopt_optimizer *o, zopt_step_result *result);

// linked.cpp
// Before a linked step of several parts: refused inside a capture; the
// counts and the scaler pulled.
zopt_status gpu_begin_linked(zopt_optimizer *o, const char *fn);
// At the NORM: this part's sum of squares (SUMSQ's last block's sum of its
// block partials in block order), read with one stream synchronisation.
zopt_status gpu_linked_sumsq(zopt_optimizer *o, double *sumsq);
// Before the first UPDATE or FINISH: the decision `ctl` (on the linked
// sum) into the step globals, and with clipping PREPARE (program op
// `prepare_op`) again with its clip coefficient.
zopt_status gpu_apply_linked(zopt_optimizer *o, const zopt_control &ctl, size_t prepare_op);

}  // namespace zopt

#endif
