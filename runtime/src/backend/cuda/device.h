// backend/cuda/device.h - what the backends on a CUDA device share: GPU
// steps (cuda.cpp and its parts: states on the device, kernels from the step's images)
// and offloaded steps (backend/offload/: params/grads on the device, states
// and kernels on the CPU): the driver, a context, events, streams
// (device.cpp). Not installed.
#ifndef ZOPT_RUNTIME_BACKEND_CUDA_DEVICE_H
#define ZOPT_RUNTIME_BACKEND_CUDA_DEVICE_H

#include "backend/cuda/cuda_driver.h"
#include "internal.h"

#include <new>
#include <utility>

// Returns ZOPT_ERR_INTERNAL "what: <driver error>" when a driver call fails.
#define CU_TRY(call, what)                                                                   \
  do {                                                                                       \
    ::zopt::cu::CUresult r_ = (call);                                                        \
    if (r_ != ::zopt::cu::CUDA_SUCCESS)                                                      \
      return ::zopt::fail(ZOPT_ERR_INTERNAL, "%s: %s", what, ::zopt::cu::error_string(r_));  \
  } while (0)

namespace zopt {

using cu::CUcontext;
using cu::CUdevice;
using cu::CUdeviceptr;
using cu::CUevent;
using cu::CUfunction;
using cu::CUmodule;
using cu::CUstream;
using cu::Driver;

struct GpuState {
  const Driver *cu = nullptr;
  CUcontext ctx = nullptr;
  CUdevice dev = 0;
  bool retained = false;  // we retained the device's primary context
  int driver_version = 0;  // cuDriverGetVersion
  int sm = 0, num_sms = 1, image_sm = 0;
  uint32_t image_cuda_version = 0;  // toolkit that built the loaded image (0: unknown)
  CUmodule mod = nullptr;
  CUfunction prepare = nullptr, sumsq = nullptr, update = nullptr, finish = nullptr;
  CUfunction init = nullptr;  // INIT (abi.h), absent in older step.so files
  bool sr = false;            // UPDATE takes (globals, seed)
  CUstream stream = nullptr;  // 0: the legacy default stream
  // The optimizer's own asynchronous work is tracked by its events, never
  // by the caller's stream (which may change, be replayed on by a CUDA
  // graph, or be destroyed): `done` after every step's launches (an
  // external record node when the step is captured, so that every replay
  // records it), `hypers_ready` after every hyperparameter write,
  // `staging` after an offloaded step's copies of the params back to the
  // GPU. Every host access and every new stream waits for them.
  CUevent done = nullptr, hypers_ready = nullptr, staging = nullptr;
  bool done_recorded = false, hypers_recorded = false, staging_recorded = false;
  // A step was captured into a CUDA graph: replays advance the device's
  // step state without the runtime seeing them.
  bool captured = false;
  // Device memory: cuMemAlloc, or the caller's allocator.
  zopt_device_allocator allocator{};
  CUstream alloc_stream = nullptr;  // the stream given to allocator.alloc (finalize's)
  std::vector<std::pair<CUdeviceptr, size_t>> allocs;
  CUdeviceptr d_states = 0, d_segs = 0, d_chunks = 0, d_hypers = 0, d_globals = 0, d_coeffs = 0, d_partials = 0,
              d_sg = 0, d_scaler = 0, d_tensor_t = 0, d_active = 0;
  std::vector<double> h_hypers;  // host copy of the hyperparameter table
  int64_t num_segments = 0, num_chunks = 0, chunk_elems = 0;
  std::vector<int64_t> chunk_first;  // per segment its first chunk; [S] = num_chunks
  unsigned prepare_grid = 1, sumsq_grid = 1, update_grid = 1, init_grid = 1;
  int update_blocks_per_sm = 0, sumsq_blocks_per_sm = 0;
  bool stepped = false;
  // The running state (step counts, loss scaler) lives on the device once
  // finalized; `device_ahead` says the host copy in zopt_optimizer is stale
  // (steps ran since the last gpu_pull), `hypers_dirty` that the device's
  // hyperparameter table may be (a failed write: the next step or push
  // uploads the whole table), `max_norm_dirty` the same of the step
  // globals' max_norm (a failed zopt_optimizer_set_max_norm may have written
  // half of it: the next step or push writes the optimizer's value again).
  bool device_ahead = false;
  bool hypers_dirty = true;
  bool max_norm_dirty = false;
  double h_max_norm = 0;  // the source of that rewrite (kept alive for the async copy)
  // The state pointer table's host copy (d_states: per tensor and state,
  // element 0's address), kept for tensors whose memory moves after
  // finalize (cuda/rebind.cpp): `ptrs_dirty` after a failed write (the next
  // step rebuilds it from the tensors and uploads it whole), `ptrs_graphed`
  // the entries a CUDA graph capture wrote by value (every replay writes
  // them again: `ptrs_in_graph`, every later step outside a capture uploads
  // the whole table), `null_grads` some tensor has no gradient memory.
  std::vector<uint64_t> h_ptrs;
  std::vector<uint8_t> ptrs_graphed;
  // Its uploads' sources: two pinned copies of the table, used in turn, each
  // reused after the event recorded behind its last copy (made at the first
  // upload; null: pageable h_ptrs).
  void *ptrs_pinned[2] = {nullptr, nullptr};
  CUevent ptrs_copied[2] = {nullptr, nullptr};
  bool ptrs_copy_recorded[2] = {false, false};
  int ptrs_turn = 0;
  bool ptrs_dirty = false, ptrs_in_graph = false, null_grads = false;
  // The device allocations (start, end) that pointers checked since the
  // last gpu_forget_checked were found in (device memory of this device):
  // further pointers inside them are not queried again. Emptied after every
  // call that checks pointers (a freed allocation is never trusted later).
  mutable std::vector<std::pair<uintptr_t, uintptr_t>> checked;
  // A GPU part of a linked step (cuda/linked.cpp): the host side of its
  // sum of squares and of the decision written into the step globals (kept
  // alive for the asynchronous copy); `globals_dirty` after a failed write
  // of the CLIP_COEF global back to 1 (the next step writes it again).
  zopt_gpu_step_globals h_linked{};
  bool globals_dirty = false;
  // Offloaded steps: the pinned host staging buffers of params and grads.
  std::vector<void *> pinned;
};

// Makes the optimizer's context current for the life of the scope if it is
// not, and restores the caller's afterwards (every entry point: the
// caller's thread keeps the context it had, e.g. another device's).
class CtxScope {
 public:
  explicit CtxScope(const GpuState *g);
  ~CtxScope();
  CtxScope(const CtxScope &) = delete;
  CtxScope &operator=(const CtxScope &) = delete;
  zopt_status status() const { return st_; }

 private:
  const GpuState *g_;
  bool pushed_ = false;
  zopt_status st_ = ZOPT_OK;
};
#define ZOPT_CTX_SCOPE(g)                                  \
  ::zopt::CtxScope ctx_scope_(g);                          \
  if (zopt_status ctx_st_ = ctx_scope_.status()) return ctx_st_

// The driver, a context (the caller's current one, e.g. PyTorch's, else
// device 0's primary context, retained; never left current) and the
// device's properties (checked); `what` completes "step '<name>' <what>: no
// CUDA driver ..." messages.
zopt_status cuda_attach(GpuState *g, const char *name, const char *what);
void cuda_detach(GpuState *g);  // releases a retained primary context
// A backend's GpuState at zopt_optimizer_create: attached (cuda_attach),
// then `init` with its context current. On a failure nothing is left:
// `undo` (context current) cleans up what init made, the context is
// detached and the state deleted.
zopt_status gpu_state_create(const char *name, const char *what, zopt_status (*init)(GpuState *, const void *),
                             const void *arg, void (*undo)(GpuState *), GpuState **out);
// The optimizer's events (created on first use), destroyed.
zopt_status gpu_events(GpuState *g);
void destroy_events(GpuState *g);
// Both pointers are CUDA device (or managed) memory of the optimizer's
// device; `tensor` is the id the tensor will get (for messages).
zopt_status gpu_check_pointers(const GpuState *g, void *param, void *grad, int tensor, const char *fn);
// Forgets the allocations gpu_check_pointers found (after each call that
// checks pointers: a later call queries the driver again).
inline void gpu_forget_checked(const GpuState *g) { g->checked.clear(); }
// Whether `s` is capturing a CUDA graph (an error when the driver cannot
// tell, e.g. the legacy stream while another stream captures).
zopt_status gpu_capturing(const GpuState *g, CUstream s, bool *capturing);
// Refuses a call that cannot be captured in a CUDA graph: when `s` is
// capturing, fails with `code` and the message `fmt` (printf) and returns
// it; ZOPT_OK when it is not (gpu_capturing's error when the driver cannot
// tell).
zopt_status refuse_if_capturing(const GpuState *g, CUstream s, zopt_status code, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
// Before a host access of device memory on the optimizer's stream (a copy
// followed by a stream synchronisation): refuses during a capture (`what`
// names the call) and orders the stream after the optimizer's own
// asynchronous work, wherever it ran (its events).
zopt_status gpu_begin_host_access(GpuState *g, const char *what);
// Orders stream `s` after the optimizer's own asynchronous work.
zopt_status gpu_wait_own_work(GpuState *g, CUstream s);
// Waits on the host for the optimizer's own asynchronous work (freeing: the
// caller's stream may be gone).
void gpu_sync_own_work(GpuState *g);
// zopt_optimizer_set_stream: the optimizer's work goes on `stream` from now
// on, after its work on the previous one.
zopt_status gpu_set_stream(GpuState *g, void *stream);

}  // namespace zopt

#endif
