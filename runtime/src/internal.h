// internal.h - shared internals of libzopt_runtime (not installed): what
// every folder of runtime/src uses: errors, dtypes and their conversions,
// hashing, the thread pool, one call at a time per optimizer (CallGate),
// the loaded step and the optimizer object, descriptor lookups and the
// gradient scale. runtime/README.md lists the folders.
#ifndef ZOPT_RUNTIME_INTERNAL_H
#define ZOPT_RUNTIME_INTERNAL_H

#include "zopt/comm.h"
#include "zopt/zopt.h"

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_set>
#include <vector>

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "libzopt_runtime assumes a little-endian host"
#endif

namespace zopt {

// ---- errors -------------------------------------------------------------
// Sets the calling thread's last-error message and returns `st`.
zopt_status fail(zopt_status st, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
void clear_error();

// ---- dtypes -------------------------------------------------------------
size_t dtype_size(uint32_t dt);  // 0 for an unknown dtype
const char *dtype_name(uint32_t dt);
const char *state_kind_name(uint32_t kind);
const char *hyper_name(uint32_t kind);
int hyper_kind_from_name(const char *name);  // 0 if unknown

// ---- q8 moments (abi.h "q8 moments") ----------------------------------------
// A PER_BLOCK state (a q8 absmax) holds one element per ZOPT_Q8_BLOCK
// elements of its tensor: `n` elements of the tensor are q8_state_numel of
// the state (the last block may be partial).
inline bool is_per_block(const zopt_step_descriptor *d, int si) {
  return (d->states[si].flags & ZOPT_STATE_PER_BLOCK) != 0;
}
inline int64_t state_numel(const zopt_step_descriptor *d, int si, int64_t n) {
  return is_per_block(d, si) ? (n + ZOPT_Q8_BLOCK - 1) / ZOPT_Q8_BLOCK : n;
}
// Whether the step has q8 moments (its layout is then block-aligned).
bool has_q8(const zopt_step_descriptor *d);
// The byte a fresh (zero) state of `si` holds: a q8 moment's zero code,
// else 0.
uint8_t zero_byte(const zopt_step_descriptor *d, int si);
// The canonical encode of n f32 moments of a tensor from its element 0 (or
// any block boundary): per block of ZOPT_Q8_BLOCK the absmax max |x| (NaN
// if any x is), each code zopt_q8_encode. `codes` may be NULL (the absmax
// only). The one encode outside the kernels: state writes, checkpoint
// loads, the staged import.
void q8_encode_n(const float *x, int64_t n, int is_unsigned, uint8_t *codes, float *absmax);

float bf16_to_f32(uint16_t h);
uint16_t f32_to_bf16(float f);  // round to nearest even, NaN stays NaN
float f16_to_f32(uint16_t h);
uint16_t f32_to_f16(float f);  // round to nearest even, NaN stays NaN

// Converts n elements between storage dtypes via f32 (widening exact,
// narrowing round-to-nearest-even).
void convert(const void *src, uint32_t src_dt, void *dst, uint32_t dst_dt,
             int64_t n);

// FNV-1a 64 (offset basis 14695981039346656037, prime 1099511628211; `h`
// continues a running hash).
constexpr uint64_t kFnvBasis = 14695981039346656037ull;
uint64_t fnv1a64(const void *data, size_t n, uint64_t h = kFnvBasis);

// ---- thread pool --------------------------------------------------------
// A persistent pool: n-1 worker threads plus the calling thread. run(fn)
// calls fn(ctx, tid) once for every tid in [0, n) and returns when all are
// done. Created once per optimizer, never per step.
class ThreadPool {
 public:
  explicit ThreadPool(int n);
  ~ThreadPool();
  int size() const { return n_; }
  void run(void (*fn)(void *ctx, int tid), void *ctx);

 private:
  void worker(int tid);
  int n_;
  std::mutex run_mu_;  // one run at a time: concurrent run() calls wait
  std::vector<std::thread> threads_;
  std::mutex mu_;
  std::condition_variable cv_start_, cv_done_;
  uint64_t generation_ = 0;
  int pending_ = 0;
  bool stop_ = false;
  void (*fn_)(void *, int) = nullptr;
  void *ctx_ = nullptr;
};

// ---- one call at a time per optimizer --------------------------------------
// zopt.h "Threading": while a C API call runs on an optimizer, a call on it
// from another thread is refused (ZOPT_ERR_BAD_STATE naming the running
// call); calls nested on the thread that holds it (step_linked -> step)
// pass; zopt_optimizer_free waits until the running call returns (and
// refuses every call meanwhile).
class CallGate {
 public:
  // Enters `fn` on the calling thread. On refusal returns false and sets
  // `running` to the name of the call that holds the gate.
  bool enter(const char *fn, const char **running);
  void leave();
  // zopt_optimizer_free: no new call enters; waits until none runs.
  void close();

 private:
  std::mutex mu_;
  std::condition_variable idle_;
  std::thread::id owner_;
  int depth_ = 0;
  const char *fn_ = nullptr;
  bool closing_ = false;
};

// Holds an optimizer's gate for the scope of an API call (CHECK_OPT_ANY),
// and (`join`, every call but zopt_optimizer_wait_params) first joins the
// work a step left running after it returned (join_tail): the one place
// every call waits for it.
class CallHold {
 public:
  CallHold(const zopt_optimizer *o, const char *fn, bool join = true);
  ~CallHold();
  CallHold(const CallHold &) = delete;
  CallHold &operator=(const CallHold &) = delete;
  bool held() const { return gate_ != nullptr && !joined_; }
  // ZOPT_ERR_BAD_STATE naming this call and the running one; or the
  // failure the join reported.
  zopt_status refuse() const;

 private:
  CallGate *gate_ = nullptr;
  const char *fn_, *running_ = nullptr;
  zopt_status joined_ = ZOPT_OK;
};

// The first statements of a C API call on optimizer `o`: refuses NULL and a
// call while another thread's runs; holds the gate to the end of the scope;
// joins the last step's tail (ZOPT_ENTER_CALL_NO_JOIN: not).
#define ZOPT_ENTER_CALL_(o, fn, join)                                                  \
  if (!(o)) return ::zopt::fail(ZOPT_ERR_INVALID_ARGUMENT, "%s: optimizer is NULL", fn); \
  ::zopt::CallHold zopt_call_hold_(o, fn, join);                                       \
  if (!zopt_call_hold_.held()) return zopt_call_hold_.refuse()
#define ZOPT_ENTER_CALL(o, fn) ZOPT_ENTER_CALL_(o, fn, true)
#define ZOPT_ENTER_CALL_NO_JOIN(o, fn) ZOPT_ENTER_CALL_(o, fn, false)

// Runs f(tid) for tid in [0, pool->size()) on the pool.
template <class F>
void parallel(ThreadPool *pool, F &&f) {
  pool->run([](void *c, int tid) { (*(F *)c)(tid); }, (void *)&f);
}

}  // namespace zopt

// ---- the opaque API types -----------------------------------------------
struct zopt_step {
  zopt_step_descriptor desc;  // validated copy
  void *handle = nullptr;     // dlopen handle
  std::string path;
  zopt_prepare_fn prepare = nullptr;
  zopt_update_fn update = nullptr;
  zopt_sumsq_fn sumsq = nullptr;
  zopt_sumsq2_fn sumsq2 = nullptr;    // sumsq's pair entry, if exported (abi.h "SUMSQ pairs")
  zopt_control_fn control = nullptr;  // every step: the host CONTROL (abi.h)
  zopt_isa update_isa = ZOPT_ISA_NONE;
  bool has_cpu_kernels = false;
  bool has_gpu_code = false;  // GPU images present (need the CUDA backend)
  int param_index = -1, grad_index = -1;
  std::atomic<int> refcount{1};  // step + each optimizer created from it (optimizers of one step may be created and freed on several threads)
};

namespace zopt {

struct Tensor {
  int group;
  void *param;
  void *grad;
  int64_t numel;
  int64_t offset;  // GPU steps: element offset inside the group's flat buffers
  int64_t steps = 0;  // steps this tensor took (torch's per-param `step`)
};

struct Group {
  std::vector<double> hypers;  // descriptor order
  int64_t step_count = 0;      // steps in which any of its tensors was updated
  uint32_t flags = 0;          // ZOPT_GROUP_* bits (bit 0: maximize, a torch per-group flag)
  std::vector<int> tensors;    // tensor ids in add order
  int64_t padded_total = 0;    // GPU steps: elements, multiple of align
  std::vector<void *> buffers; // GPU steps: per descriptor state; null for PARAM/GRAD
};

class Backend;    // backend/backend.h: where the states live, how ops run
namespace exec {
struct Program;   // exec/exec.h: the step program of a CPU-updated step
struct StepState; // exec/exec.h: a step between run_begin and run_end
}
namespace pipeline {
class Pipeline;   // pipeline/pipeline.h: the background thread
}

struct LossScaler {
  zopt_loss_scaler_config cfg;
  double scale;
  int64_t good_steps;  // consecutive good steps since the last change
};

}  // namespace zopt

struct zopt_optimizer {
  const zopt_step *step = nullptr;
  const zopt_step_descriptor *d = nullptr;
  std::vector<zopt::Group> groups;
  std::vector<zopt::Tensor> tensors;
  bool finalized = false;
  int num_threads = 1;
  zopt::LossScaler scaler;
  zopt::ThreadPool *pool = nullptr;
  std::unordered_set<const void *> params;  // registered param pointers
  zopt::Backend *backend = nullptr;  // cpu, offload or cuda (backend/)
  uint64_t seed = 0;  // stochastic rounding (abi.h)
  // Ranks: the communicator (NULL until set: world size 1), and what
  // finalize read of it.
  zopt_comm *comm = nullptr;
  int world = 1, rank = 0;
  int64_t bucket_elems = 0;  // 0: layout::kDefaultBucket
  double grad_divisor = 0;   // D of GRAD_SCALE = 1/(S*D); 0: the world size
  // Tensors that have a gradient this step (empty: all); see
  // zopt_optimizer_set_active.
  std::vector<uint8_t> active;
  // Gradient streaming (zopt_optimizer_set_grad_streaming): the reduced
  // gradient shards are runtime-held and filled bucket by bucket by
  // zopt_optimizer_reduce_bucket; the tensors' grad memory is not read.
  bool stream_grads = false;
  zopt::exec::Program *prog = nullptr;  // finalize product (CPU-updated steps)
  // The background thread (zopt_optimizer_reduce_bucket_async), made at
  // its first job.
  zopt::pipeline::Pipeline *pipe = nullptr;
  // The max_norm of global-norm clipping (steps with ZOPT_FLAG_CLIP): the
  // descriptor's until zopt_optimizer_set_max_norm; agreed at every step.
  double max_norm = 0;
  // A step begun by zopt_optimizer_step_begin (or _step_linked_begin, then
  // `linked` is the part count and `linked_sumsq` the parts' sum): its
  // agreement, reductions and norm ran; zopt_optimizer_step(_linked)
  // finishes it. Every other call is refused meanwhile (check_idle).
  zopt::exec::StepState *begun = nullptr;
  int linked = 0;
  double linked_sumsq = 0;
  // A step's tail runs on the pipeline thread after the step returned
  // (an offloaded step in per-bucket mode, backend/offload/tail.h): every
  // API call but zopt_optimizer_wait_params joins it first (CallHold).
  bool tail = false;
  // The C API call running on the optimizer (zopt.h "Threading").
  mutable zopt::CallGate gate;
  // Counts the rebuilds of the layout (tensors added after finalize): a
  // staged import begun before one is refused at its commit.
  uint64_t generation = 0;
};

namespace zopt {
// ZOPT_ERR_BAD_STATE naming `fn` while jobs of the optimizer's pipeline are
// queued or running (every API call but the streaming ones and the step,
// which waits for them), or while a begun step waits for its end.
zopt_status check_idle(const zopt_optimizer *o, const char *fn);
// Waits for the tail a step left running (o->tail; nothing otherwise) and
// reports its failure naming `fn` (the backend's join_tail).
zopt_status join_tail(zopt_optimizer *o, const char *fn);
}  // namespace zopt

namespace zopt {
// Index of the descriptor state of `kind`, or -1.
int state_index(const zopt_step_descriptor *d, uint32_t kind);
int hyper_index(const zopt_step_descriptor *d, uint32_t kind);
// Pointer to element 0 of state `si` of tensor `t` where this rank holds the
// whole tensor contiguously: user memory for PARAM and GRAD, an offloaded
// step's host staging, a GPU step's device buffer, an unsharded runtime
// buffer (the backend's Backend::state_ptr). NULL for a state sharded
// across ranks (exec::runs gives its pieces). Requires finalize for
// runtime-held states.
void *state_ptr(const zopt_optimizer *o, int t, int si);
// The divisor D of the gradient scale 1/(S*D) (abi.h ZOPT_GLOBAL_GRAD_SCALE).
double grad_divisor(const zopt_optimizer *o);
// S: the loss scale of the next step (1 without loss scaling).
double loss_scale(const zopt_optimizer *o);
// A group's GRAD_SCALE global (abi.h, docs/NUMERICS.md §2) for a step of
// loss scale S: 1 / (S * D), negative for a maximizing group (torch's
// maximize: the gradient negated before weight decay and the rule; the
// norm's square and the skip are unchanged). The one place the runtime
// computes it, for every backend (the GPU's FINISH rewrites it on the
// device after the scaler changes S, abi.h "GPU kernels").
double grad_scale(const zopt_optimizer *o, double S, uint32_t group_flags);
bool is_owned_kind(uint32_t kind);
// The integer in an enum-typed API argument, read without an enum-typed load
// (a C caller may pass any value; loading it as the C++ enum would be UB).
template <class E>
inline uint32_t raw_enum(const E &e) {
  static_assert(sizeof(E) == sizeof(uint32_t), "enum size");
  uint32_t v;
  memcpy(&v, &e, sizeof v);
  return v;
}
void release_step(const zopt_step *s);

}  // namespace zopt

#endif
