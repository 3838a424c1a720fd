// exec/exec.h - the step-program executor.
//
// This subsystem owns the execution of a step's program (abi.h "The step
// program"), op by op, in the same order on every rank: the driver every
// backend runs under (run_begin / run_end call the backend's begin_step,
// run_op, decide and end_step, backend/backend.h), and the host executor
// the CPU and offload backends are made of: the program instantiated with
// the world size and the shapes for a step whose update runs on the CPU —
// the layout (layout/), the runtime-held state buffers, the work chunks of
// every op, the norm blocks, the collective scratch — and its ops on the
// thread pool and the communicator. Nothing here knows a ZeRO stage or a
// backend: the program says what to reduce, where the norm is taken, what
// to update and what to gather. Its files, one concern each, are listed in
// exec_internal.h.
#ifndef ZOPT_RUNTIME_EXEC_H
#define ZOPT_RUNTIME_EXEC_H

#include "internal.h"
#include "layout/layout.h"

#include <cmath>

namespace zopt {
namespace exec {

// A unit of kernel work: a run of one tensor inside one bucket shard, with
// the kernel's pointer tables (`in` == `out`: the update runs in place).
struct Chunk {
  int tensor;
  int group;
  int64_t start;  // element index in the tensor
  int64_t len;
  void *ptrs[ZOPT_MAX_STATES];
};

// The chunks of one range of the program (this rank's shards, or every
// element) split into per-thread runs of about equal cost.
struct Work {
  bool built = false;
  std::vector<Chunk> chunks;
  std::vector<size_t> thread_begin;  // size T + 1
  // UPDATE's calls (coalesce.cpp): each thread's run of chunks with runs
  // of adjacent chunks of equal coefficients joined into one call; built
  // for the coefficient rows of generation `joined_gen` (0: stale); empty
  // (and `joins` false) when no two chunks join: the chunks are the calls.
  std::vector<Chunk> joined;
  std::vector<size_t> joined_begin;  // size T + 1
  uint64_t joined_gen = 0;
  bool joins = false;
  // The chunks of tensor t: chunks[of_tensor[k]] for k in
  // [tensor_first[t], tensor_first[t + 1]) (built with the chunks).
  std::vector<uint32_t> tensor_first, of_tensor;
};

// Norm blocks of the range NORM_PARTIALS covers: block i's partial is the
// in-order sum of chunks [first[i], first[i + 1]) of `sumsq`.
struct Blocks {
  Work sumsq;                  // chunks never larger than a norm block
  std::vector<size_t> first;   // size nblocks + 1
  std::vector<double> chunk_partials;
  std::vector<double> partials;  // one per block, in this rank's block order
};

struct Spec;  // speculate.h: a pipelined offloaded step's buckets

struct Program {
  std::vector<zopt_program_op> ops;
  std::vector<double> op_seconds;  // wall time of each op in the last step (0: did not run)
  double agree_seconds = 0;        // the ranks' agreement before the ops
  // The step under way (host_begin .. host_end): its start and the bytes
  // its COPY ops moved to the host [0] and to the device [1]; `stats`: the
  // last completed step's (zopt_optimizer_get_step_stats; stats.cpp).
  double step_start = 0;
  uint64_t copy_bytes[2] = {0, 0};
  zopt_step_stats stats{};
  layout::Layout L;   // at the world size: shards
  layout::Layout L1;  // at world size 1: full buffers
  // With q8 moments: L and L1 per block (layout::per_block), the index
  // space of the PER_BLOCK states (a q8 absmax); empty otherwise.
  layout::Layout Lb, L1b;
  // The layout indexing state si's buffer: sharded (at the world size) or
  // full, per element or per block.
  const layout::Layout &layout_of(const zopt_step_descriptor *d, int si, bool sharded_) const {
    if (is_per_block(d, si)) return sharded_ ? Lb : L1b;
    return sharded_ ? L : L1;
  }
  // Per descriptor state: the runtime-held buffer (NULL: the user's memory),
  // whether it is sharded (indexed by L) or full (by L1), pinned (staging
  // the backend allocates and frees: backend/offload) and its size.
  std::vector<void *> buf;
  std::vector<uint8_t> sharded, pinned;
  std::vector<size_t> buf_bytes;
  Work update_owned, update_all;
  Blocks norm_owned, norm_all;
  int update_range = ZOPT_RANGE_OWNED, norm_range = 0;  // norm_range 0: no norm
  // Collective scratch (W > 1): one bucket of the collectives' dtype each
  // (send: only for a program that reduces).
  std::vector<unsigned char> send, recv;
  std::vector<double> gathered;  // all ranks' norm partials
  // The coefficient table: one row per (group, step count) in use.
  std::vector<float> coeffs;
  std::vector<int> row_of_tensor;
  std::vector<std::pair<int, int64_t>> rows;  // (group, t) of each row
  uint64_t rows_gen = 1;  // bumped when row_of_tensor changes (never 0)
  // UPDATE joins adjacent chunks of equal coefficients (coalesce.cpp);
  // false with ZOPT_NO_COALESCE=1 in the environment at finalize.
  bool coalesce = true;
  std::vector<uint8_t> global_active;  // per tensor, agreed by every rank
  bool any_active = true;
  // Gradient streaming: per bucket, reduced since the last step; per
  // tensor, 0 not yet given this step, 1 given a gradient, 2 given none.
  std::vector<uint8_t> bucket_reduced, stream_given;
  // zopt_optimizer_reduce_bucket_async: handed over since the last step
  // (the caller's thread only), and the pipeline ticket of each.
  std::vector<uint8_t> bucket_queued;
  std::vector<uint64_t> bucket_ticket;
  // A tensor's user memory moved (zopt_optimizer_set_tensor_memory): the
  // work units' pointers are rebuilt once, at the next step.
  bool rebind_pending = false;
  // Only gradients moved since the last rebind (zopt_optimizer_set_grad_memory,
  // e.g. fresh gradient tensors every step): rebind patches the work units'
  // gradient pointers in place instead of rebuilding the lists.
  bool rebind_grads_only = false;
  // Which tensors those are (note_grads_moved; capacity one per tensor,
  // reserved at build: never allocates), or all of them when more were
  // moved than fit.
  std::vector<int32_t> grads_moved;
  bool grads_moved_all = false;
  // Offloaded steps with bucket readiness (speculate.h; NULL until used).
  Spec *spec = nullptr;
};

// Builds the program at finalize (validates it against the step and the
// communicator, lays out, allocates and initializes the runtime-held
// states). On failure nothing is left allocated.
zopt_status build(zopt_optimizer *o);
// One step: runs the program.
zopt_status run(zopt_optimizer *o, zopt_step_result *result);

// The step in two halves (zopt_optimizer_step_linked runs several
// optimizers' first halves, adds their sums of squares in order and runs
// their second halves with that sum): run_begin agrees and runs the ops
// up to the NORM op's sum (no state but the gradients changes); run_end
// decides the skip and the clip coefficient from `sumsq` and runs the rest.
struct StepState {
  // A part of a linked step of several optimizers (zopt_optimizer_step_linked
  // with n > 1, set by the caller before run_begin, kept by it): the
  // backend brings its sum of squares to the host at the NORM and applies
  // the decision run_end is given (the other parts' too), where it would
  // otherwise decide alone (the device).
  bool linked = false;
  size_t pc = 0;            // the first op run_end runs
  double S = 1;               // the step's loss scale (its gradient scale: grad_scale)
  bool has_norm = false;     // the program has a NORM op (sumsq is set)
  double sumsq = 0;
  double norm = NAN, clip = 1.0;
  bool skipped = false;
  // Some tensor has a gradient on some rank (the host executor's agreement;
  // a linked step: in some part). A step without any changes nothing: FINISH
  // leaves the loss scaler as it is, as a step at world size 1 the Python
  // binding never calls (docs/USAGE.md section 3).
  bool any_active = true;
  zopt_control ctl{};        // run_end's decision (FINISH applies it)
};
// The step's CONTROL (abi.h; docs/NUMERICS.md) for the sum of squares
// `sumsq` with the optimizer's max_norm and loss scaler: norm, clip
// coefficient, skip, the scaler's next state, whether counts advance.
// Pure: changes nothing.
zopt_control decide(const zopt_optimizer *o, double sumsq);
// `first`: this is the call's first collective work (not a later part of
// a linked step): a mismatch at its agreement leaves the communicator usable.
// Both drive the optimizer's backend (backend/backend.h).
zopt_status run_begin(zopt_optimizer *o, StepState *st, bool first = true);
zopt_status run_end(zopt_optimizer *o, StepState *st, double sumsq, zopt_step_result *result);
// The host executor's parts of a step (backend/cpu): the checks, the work
// lists' rebinding and the ranks' agreement before the first op; op i on
// the pool and the communicator (COPY through the backend's staging); the
// decision by the step's CONTROL (and the coefficients again with its clip
// coefficient); the streaming bookkeeping and the result.
zopt_status host_begin(zopt_optimizer *o, StepState *st, bool first);
// The ranks' agreement before a step's first collective (host_begin; the
// first bucket readiness of a pipelined offloaded step): every rank's
// gradient mask ORed into Program::global_active, the step settings checked.
zopt_status agree_step(zopt_optimizer *o, bool first);
zopt_status run_host_op(zopt_optimizer *o, StepState *st, size_t i);
void host_decide(zopt_optimizer *o, StepState *st, double sumsq);
void host_end(zopt_optimizer *o, StepState *st, zopt_step_result *result);
// stats.cpp: the clock host_begin and host_end read (steady, seconds); the
// bytes of state si of every tensor (a COPY op's); the completed step's
// zopt_step_stats from op_seconds, the copies and the clock (host_end).
double now_seconds();
uint64_t copy_size(const zopt_optimizer *o, int si);
void record_stats(zopt_optimizer *o);
// Gradient streaming: reduces bucket b's gradients (grads[i]: element 0 of
// the i-th tensor of bucket_tensors(b), NULL for none on this rank) into
// this rank's runtime-held gradient shard. A collective.
zopt_status reduce_bucket(zopt_optimizer *o, int b, const void *const *grads, int count);
// The same, queued on the optimizer's pipeline (pipeline/pipeline.h): the
// checks run now, the reduction on the background thread; the gradients
// are read until bucket_finished(b).
zopt_status reduce_bucket_async(zopt_optimizer *o, int b, const void *const *grads, int count);
// Bucket b's reduction ran (or failed, or was skipped after a failure):
// its gradients are no longer read.
bool bucket_finished(const zopt_optimizer *o, int b);
// Waits for every queued reduction; reports the first failure.
zopt_status wait_buckets(zopt_optimizer *o);
// The tensors with elements in bucket b, in flat order.
void bucket_tensors(const zopt_optimizer *o, int b, std::vector<int> *out);
// Re-splits the work across o->num_threads threads.
void repartition(zopt_optimizer *o);
// Rebuilds every work unit's pointers (after a tensor's user memory moved;
// run_begin does it when Program::rebind_pending is set); when only
// gradients moved (Program::rebind_grads_only), patches the pointers of
// those tensors' chunks in place (O(moved tensors)). May throw std::bad_alloc.
void rebind(zopt_optimizer *o);
// Records that the gradients of tensors[0..n) moved (the rebind patches
// their chunks only); allocates nothing.
void note_grads_moved(zopt_optimizer *o, const int32_t *tensors, int64_t n);
void destroy(zopt_optimizer *o);

// A run of tensor t's state si held by this rank: elements
// [start, start + len) of the tensor at `ptr` (a PER_BLOCK state: its
// blocks [start, start + len), a q8 absmax each).
struct Run {
  int64_t start, len;
  void *ptr;
};
// This rank's runs of state si of tensor t, in element order (the whole
// tensor for user memory and full buffers; its pieces in this rank's shards
// for a sharded state).
void runs(const zopt_optimizer *o, int t, int si, std::vector<Run> *out);
// Whether this rank holds every element of state si.
bool holds_whole(const zopt_optimizer *o, int si);
// The elements of tensor t in this rank's shards of the layout at the world
// size, in element order: [start, start + len) of the tensor, at flat
// offset `flat` of bucket `bucket`. What a sharded state holds of it, and
// what a rank writes of a state every rank holds whole (checkpoints).
struct OwnedRange {
  int bucket;
  int64_t start, len, flat;
};
void owned_ranges(const zopt_optimizer *o, int t, std::vector<OwnedRange> *out);

// State si of tensors [first, first + count), whole, into dst[i] (storage
// dtype; a NULL entry or dst: the registered param memory, for PARAM). For
// a state sharded across ranks this is a collective: every rank calls it
// with the same tensors and receives every element.
zopt_status gather_state(zopt_optimizer *o, int si, int first, int count, void *const *dst);
// REDUCE_SCATTER's sum (fold.cpp): W pieces of n elements of dtype dt added
// in f32 in rank order, rounded to dt, stored at dst.
void fold(uint32_t dt, int W, const char *const *src, char *dst, int64_t n);
// Bytes of runtime-held state this rank holds (master, moments, ZeRO-3
// params); what one rank would hold; the collective scratch; the streamed
// gradient shards.
void state_bytes(const zopt_optimizer *o, uint64_t *mine, uint64_t *one_rank, uint64_t *scratch, uint64_t *grads);

}  // namespace exec
}  // namespace zopt

#endif
