// exec/exec_internal.h - what the files of exec/ share, and nothing else
// includes: the views of a state the ops read and write, the collectives'
// packing, the coefficient table's rows. exec.h is the subsystem's interface.
//
//   exec.cpp         the step driver (run_begin / run_end, every backend) and
//                    the host executor's step: agreement, the ops on the pool
//   build.cpp        the program at finalize: validation, layout, held
//                    buffers, work lists and norm blocks; runs, accounting
//   coeffs.cpp       the coefficient table: PREPARE's rows per (group, t)
//   coalesce.cpp     UPDATE's calls: adjacent chunks of one row joined
//   collectives.cpp  REDUCE_SCATTER, ALL_GATHER, gather_state
//   stream.cpp       gradient streaming: buckets reduced during backward
//   fold.cpp         the rank-order sum of a reduction
//   stats.cpp        zopt_step_stats: the last step's time by kind of work
//   speculate.cpp    a pipelined offloaded step: per-bucket norm partials
//                    and speculative updates, commit or recompute
#ifndef ZOPT_RUNTIME_EXEC_INTERNAL_H
#define ZOPT_RUNTIME_EXEC_INTERNAL_H

#include "exec/exec.h"

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

namespace zopt {
namespace exec {

inline size_t es_of(const zopt_optimizer *o, int si) { return dtype_size(o->d->states[si].dtype); }

// Element `start` of tensor t's full view of state si (user memory, offload
// staging or a full runtime buffer); a PER_BLOCK state: the element's block.
inline char *view(const zopt_optimizer *o, int si, int t, int64_t start) {
  if (is_per_block(o->d, si)) start /= ZOPT_Q8_BLOCK;
  return (char *)state_ptr(o, t, si) + (size_t)start * es_of(o, si);
}

// Whether tensor t is updated this step (every rank's gradient mask).
inline bool active(const Program &P, int t) { return P.global_active.empty() || P.global_active[t]; }

// A short description of what a collective does, for the checks and errors.
const char *what(char *buf, size_t n, const char *op, const zopt_optimizer *o, int si, int b);

// Packs flat range [a, e) of bucket b (e.g. one rank's shard) into dst:
// each tensor piece's elements from src(piece) (nullptr: zeros), zeros
// where no tensor is (align gaps, padding).
template <class Src>
inline void pack_range(const Program &P, int b, int64_t a, int64_t e, size_t es, char *dst, Src src) {
  const layout::Bucket &k = P.L.buckets[b];
  int64_t pos = a;
  for (const layout::Piece &p : P.L.pieces(k.group, a, std::min(e, k.begin + k.len))) {
    if (p.flat > pos) memset(dst + (pos - a) * es, 0, (size_t)(p.flat - pos) * es);
    if (const char *x = src(p))
      memcpy(dst + (p.flat - a) * es, x, (size_t)p.len * es);
    else
      memset(dst + (p.flat - a) * es, 0, (size_t)p.len * es);
    pos = p.flat + p.len;
  }
  if (e > pos) memset(dst + (pos - a) * es, 0, (size_t)(e - pos) * es);
}

// REDUCE_SCATTER and ALL_GATHER of the program's op (collectives.cpp).
zopt_status reduce_scatter(zopt_optimizer *o, const zopt_program_op &op);
// REDUCE_SCATTER of bucket b alone (a pipelined offloaded step's bucket job).
// unchanged: nothing the step keeps is written before it (a mismatch of its
// checked signature then leaves the communicator usable: kSigUnchanged).
zopt_status reduce_scatter_bucket(zopt_optimizer *o, const zopt_program_op &op, int b, bool unchanged = false);
zopt_status all_gather(zopt_optimizer *o, const zopt_program_op &op);
// ALL_GATHER of bucket b alone (a pipelined offloaded step's bucket job,
// the reduced grad of a ZeRO-0/1 program; unchanged: as above).
zopt_status all_gather_bucket(zopt_optimizer *o, const zopt_program_op &op, int b, bool unchanged = false);

// One row per (group, t) among the tensors this step updates; PREPARE
// fills each with the clip coefficient `clip` and the gradient scale of
// loss scale S (grad_scale); `rebuild`: the rows again (coeffs.cpp).
void prepare_rows(zopt_optimizer *o, bool rebuild, double clip, double S);
// Tensor t's row.
inline const float *coeffs_of(const Program &P, int t) {
  return P.coeffs.data() + (size_t)P.row_of_tensor[t] * ZOPT_MAX_COEFFS;
}

// UPDATE's calls (coalesce.cpp): whether w.joined / w.joined_begin are
// current and to be run instead of w.chunks / w.thread_begin (rebuilt here
// when stale; false with coalescing off or out of memory).
bool use_joined(zopt_optimizer *o, Work &w);
// Whether chunk i of w joins the chunk before or after it in its thread's
// run (as use_joined would join them: both active, adjacent, one row).
bool joins_a_neighbour(const zopt_optimizer *o, const Work &w, size_t i);
// Whether ZOPT_NO_COALESCE leaves coalescing on (read at finalize).
bool coalesce_enabled();

// "3, 4, 7" (at most 8, then "... (N in all)"), for messages.
std::string tensor_list(const std::vector<int> &ts);

}  // namespace exec
}  // namespace zopt

#endif
