// backend/backend.h - the one interface every backend implements.
//
// runtime/src/backend/ owns the backends: where a step's states live and
// how the ops of its program (abi.h "The step program") run there. One is
// chosen per optimizer, at zopt_optimizer_create, from the step
// (make_backend, the only place that tells them apart); the callers (the C
// API in optimizer/, checkpoint/, exec/'s step driver) call through
// this interface and never ask which backend they hold. As in IREE's HAL
// (a table of functions per driver), each backend lives in a folder of its
// own:
//
//   cpu/      host memory: the CPU kernels on the thread pool, collectives
//             over the communicator (the host executor of exec/)
//   offload/  the CPU backend with the user's params and grads in device
//             memory, staged through pinned host buffers by the program's
//             COPY ops (ZeRO-Offload)
//   cuda/     every state in device memory; the program's ops are kernel
//             launches on the optimizer's stream, the step's running state
//             (counts, loss scaler) lives on the device
//
// Every backend executes program[]: exec/ drives a step (run_begin: the
// ops up to the NORM, run_end: the decision and the rest) and calls
// begin_step, run_op for each op, decide and end_step here.
#ifndef ZOPT_RUNTIME_BACKEND_H
#define ZOPT_RUNTIME_BACKEND_H

#include "internal.h"

namespace zopt {
namespace exec {
struct StepState;
}

// What a caller may ask of a backend beyond the step (supports()).
enum class Feature {
  SplitStep,       // zopt_optimizer_step_begin: the norm known on the host before the update
  LinkedStep,      // zopt_optimizer_step_linked(_begin): parts sharing one norm
  GradStreaming,   // zopt_optimizer_set_grad_streaming
  TensorMemory,    // zopt_optimizer_set_tensor_memory / _set_grad_memory
  OpTimes,         // zopt_optimizer_get_op_times
  GatherParams,    // zopt_optimizer_gather_params
  AddTensors,      // zopt_optimizer_add_tensors after finalize (the program rebuilt)
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual const char *name() const = 0;
  // ZOPT_OK, or ZOPT_ERR_UNSUPPORTED naming `fn` and saying why.
  virtual zopt_status supports(const zopt_optimizer *o, Feature f, const char *fn) const;

  // A communicator for the optimizer's ranks (zopt_optimizer_set_comm):
  // the memory it moves must be where the backend runs the collectives.
  virtual zopt_status check_comm(const zopt_optimizer *o, zopt_comm *comm) const = 0;

  // ---- tensors, finalize, free -------------------------------------------
  // A tensor's memory (add_tensor, set_tensor_memory; `t` is its id, for
  // messages; grad may be NULL where the caller allows it; param NULL: only
  // the grad is checked, its param being registered already; `fn` the C API
  // call, for messages).
  virtual zopt_status check_tensor(const zopt_optimizer *o, int t, void *param, void *grad, const char *fn) const;
  // The C API call that checked tensors is over: what check_tensor learned
  // about the memory it saw (an allocation known to be the device's) is not
  // trusted by later calls. (ChecksScope calls it.)
  virtual void checks_done(const zopt_optimizer *o) const {}
  // Tensors' user memory moved after finalize (zopt_optimizer_set_tensor_memory,
  // _set_grad_memory: o->tensors already holds the new pointers; `tensors`
  // their ids): the backend updates what holds those pointers. On failure
  // the caller puts the old pointers back (what the backend keeps of them
  // must then be rebuilt from o->tensors before it is used again).
  virtual zopt_status memory_moved(zopt_optimizer *o, const int32_t *tensors, int64_t n) { return ZOPT_OK; }
  // Builds what a step needs (buffers, tables, the host executor's
  // program); on failure nothing is left allocated.
  virtual zopt_status finalize(zopt_optimizer *o) = 0;
  // Releases everything the backend holds (zopt_optimizer_free; the
  // optimizer's pipeline and pool are gone).
  virtual void destroy(zopt_optimizer *o) = 0;

  // ---- the step: the program's ops (exec/ drives) -------------------------
  // Before the first op: checks and agreement (`first`: the call's first
  // collective work, exec.h).
  virtual zopt_status begin_step(zopt_optimizer *o, exec::StepState *st, bool first) = 0;
  // Program op i.
  virtual zopt_status run_op(zopt_optimizer *o, exec::StepState *st, size_t i) = 0;
  // Before a linked step of n > 1 parts runs (zopt_optimizer_step_linked,
  // _begin; after every other check of the parts): refuses what the
  // backend cannot run as a part (with the reason) and refreshes the host
  // copies the parts are compared by (step counts, loss scaler: pull).
  virtual zopt_status begin_linked(zopt_optimizer *o, const char *fn) { return ZOPT_OK; }
  // After the NORM: the skip and the clip coefficient from `sumsq` (the
  // step's, or the linked parts'), where the backend decides them.
  virtual void decide(zopt_optimizer *o, exec::StepState *st, double sumsq) = 0;
  // After the last op: the step's result.
  virtual void end_step(zopt_optimizer *o, exec::StepState *st, zopt_step_result *result) = 0;

  // ---- states -----------------------------------------------------------------
  // Element 0 of state si of tensor t where the backend keeps it whole
  // (internal.h state_ptr); NULL for a state sharded across ranks.
  virtual void *state_ptr(const zopt_optimizer *o, int t, int si) const = 0;
  // Whether state_ptr of si is host memory the runtime reads and writes
  // directly (else read_state / write_state copy it).
  virtual bool host_state(const zopt_optimizer *o, int si) const { return true; }
  // State si of tensor t, whole, in its storage dtype, to or from host
  // memory (`bytes` of it). A state sharded across ranks is gathered (a
  // collective); a write keeps the elements this rank holds.
  virtual zopt_status read_state(const zopt_optimizer *o, int t, int si, void *out, size_t bytes) const = 0;
  virtual zopt_status write_state(zopt_optimizer *o, int t, int si, const void *in, size_t bytes) = 0;
  // zopt_optimizer_refresh_master.
  virtual zopt_status refresh_master(zopt_optimizer *o, int first, int count) = 0;
  // zopt_optimizer_memory_info after finalize: adds what the backend
  // holds (the caller filled the user's memory and the counts).
  virtual void memory_info(const zopt_optimizer *o, zopt_memory_info *info) const = 0;

  // ---- the running state ------------------------------------------------------
  // After finalize the step counts, the loss scaler and the hyperparameter
  // table may live where the backend runs (the device). pull refreshes the
  // optimizer's host copies (groups[].step_count, tensors[].steps,
  // scaler); push writes them back (after a change through the C API or a
  // checkpoint load). Host backends keep them on the host: no-ops.
  virtual zopt_status pull(zopt_optimizer *o) { return ZOPT_OK; }
  virtual zopt_status push(zopt_optimizer *o) { return ZOPT_OK; }
  // A changed hyperparameter value (already range-checked).
  virtual zopt_status set_hyper(zopt_optimizer *o, int group, int hi, double value);
  // Every hyperparameter may have changed (a checkpoint load; push follows).
  virtual void hypers_changed(zopt_optimizer *o) {}
  // zopt_optimizer_set_max_norm (already checked): o->max_norm, and where
  // the step's kernels read it (the device's step globals).
  virtual zopt_status set_max_norm(zopt_optimizer *o, double value);

  // ---- the device (zopt.h "GPU") ----------------------------------------------
  virtual zopt_status set_stream(zopt_optimizer *o, void *stream);
  virtual zopt_status device_result(zopt_optimizer *o, zopt_step_result *result);
  virtual zopt_status set_device_allocator(zopt_optimizer *o, const zopt_device_allocator *a);

  // ---- staging of the user's tensors (the host executor; offload) ------------
  // Whether PARAM and GRAD live in device memory and the host executor
  // works on staged copies (the program's COPY ops move them).
  virtual bool stages() const { return false; }
  // A staging buffer of `bytes` (freed by destroy).
  virtual zopt_status alloc_staging(zopt_optimizer *o, size_t bytes, void **out);
  // The staging buffers allocated so far (in allocation order), and
  // freeing those of indices [first, last) (a program rebuilt around more
  // tensors: the old program's, or the new one's after a failure).
  virtual size_t staging_count(const zopt_optimizer *o) const { return 0; }
  virtual void free_staging(zopt_optimizer *o, size_t first, size_t last) {}
  // State si (PARAM or GRAD) of every tensor between the user's memory and
  // its staging copy; with `sync`, waits for the copies.
  virtual zopt_status copy_staged(zopt_optimizer *o, int si, bool to_user, bool sync);
  // The param of tensor t as the host's kernels read it (the user's memory,
  // or its staging copy), at element 0.
  virtual const void *param_on_host(const zopt_optimizer *o, int t) const;
  // zopt_optimizer_grad_bucket_ready (bucket readiness of an offloaded
  // step, backend/offload/pipeline.h): UNSUPPORTED elsewhere.
  virtual zopt_status grad_bucket_ready(zopt_optimizer *o, int b);
  // zopt_optimizer_set_param_wait / _get_param_wait / _wait_params (the
  // params' copies back of an offloaded step, backend/offload/params_back.h):
  // UNSUPPORTED elsewhere.
  virtual zopt_status set_param_wait(zopt_optimizer *o, int mode);
  virtual int param_wait(const zopt_optimizer *) const { return 0; }
  virtual zopt_status wait_params(zopt_optimizer *o, int b, void *stream);
  // Work a step left running after it returned (an offloaded step's tail,
  // backend/offload/tail.h; o->tail set): waited for, its failure reported
  // naming `fn`. join_tail (internal.h) calls it.
  virtual zopt_status join_tail(zopt_optimizer *o, const char *fn) { return ZOPT_OK; }
};

// Calls Backend::checks_done when the calling C API function returns.
struct ChecksScope {
  const zopt_optimizer *o;
  ~ChecksScope();
};

// The backend of a step: cuda (the step has GPU code), offload (params and
// grads on the GPU, the rest on the CPU) or cpu. Checks what the backend
// needs (a driver, a device) and attaches to it.
zopt_status make_backend(zopt_optimizer *o, Backend **out);

}  // namespace zopt

#endif
