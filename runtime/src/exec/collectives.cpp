// exec/collectives.cpp - the program's collectives over the communicator
// (comm/): REDUCE_SCATTER (every rank's shard to its owner, folded in rank
// order, fold.cpp) and ALL_GATHER per bucket, and gather_state (a state
// sharded across ranks, whole on every rank). docs/DISTRIBUTED.md.
#include "exec/exec_internal.h"

#include "comm/comm_internal.h"

#include <algorithm>
#include <cstdio>
#include <cstring>

namespace zopt {
namespace exec {

using layout::Piece;

// A short description of what a collective does, for the checks and errors.
const char *what(char *buf, size_t n, const char *op, const zopt_optimizer *o, int si, int b) {
  snprintf(buf, n, "%s %s bucket %d", op, si >= 0 ? state_kind_name(o->d->states[si].kind) : "", b);
  return buf;
}

// REDUCE_SCATTER: per bucket, every rank's values of shard q to rank q,
// which adds them in rank order into its own shard of the state.
zopt_status reduce_scatter(zopt_optimizer *o, const zopt_program_op &op) {
  for (int b = 0; b < (int)o->prog->L.buckets.size(); ++b)
    if (zopt_status st = reduce_scatter_bucket(o, op, b)) return st;
  return ZOPT_OK;
}

zopt_status reduce_scatter_bucket(zopt_optimizer *o, const zopt_program_op &op, int b, bool unchanged) {
  Program &P = *o->prog;
  const int W = o->world, r = o->rank, si = (int)op.state;
  const uint32_t dt = o->d->states[si].dtype;
  const size_t es = dtype_size(dt);
  const bool has_local_mask = !o->active.empty();
  {
    const layout::Bucket &k = P.L.buckets[b];
    char *send = (char *)P.send.data();
    // Pack: shard q's elements, in flat order, zero where no tensor (or a
    // tensor without a gradient on this rank) is. This rank's own shard is
    // not packed when every local tensor has a gradient: the fold reads it
    // where it is (the piece it overwrites, block by block after reading).
    const bool own_in_place = !has_local_mask;
    for (int q = 0; q < W; ++q) {
      if (q == r && own_in_place && W > 1) continue;
      int64_t a = k.begin + (int64_t)q * k.shard;
      pack_range(P, b, a, a + k.shard, es, send + (size_t)q * k.shard * es, [&](const Piece &p) -> const char * {
        return has_local_mask && !o->active[p.tensor] ? nullptr : view(o, si, p.tensor, p.start);
      });
    }
    char w[96];
    if (zopt_status st = comm_all_to_all(o->comm, send, P.recv.data(), (size_t)k.shard * es,
                                         what(w, sizeof w, "REDUCE_SCATTER", o, si, b),
                                         unchanged ? kSigUnchanged : 0))
      return st;
    // Fold this rank's shard into the state, piece by piece, on the pool.
    int64_t a, e;
    P.L.shard_range(b, r, &a, &e);
    std::vector<Piece> pieces = P.L.pieces(k.group, a, e);
    const int64_t base = k.begin + (int64_t)r * k.shard;
    const char *recv = (const char *)P.recv.data();
    parallel(o->pool, [&](int tid) {
      int T = o->pool->size();
      // Split the shard's elements evenly; each thread folds its slices.
      int64_t total = e - a, lo = a + total * tid / T, hi = a + total * (tid + 1) / T;
      const char *srcs[4096];
      for (const Piece &p : pieces) {
        int64_t pa = std::max(lo, p.flat), pe = std::min(hi, p.flat + p.len);
        if (pa >= pe || !active(P, p.tensor)) continue;
        for (int q = 0; q < W; ++q) srcs[q] = recv + ((size_t)q * k.shard + (pa - base)) * es;
        char *dst = view(o, si, p.tensor, p.start + (pa - p.flat));
        if (own_in_place && W > 1) srcs[r] = dst;
        fold(dt, W, srcs, dst, pe - pa);
      }
    });
  }
  return ZOPT_OK;
}

// ALL_GATHER: per bucket, every rank's shard of the state to every rank.
zopt_status all_gather(zopt_optimizer *o, const zopt_program_op &op) {
  for (int b = 0; b < (int)o->prog->L.buckets.size(); ++b)
    if (zopt_status st = all_gather_bucket(o, op, b)) return st;
  return ZOPT_OK;
}

zopt_status all_gather_bucket(zopt_optimizer *o, const zopt_program_op &op, int b, bool unchanged) {
  Program &P = *o->prog;
  const int W = o->world, r = o->rank, si = (int)op.state;
  const size_t es = es_of(o, si);
  const layout::Bucket &k = P.L.buckets[b];
  // This rank's shard packed into its own slot of the receive buffer:
  // the all-gather runs in place (no copy of it by the transport).
  char *send = (char *)P.recv.data() + (size_t)r * k.shard * es;
  const int64_t a = k.begin + (int64_t)r * k.shard;
  pack_range(P, b, a, a + k.shard, es, send,
             [&](const Piece &p) -> const char * { return view(o, si, p.tensor, p.start); });
  char w[96];
  if (zopt_status st = comm_all_gather(o->comm, send, P.recv.data(), (size_t)k.shard * es,
                                       what(w, sizeof w, "ALL_GATHER", o, si, b), unchanged ? kSigUnchanged : 0))
    return st;
  const char *recv = (const char *)P.recv.data();
  for (int q = 0; q < W; ++q) {
    if (q == r) continue;
    int64_t qa = k.begin + (int64_t)q * k.shard;
    for (const Piece &p : P.L.pieces(k.group, qa, std::min(qa + k.shard, k.begin + k.len)))
      memcpy(view(o, si, p.tensor, p.start), recv + (size_t)(p.flat - k.begin) * es, (size_t)p.len * es);
  }
  return ZOPT_OK;
}

zopt_status gather_state(zopt_optimizer *o, int si, int first, int count, void *const *dst) {
  Program &P = *o->prog;
  const size_t es = es_of(o, si);
  auto dst_of = [&](int t) -> char * {
    if (dst && dst[t - first]) return (char *)dst[t - first];
    return (char *)o->tensors[t].param;  // PARAM only (the caller checks)
  };
  if (holds_whole(o, si)) {
    // Whole on every rank (user memory, staging, a full buffer): a copy.
    for (int t = first; t < first + count; ++t)
      if (o->tensors[t].numel && dst_of(t) != (char *)state_ptr(o, t, si))
        memcpy(dst_of(t), state_ptr(o, t, si), (size_t)state_numel(o->d, si, o->tensors[t].numel) * es);
    return ZOPT_OK;
  }
  // Sharded: the buckets holding any element of the tensors, in order; each
  // rank's shard of the held buffer is sent as it is (its padding is zero).
  // A PER_BLOCK state in its own index space (layout.h "per block").
  const layout::Layout &L = P.layout_of(o->d, si, true);
  std::vector<int> buckets;
  for (int t = first; t < first + count; ++t) {
    const layout::Segment &sg = L.tensors[t];
    if (!sg.numel) continue;
    for (int b = sg.bucket; b < (int)L.buckets.size(); ++b) {
      const layout::Bucket &k = L.buckets[b];
      if (k.group != sg.group || k.begin >= sg.flat + sg.numel) break;
      buckets.push_back(b);
    }
  }
  std::sort(buckets.begin(), buckets.end());
  buckets.erase(std::unique(buckets.begin(), buckets.end()), buckets.end());
  // The scratch holds one bucket of the collectives' dtype: a wider state
  // (an f32 master of bf16 params) goes in pieces of `cap` elements per rank.
  if (buckets.empty()) return ZOPT_OK;  // only empty tensors (a model of them has no scratch)
  const int W = o->world;
  const size_t cap = P.recv.size() / (es * (size_t)W);
  if (cap == 0) return fail(ZOPT_ERR_INTERNAL, "gather_state: no collective scratch");
  for (int b : buckets) {
    const layout::Bucket &k = L.buckets[b];
    for (int64_t off = 0; off < k.shard;) {
      const int64_t c = std::min<int64_t>((int64_t)cap, k.shard - off);
      const char *send = (const char *)P.buf[si] + (size_t)(k.local_offset + off) * es;
      char w[96];
      // A gather only reads the optimizer (kSigUnchanged).
      if (zopt_status st = comm_all_gather(o->comm, send, P.recv.data(), (size_t)c * es,
                                           what(w, sizeof w, "GATHER", o, si, b), kSigUnchanged))
        return st;
      for (int q = 0; q < W; ++q) {
        const int64_t fa = k.begin + (int64_t)q * k.shard + off;  // rank q's piece: flat [fa, fa + c)
        const unsigned char *recv = P.recv.data() + (size_t)q * c * es;
        for (const Piece &p : L.pieces(k.group, fa, std::min(fa + c, k.begin + k.len))) {
          if (p.tensor < first || p.tensor >= first + count) continue;
          memcpy(dst_of(p.tensor) + (size_t)p.start * es, recv + (size_t)(p.flat - fa) * es, (size_t)p.len * es);
        }
      }
      off += c;
    }
  }
  return ZOPT_OK;
}
}  // namespace exec
}  // namespace zopt
