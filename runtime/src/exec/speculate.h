// exec/speculate.h - the host side of a pipelined offloaded step (docs/GPU.md
// "Offloaded steps: bucket readiness and speculation"): per gradient
// bucket, its norm partials and a speculative update written out of place
// while backward goes on, then at the step a validation that commits,
// recomputes or discards each bucket's speculation.
//
// This file owns the per-bucket view of the host program (which update
// chunks and norm blocks belong to a bucket), the speculation buffers and
// their budget, the coefficient rows the speculation used, and the
// per-bucket commit / recompute. It knows no device: the copies and events
// are the offload backend's (backend/offload/pipeline.cpp). It holds no
// rule arithmetic: whether a speculation stands is decided by comparing the
// coefficient rows the step computes (coeffs.cpp, from CONTROL's clip
// coefficient) with the ones the speculation used, bit for bit.
#ifndef ZOPT_RUNTIME_EXEC_SPECULATE_H
#define ZOPT_RUNTIME_EXEC_SPECULATE_H

#include "internal.h"

#include <string>
#include <vector>

namespace zopt {
namespace exec {

struct Spec {
  // Built at the first readiness (spec_prepare): per bucket b its update
  // chunks [upd_first[b], upd_first[b + 1]) of the UPDATE's work list, its
  // norm blocks [blk_first[b], blk_first[b + 1]), the bytes its speculation
  // buffers take (every state the UPDATE writes, over the flat range this
  // rank updates: the bucket, or its shard at W ranks), and per state the
  // offset of its buffer inside them.
  bool built = false;
  std::vector<size_t> upd_first, blk_first;
  std::vector<uint64_t> cost;
  std::vector<size_t> state_off;  // per bucket x state (SIZE_MAX: not written)
  std::vector<int64_t> first_flat;  // per bucket: where this rank's range starts (its shard)
  // The budget (zopt_optimizer_set_speculation_budget; default: every
  // bucket) and one arena of min(budget, every bucket's cost) bytes, or
  // (`mirror`: a budget of every bucket) per written state a shadow of its
  // buffer in the same layout, element for element: a step whose every
  // bucket commits swaps the shadows of the runtime-held states in (no
  // copy; `swapped`) and copies only the staged param's.
  uint64_t budget = UINT64_MAX;
  char *arena = nullptr;
  size_t arena_bytes = 0, arena_used = 0;
  bool mirror = false, swapped = false;
  std::vector<char *> shadow;  // per state (NULL: not written, or no mirror)
  // The step under way: open after the first readiness until the step
  // ends; `consumed` once its UPDATE began (a failed step after that is
  // not resumed: the next step runs serially).
  bool open = false, consumed = false;
  std::vector<uint8_t> ready, speculated;
  std::vector<size_t> off;  // arena offset of each speculated bucket
  int nready = 0;
  // The coefficient table the speculation used (the PREPARE rows: clip
  // coefficient 1) and its row per tensor.
  std::vector<float> rows;
  std::vector<int> row_of;
  // Pipeline-thread CPU seconds per bucket, and when the last bucket was
  // marked ready (now_seconds()).
  std::vector<double> job_seconds;
  double last_ready = 0;
  // The last completed pipelined step: buckets committed, recomputed,
  // updated after validation (beyond the budget), whether it was skipped.
  int committed = 0, recomputed = 0, late = 0;
  // Buckets whose copies from the GPU were still running when the last
  // bucket was marked ready (the end of backward).
  int copies_in_flight = 0;
  // Per tensor its count before the step, where the update runs after
  // FINISH advanced it (the offload tail, backend/offload/tail.h: a
  // stochastic rounding key uses the step being taken); empty: the
  // tensors' counts.
  std::vector<int64_t> tail_steps;
  // zopt_optimizer_get_pipeline_stats: the last pipelined step's.
  zopt_pipeline_stats stats{};
  int64_t stats_steps = 0;
};

// Builds the per-bucket tables once (may throw std::bad_alloc).
void spec_build(zopt_optimizer *o);
// zopt_optimizer_set_speculation_budget (checked against the largest
// bucket's cost; 0: no speculation).
zopt_status spec_set_budget(zopt_optimizer *o, uint64_t bytes, const char *fn);
// The first readiness of a step: the work lists rebound, the ranks'
// agreement (a collective at W ranks), the PREPARE rows (clip coefficient
// 1) and a copy of them, the speculation buffers.
zopt_status spec_open(zopt_optimizer *o, double S, const char *fn);
// Reserves speculation space for bucket b within the budget (false: it
// updates after validation).
bool spec_reserve(zopt_optimizer *o, int b);
// Bucket b's CPU work once its grads are on the host (the pipeline's
// thread): at W ranks its reduction (a collective), its norm partials and,
// if reserved, its speculative update.
zopt_status spec_bucket_work(zopt_optimizer *o, int b);
// At the step's NORM_PARTIALS: whether the rows are the ones the
// speculation used (the partials computed at readiness stand).
bool spec_rows_same(const zopt_optimizer *o);
// At the step's UPDATE, before the buckets: with mirrors, when every
// bucket's rows are the speculation's and every tensor is updated, the
// runtime-held written states swapped with their shadows (the work lists
// rebound; may throw std::bad_alloc).
void spec_try_swap(zopt_optimizer *o);
// At the step's UPDATE (rows with the true clip coefficient): bucket b's
// speculation committed when every row it used is identical, else its
// update run in place from the untouched states.
void spec_update_bucket(zopt_optimizer *o, int b);
// The program's op i (the ALL_GATHER of the params after the UPDATE, at W
// ranks) for bucket b alone: a checked collective naming the bucket (the
// offload tail at W ranks, backend/offload/tail.h).
zopt_status spec_gather_bucket(zopt_optimizer *o, size_t i, int b);
// The step is over (or abandoned): nothing ready.
void spec_close(zopt_optimizer *o);
void spec_free(zopt_optimizer *o);
// Bytes of speculation buffers held (the arena, the shadows).
uint64_t spec_bytes(const zopt_optimizer *o);
// The buckets not marked ready, for messages ("3, 4, 7").
std::string spec_missing(const zopt_optimizer *o);
// Whether a pipelined step is under way (a bucket marked since the last step).
bool spec_marking(const zopt_optimizer *o);
// While marking: the first of tensors[0 .. n) with elements in a marked
// bucket (-1: none), its bucket in *bucket (may throw std::bad_alloc).
int64_t spec_first_marked(const zopt_optimizer *o, int64_t n, const int32_t *tensors, int *bucket);

}  // namespace exec
}  // namespace zopt

#endif
