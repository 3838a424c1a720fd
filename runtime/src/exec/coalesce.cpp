// exec/coalesce.cpp - UPDATE's kernel calls: a thread's consecutive chunks
// joined into one call where that gives the same bits (issue 17: 10,000
// small tensors cost about what one tensor of their total does).
//
// UPDATE is elementwise and its result does not depend on the chunking
// (abi.h; docs/NUMERICS.md §8), so chunks a and b of one thread's run
// (Work::thread_begin: the partition is untouched) are run as one call
// over a.len + b.len elements when
//   * they have the same coefficient row (the same group and step count:
//     the same coefficients), both active;
//   * b starts where a ends in every state's memory (params and grads of
//     views of one flat buffer, runtime-held states without an align gap);
//     with q8 moments a's length is a whole number of q8 blocks and b's
//     absmax follows a's (every call starts at a block boundary);
//   * with stochastic rounding, they are of one tensor and their joined
//     range does not straddle a multiple of 2^32 elements: the key is
//     (seed, t, tensor, index >> 32) and each element's index its own
//     (abi.h "Stochastic rounding"), so the keys and indices stay the same.
// SUMSQ is not joined: its ordered sum is per call (lane i mod 32), so a
// joined call would change the norm's bits. The joined list is rebuilt
// when the work lists are (finalize, moved memory, threads), the rows
// change (a mask, counts that diverge) or moved gradients (patched in
// place) join or held joins, never per step otherwise.
// ZOPT_NO_COALESCE=1 at finalize turns it off (docs/TESTING.md).
#include "exec/exec_internal.h"

#include <algorithm>
#include <cstdlib>
#include <new>

namespace zopt {
namespace exec {

namespace {

constexpr int64_t k2to32 = int64_t(1) << 32;

bool adjacent(const zopt_optimizer *o, const Chunk &a, const Chunk &b) {
  for (uint32_t s = 0; s < o->d->num_states; ++s) {
    if (!a.ptrs[s] || !b.ptrs[s]) return false;
    int64_t n = a.len;
    if (is_per_block(o->d, (int)s)) {
      // A q8 absmax: a's blocks must all be whole, so that b's first
      // element is a block boundary of the joined call (abi.h "q8 moments").
      if (n % ZOPT_Q8_BLOCK) return false;
      n /= ZOPT_Q8_BLOCK;
    }
    if ((const char *)a.ptrs[s] + (size_t)n * es_of(o, (int)s) != (const char *)b.ptrs[s]) return false;
  }
  return true;
}

// Whether chunk c may extend the joined call j (c follows j in one
// thread's run, both active).
bool joins_onto(const zopt_optimizer *o, bool sr, const Chunk &j, const Chunk &c) {
  const Program &P = *o->prog;
  if (P.row_of_tensor[j.tensor] != P.row_of_tensor[c.tensor]) return false;
  // (A tensor's pieces in two buckets' shards can be adjacent in a
  // sharded buffer with other ranks' elements between them.)
  if (sr && !(j.tensor == c.tensor && c.start == j.start + j.len &&
              j.start / k2to32 == (c.start + c.len - 1) / k2to32))
    return false;
  return adjacent(o, j, c);
}

// Whether any two neighbouring active chunks of a thread's run join. A
// joined call starts at its first chunk, so if no neighbouring pair joins,
// no call does (the SR condition only gets stricter as a call grows). This
// pass allocates nothing: steps whose chunks never join (separately
// allocated tensors) pay no copy of the chunks. Fresh gradients every
// step (zopt_optimizer_set_grad_memory) only look at the moved chunks'
// neighbours (joins_a_neighbour, from build.cpp's patch_grads).
bool any_join(const zopt_optimizer *o, const Work &w) {
  const Program &P = *o->prog;
  const bool sr = o->d->flags & ZOPT_FLAG_STOCHASTIC;
  const size_t T = w.thread_begin.size() - 1;
  for (size_t tid = 0; tid < T; ++tid) {
    const Chunk *prev = nullptr;
    for (size_t i = w.thread_begin[tid]; i < w.thread_begin[tid + 1]; ++i) {
      const Chunk &c = w.chunks[i];
      if (!active(P, c.tensor)) {
        prev = nullptr;
        continue;
      }
      if (prev && joins_onto(o, sr, *prev, c)) return true;
      prev = &c;
    }
  }
  return false;
}

// Joins w's chunks thread by thread into w.joined; inactive chunks are
// left out (UPDATE skips them). Without any join, w.joined is left empty
// and w.joins false.
void join(const zopt_optimizer *o, Work &w) {
  const Program &P = *o->prog;
  const bool sr = o->d->flags & ZOPT_FLAG_STOCHASTIC;
  const size_t T = w.thread_begin.size() - 1;
  w.joins = false;
  if (!any_join(o, w)) {  // nothing to gain: no second copy of the chunks
    std::vector<Chunk>().swap(w.joined);
    std::vector<size_t>().swap(w.joined_begin);
    return;
  }
  w.joined.clear();
  w.joined.reserve(w.chunks.size());
  w.joined_begin.assign(T + 1, 0);
  for (size_t tid = 0; tid < T; ++tid) {
    w.joined_begin[tid] = w.joined.size();
    bool open = false;  // w.joined.back() is this thread's and may grow
    for (size_t i = w.thread_begin[tid]; i < w.thread_begin[tid + 1]; ++i) {
      const Chunk &c = w.chunks[i];
      if (!active(P, c.tensor)) {
        open = false;
        continue;
      }
      if (open && joins_onto(o, sr, w.joined.back(), c)) {
        w.joined.back().len += c.len;  // its ptrs stay at its first element
        w.joins = true;
        continue;
      }
      w.joined.push_back(c);
      open = true;
    }
  }
  w.joined_begin[T] = w.joined.size();
}

}  // namespace

bool joins_a_neighbour(const zopt_optimizer *o, const Work &w, size_t i) {
  const Program &P = *o->prog;
  const Chunk &c = w.chunks[i];
  // First the gradients alone (what moved; separately allocated gradients
  // are next to each other rarely): only then the whole check.
  const int gi = o->step->grad_index;
  const bool pb = is_per_block(o->d, gi);
  const size_t es = es_of(o, gi);
  auto grads_adjacent = [&](const Chunk &a, const Chunk &b) {
    return pb || (a.ptrs[gi] && b.ptrs[gi] && (const char *)a.ptrs[gi] + (size_t)a.len * es == (const char *)b.ptrs[gi]);
  };
  const bool before = i > 0 && grads_adjacent(w.chunks[i - 1], c);
  const bool after = i + 1 < w.chunks.size() && grads_adjacent(c, w.chunks[i + 1]);
  if ((!before && !after) || !active(P, c.tensor)) return false;
  const bool sr = o->d->flags & ZOPT_FLAG_STOCHASTIC;
  const size_t tid = (size_t)(std::upper_bound(w.thread_begin.begin(), w.thread_begin.end(), i) - w.thread_begin.begin()) - 1;
  const size_t b = w.thread_begin[tid], e = w.thread_begin[tid + 1];
  if (before && i > b && active(P, w.chunks[i - 1].tensor) && joins_onto(o, sr, w.chunks[i - 1], c)) return true;
  return after && i + 1 < e && active(P, w.chunks[i + 1].tensor) && joins_onto(o, sr, c, w.chunks[i + 1]);
}

bool coalesce_enabled() {
  const char *e = getenv("ZOPT_NO_COALESCE");
  return !(e && *e && *e != '0');
}

bool use_joined(zopt_optimizer *o, Work &w) {
  const Program &P = *o->prog;
  if (!P.coalesce) return false;
  if (w.joined_gen != P.rows_gen) {
    try {
      join(o, w);
    } catch (const std::bad_alloc &) {
      w.joined_gen = 0;
      w.joins = false;
      return false;  // the chunks one by one: the same bits
    }
    w.joined_gen = P.rows_gen;
  }
  return w.joins;
}

}  // namespace exec
}  // namespace zopt
