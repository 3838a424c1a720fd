// exec/exec.cpp - builds and runs the step program of a CPU-updated step
// (exec.h). docs/DISTRIBUTED.md describes the layout and the collectives.
#include "exec/exec.h"

#include "agree.h"
#include "backend/backend.h"
#include "comm/comm_internal.h"
#include "pipeline/pipeline.h"

#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <new>
#include <string>

namespace zopt {
namespace exec {

using layout::Layout;
using layout::Piece;

namespace {

constexpr int64_t kChunk = 65536;        // elements per update work unit
constexpr int64_t kChunkOverhead = 256;  // per-call cost in element-equivalents
constexpr int64_t k2to32 = int64_t(1) << 32;

const char *op_name(uint32_t code) {
  switch (code) {
    case ZOPT_OP_COPY: return "COPY";
    case ZOPT_OP_REDUCE_SCATTER: return "REDUCE_SCATTER";
    case ZOPT_OP_ALL_GATHER: return "ALL_GATHER";
    case ZOPT_OP_NORM_PARTIALS: return "NORM_PARTIALS";
    case ZOPT_OP_NORM: return "NORM";
    case ZOPT_OP_PREPARE: return "PREPARE";
    case ZOPT_OP_UPDATE: return "UPDATE";
    case ZOPT_OP_FINISH: return "FINISH";
  }
  return "?";
}

size_t es_of(const zopt_optimizer *o, int si) { return dtype_size(o->d->states[si].dtype); }

// Element `start` of tensor t's full view of state si (user memory, offload
// staging or a full runtime buffer).
char *view(const zopt_optimizer *o, int si, int t, int64_t start) {
  return (char *)state_ptr(o, t, si) + (size_t)start * es_of(o, si);
}

// The address of the element at flat offset `flat` of bucket b (tensor t,
// element `start`) in state si, on this rank. For a sharded buffer the
// element must lie in this rank's shard.
void *addr(const zopt_optimizer *o, int si, int b, int t, int64_t start, int64_t flat) {
  const Program &P = *o->prog;
  if (P.buf[si] && P.sharded[si])
    return (char *)P.buf[si] + (size_t)P.L.local_index(b, o->rank, flat) * es_of(o, si);
  return view(o, si, t, start);
}

bool active(const Program &P, int t) { return P.global_active.empty() || P.global_active[t]; }

// Element `start` of tensor t's param as the user gave it (offload: its
// host staging copy), whatever the runtime holds.
const void *user_param(const zopt_optimizer *o, int t, int64_t start) {
  const int pi = o->step->param_index;
  return (const char *)o->backend->param_on_host(o, t) + (size_t)start * es_of(o, pi);
}

// Splits a chunk list into contiguous per-thread ranges of ~equal cost.
void partition(Work &w, int T) {
  size_t n = w.chunks.size();
  double total = 0;
  for (auto &c : w.chunks) total += (double)(c.len + kChunkOverhead);
  w.thread_begin.assign(T + 1, n);
  w.thread_begin[0] = 0;
  double cum = 0;
  size_t i = 0;
  for (int t = 1; t < T; ++t) {
    double target = total * t / T;
    while (i < n && cum + 0.5 * (w.chunks[i].len + kChunkOverhead) < target) {
      cum += (double)(w.chunks[i].len + kChunkOverhead);
      ++i;
    }
    w.thread_begin[t] = i;
  }
  w.thread_begin[T] = n;
}

// The chunk of tensor piece `p` of bucket b, elements [off, off + len) of it.
Chunk make_chunk(const zopt_optimizer *o, int b, const Piece &p, int64_t off, int64_t len) {
  Chunk c;
  c.tensor = p.tensor;
  c.group = o->tensors[p.tensor].group;
  c.start = p.start + off;
  c.len = len;
  for (uint32_t s = 0; s < ZOPT_MAX_STATES; ++s) c.ptrs[s] = nullptr;
  for (uint32_t s = 0; s < o->d->num_states; ++s) {
    const Program &P = *o->prog;
    // A sharded state has no element outside this rank's shards (range ALL
    // is refused for such programs at build).
    c.ptrs[s] = addr(o, (int)s, b, p.tensor, c.start, p.flat + off);
    (void)P;
  }
  return c;
}

// The flat range of bucket b a range covers on this rank.
void range_of(const zopt_optimizer *o, int range, int b, int64_t *a, int64_t *e) {
  const Program &P = *o->prog;
  if (range == ZOPT_RANGE_OWNED) {
    P.L.shard_range(b, o->rank, a, e);
  } else {
    *a = P.L.buckets[b].begin;
    *e = *a + P.L.buckets[b].len;
  }
}

void build_update_work(zopt_optimizer *o, Work &w, int range) {
  const Program &P = *o->prog;
  w.chunks.clear();
  for (int b = 0; b < (int)P.L.buckets.size(); ++b) {
    int64_t a, e;
    range_of(o, range, b, &a, &e);
    for (const Piece &p : P.L.pieces(P.L.buckets[b].group, a, e)) {
      // Work units of at most kChunk elements that never straddle a
      // multiple of 2^32 of the tensor (stochastic rounding's index_hi).
      for (int64_t off = 0; off < p.len;) {
        int64_t at = p.start + off;
        int64_t lim = std::min(p.len - off, kChunk);
        lim = std::min(lim, (at / k2to32 + 1) * k2to32 - at);
        w.chunks.push_back(make_chunk(o, b, p, off, lim));
        off += lim;
      }
    }
  }
  partition(w, o->num_threads);
  w.built = true;
}

// The norm blocks of a range: OWNED, this rank's blocks of every bucket
// (shard / block each); ALL, every block of every bucket at W = 1.
// Blocks are listed in this rank's partials order (bucket, block).
void build_blocks(zopt_optimizer *o, Blocks &B, int range) {
  const Program &P = *o->prog;
  const Layout &L = range == ZOPT_RANGE_OWNED ? P.L : P.L1;
  const int r = range == ZOPT_RANGE_OWNED ? o->rank : 0;
  B.sumsq.chunks.clear();
  B.first.clear();
  const int64_t NB = L.block;
  for (int b = 0; b < (int)L.buckets.size(); ++b) {
    const layout::Bucket &k = L.buckets[b];
    int64_t nb = k.shard / NB;
    for (int64_t j = 0; j < nb; ++j) {
      B.first.push_back(B.sumsq.chunks.size());
      int64_t a = k.begin + (int64_t)r * k.shard + j * NB;
      int64_t e = std::min(a + NB, k.begin + k.len);
      for (const Piece &p : L.pieces(k.group, a, e)) B.sumsq.chunks.push_back(make_chunk(o, b, p, 0, p.len));
    }
  }
  B.first.push_back(B.sumsq.chunks.size());
  B.chunk_partials.assign(B.sumsq.chunks.size(), 0.0);
  B.partials.assign(B.first.size() - 1, 0.0);
  partition(B.sumsq, o->num_threads);
  B.sumsq.built = true;
}

void free_buffers(zopt_optimizer *o) {
  Program &P = *o->prog;
  for (size_t s = 0; s < P.buf.size(); ++s) {
    if (P.buf[s] && !P.pinned[s]) free(P.buf[s]);  // pinned: the backend's staging
    P.buf[s] = nullptr;
  }
}

// An uninitialized buffer: large ones on 2 MiB boundaries, advised as
// transparent huge pages (the step streams several of them at once and
// 4 KiB pages cost TLB misses; where THP is "madvise", the common default,
// nothing else gets huge pages).
zopt_status alloc_host(size_t bytes, const char *what, void **out) {
  const size_t huge = size_t(2) << 20;
  const bool big = bytes >= 2 * huge;
  void *p = nullptr;
  if (posix_memalign(&p, big ? huge : 64, std::max<size_t>(bytes, 64)) != 0 || !p)
    return fail(ZOPT_ERR_OUT_OF_MEMORY, "zopt_optimizer_finalize: cannot allocate %zu bytes for %s", bytes, what);
  if (big) madvise(p, bytes, MADV_HUGEPAGE);  // advice only
  *out = p;
  return ZOPT_OK;
}

// Zeroes what no tensor covers (align gaps, bucket padding) in a held
// buffer: it is part of what collectives and checkpoints move.
void zero_gaps(zopt_optimizer *o, int si) {
  Program &P = *o->prog;
  const bool sh = P.sharded[si];
  const Layout &L = sh ? P.L : P.L1;
  const int r = sh ? o->rank : 0;
  const size_t es = es_of(o, si);
  char *base = (char *)P.buf[si];
  for (int b = 0; b < (int)L.buckets.size(); ++b) {
    const layout::Bucket &k = L.buckets[b];
    int64_t a = k.begin + (int64_t)r * k.shard, e = a + k.shard;
    int64_t pos = a;  // flat position up to which the shard is accounted for
    for (const Piece &p : L.pieces(k.group, a, std::min(e, k.begin + k.len))) {
      if (p.flat > pos) memset(base + (size_t)(k.local_offset + pos - a) * es, 0, (size_t)(p.flat - pos) * es);
      pos = p.flat + p.len;
    }
    if (e > pos) memset(base + (size_t)(k.local_offset + pos - a) * es, 0, (size_t)(e - pos) * es);
  }
}

// ---- collectives --------------------------------------------------------

// A short description of what a collective does, for the checks and errors.
const char *what(char *buf, size_t n, const char *op, const zopt_optimizer *o, int si, int b) {
  snprintf(buf, n, "%s %s bucket %d", op, si >= 0 ? state_kind_name(o->d->states[si].kind) : "", b);
  return buf;
}

// Packs flat range [a, e) of bucket b (e.g. one rank's shard) into dst:
// each tensor piece's elements from src(piece) (nullptr: zeros), zeros
// where no tensor is (align gaps, padding).
template <class Src>
void pack_range(const Program &P, int b, int64_t a, int64_t e, size_t es, char *dst, Src src) {
  const layout::Bucket &k = P.L.buckets[b];
  int64_t pos = a;
  for (const Piece &p : P.L.pieces(k.group, a, std::min(e, k.begin + k.len))) {
    if (p.flat > pos) memset(dst + (pos - a) * es, 0, (size_t)(p.flat - pos) * es);
    if (const char *x = src(p))
      memcpy(dst + (p.flat - a) * es, x, (size_t)p.len * es);
    else
      memset(dst + (p.flat - a) * es, 0, (size_t)p.len * es);
    pos = p.flat + p.len;
  }
  if (e > pos) memset(dst + (pos - a) * es, 0, (size_t)(e - pos) * es);
}

// REDUCE_SCATTER: per bucket, every rank's values of shard q to rank q,
// which adds them in rank order into its own shard of the state.
zopt_status reduce_scatter(zopt_optimizer *o, const zopt_program_op &op) {
  Program &P = *o->prog;
  const int W = o->world, r = o->rank, si = (int)op.state;
  const uint32_t dt = o->d->states[si].dtype;
  const size_t es = dtype_size(dt);
  const bool has_local_mask = !o->active.empty();
  for (int b = 0; b < (int)P.L.buckets.size(); ++b) {
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
                                         what(w, sizeof w, "REDUCE_SCATTER", o, si, b)))
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
  Program &P = *o->prog;
  const int W = o->world, r = o->rank, si = (int)op.state;
  const size_t es = es_of(o, si);
  for (int b = 0; b < (int)P.L.buckets.size(); ++b) {
    const layout::Bucket &k = P.L.buckets[b];
    // This rank's shard packed into its own slot of the receive buffer:
    // the all-gather runs in place (no copy of it by the transport).
    char *send = (char *)P.recv.data() + (size_t)r * k.shard * es;
    const int64_t a = k.begin + (int64_t)r * k.shard;
    pack_range(P, b, a, a + k.shard, es, send,
               [&](const Piece &p) -> const char * { return view(o, si, p.tensor, p.start); });
    char w[96];
    if (zopt_status st = comm_all_gather(o->comm, send, P.recv.data(), (size_t)k.shard * es,
                                         what(w, sizeof w, "ALL_GATHER", o, si, b)))
      return st;
    const char *recv = (const char *)P.recv.data();
    for (int q = 0; q < W; ++q) {
      if (q == r) continue;
      int64_t qa = k.begin + (int64_t)q * k.shard;
      for (const Piece &p : P.L.pieces(k.group, qa, std::min(qa + k.shard, k.begin + k.len)))
        memcpy(view(o, si, p.tensor, p.start), recv + (size_t)(p.flat - k.begin) * es, (size_t)p.len * es);
    }
  }
  return ZOPT_OK;
}

// "3, 4, 7" (at most 8, then "... (N in all)").
std::string tensor_list(const std::vector<int> &ts) {
  std::string s;
  for (size_t i = 0; i < ts.size() && i < 8; ++i) s += (i ? ", " : "") + std::to_string(ts[i]);
  if (ts.size() > 8) s += ", ... (" + std::to_string(ts.size()) + " in all)";
  return s.empty() ? "none" : s;
}

// ---- the coefficient table ----------------------------------------------

// One row per (group, t) among the tensors this step updates; prepare()
// fills each with the given clip coefficient and the gradient scale of
// loss scale S (grad_scale).
void prepare_rows(zopt_optimizer *o, bool rebuild, double clip, double S) {
  Program &P = *o->prog;
  const zopt_step_descriptor *d = o->d;
  if (rebuild) {
    P.rows.clear();
    P.row_of_tensor.assign(o->tensors.size(), -1);
    for (size_t t = 0; t < o->tensors.size(); ++t) {
      if (!active(P, (int)t)) continue;
      std::pair<int, int64_t> key{o->tensors[t].group, o->tensors[t].steps + 1};
      int row = -1;
      for (size_t i = P.rows.size(); i-- > 0;)  // usually one row per group
        if (P.rows[i] == key) {
          row = (int)i;
          break;
        }
      if (row < 0) {
        row = (int)P.rows.size();
        P.rows.push_back(key);
      }
      P.row_of_tensor[t] = row;
    }
    P.coeffs.assign(std::max<size_t>(P.rows.size(), 1) * ZOPT_MAX_COEFFS, 0.0f);
  }
  double hyp[ZOPT_MAX_HYPERS + 1];
  for (size_t i = 0; i < P.rows.size(); ++i) {
    const Group &g = o->groups[P.rows[i].first];
    double globals[ZOPT_NUM_GLOBALS];
    globals[ZOPT_GLOBAL_STEP] = (double)P.rows[i].second;
    globals[ZOPT_GLOBAL_CLIP_COEF] = clip;
    globals[ZOPT_GLOBAL_GRAD_SCALE] = grad_scale(o, S, g.flags);
    for (uint32_t h = 0; h < d->num_hypers; ++h) hyp[h] = g.hypers[h];
    o->step->prepare(hyp, globals, P.coeffs.data() + i * ZOPT_MAX_COEFFS);
  }
}

const float *coeffs_of(const Program &P, int t) {
  return P.coeffs.data() + (size_t)P.row_of_tensor[t] * ZOPT_MAX_COEFFS;
}

// ---- kernels on the pool --------------------------------------------------

void run_sumsq(zopt_optimizer *o, Blocks &B) {
  Program &P = *o->prog;
  zopt_sumsq_fn f = o->step->sumsq;
  parallel(o->pool, [&](int tid) {
    for (size_t i = B.sumsq.thread_begin[tid]; i < B.sumsq.thread_begin[tid + 1]; ++i) {
      const Chunk &c = B.sumsq.chunks[i];
      // A tensor without a gradient contributes +0.0: no sum changes.
      B.chunk_partials[i] = active(P, c.tensor) ? f(c.ptrs, c.len, coeffs_of(P, c.tensor)) : 0.0;
    }
  });
  for (size_t k = 0; k + 1 < B.first.size(); ++k) {
    double s = 0;
    for (size_t i = B.first[k]; i < B.first[k + 1]; ++i) s += B.chunk_partials[i];
    B.partials[k] = s;
  }
}

void run_update(zopt_optimizer *o, Work &w) {
  Program &P = *o->prog;
  const bool sr = o->d->flags & ZOPT_FLAG_STOCHASTIC;
  parallel(o->pool, [&](int tid) {
    for (size_t i = w.thread_begin[tid]; i < w.thread_begin[tid + 1]; ++i) {
      const Chunk &c = w.chunks[i];
      if (!active(P, c.tensor)) continue;
      const float *co = coeffs_of(P, c.tensor);
      if (sr) {
        // abi.h "Stochastic rounding": the key of (seed, the tensor's step
        // being taken, tensor, high half of the chunk's first index).
        uint64_t t = (uint64_t)o->tensors[c.tensor].steps + 1;
        uint32_t key = zopt_sr_key(o->seed, t, (uint32_t)c.tensor, (uint32_t)((uint64_t)c.start >> 32));
        ((zopt_update_sr_fn)(void *)o->step->update)(c.ptrs, c.ptrs, c.len, co, key, (uint32_t)c.start);
      } else {
        o->step->update(c.ptrs, c.ptrs, c.len, co);
      }
    }
  });
}

}  // namespace

zopt_control decide(const zopt_optimizer *o, double sumsq) {
  zopt_control c;
  memset(&c, 0, sizeof c);
  c.sumsq = sumsq;
  c.max_norm = o->max_norm;
  c.scale = o->scaler.scale;
  c.growth_factor = o->scaler.cfg.growth_factor;
  c.backoff_factor = o->scaler.cfg.backoff_factor;
  c.min_scale = o->scaler.cfg.min_scale;
  c.growth_interval = o->scaler.cfg.growth_interval;
  c.good_steps = o->scaler.good_steps;
  c.dynamic = o->scaler.cfg.dynamic ? 1u : 0u;
  o->step->control(&c);
  return c;
}

namespace {

// ---- agreement between ranks -----------------------------------------------

// The hash of step_settings() (agree.h): the same fields, without building
// their names every step.
uint64_t hash_step_settings(const zopt_optimizer *o) {
  uint64_t h = fnv1a64(&o->seed, sizeof o->seed);
  for (const Group &g : o->groups) {
    h = fnv1a64(&g.step_count, sizeof g.step_count, h);
    h = fnv1a64(g.hypers.data(), g.hypers.size() * sizeof(double), h);
    h = fnv1a64(&g.flags, sizeof g.flags, h);
  }
  double D = grad_divisor(o);
  h = fnv1a64(&D, sizeof D, h);
  double S = loss_scale(o);
  h = fnv1a64(&S, sizeof S, h);
  double m = (o->d->flags & ZOPT_FLAG_CLIP) ? o->max_norm : 0;
  h = fnv1a64(&m, sizeof m, h);
  return h;
}

// Every rank's gradient mask (OR) and a check that every rank steps with the
// same hyperparameters, group flags, step counts, seed, divisor, loss scale
// and max_norm.
zopt_status agree(zopt_optimizer *o, bool first) {
  Program &P = *o->prog;
  const size_t T = o->tensors.size();
  if (o->stream_grads) {
    // The local mask is what the caller handed to reduce_bucket (empty
    // tensors, in no bucket, have a gradient); there is no grad memory.
    std::vector<uint8_t> local(T);
    bool all = true;
    for (size_t t = 0; t < T; ++t) {
      local[t] = o->tensors[t].numel == 0 || P.stream_given[t] == 1;
      all = all && local[t];
    }
    if (all) local.clear();
    o->active.swap(local);
  } else if (o->world == 1) {
    for (size_t t = 0; t < T; ++t)
      if (!o->tensors[t].grad && o->tensors[t].numel && (o->active.empty() || o->active[t]))
        return fail(ZOPT_ERR_INVALID_ARGUMENT,
                    "zopt_optimizer_step: tensor %zu has no gradient memory (zopt_optimizer_set_tensor_memory with "
                    "grad NULL) but is active: mark it inactive with zopt_optimizer_set_active",
                    t);
    P.global_active = o->active;
    return ZOPT_OK;
  }
  if (o->world == 1) {
    P.global_active = o->active;
    return ZOPT_OK;
  }
  const size_t msg = 8 + T;
  std::vector<unsigned char> mine(msg), all(msg * o->world);
  uint64_t h = hash_step_settings(o);
  memcpy(mine.data(), &h, 8);
  // Per tensor: 1 a gradient, 0 none, 2 none and no gradient memory (the
  // reduced gradient of a tensor another rank updates lands in it).
  for (size_t t = 0; t < T; ++t) {
    uint8_t a = o->active.empty() ? 1 : o->active[t];
    mine[8 + t] = a ? 1 : (o->tensors[t].grad || !o->tensors[t].numel || o->stream_grads) ? 0 : 2;
  }
  // The step's first collective: nothing changed yet (kSigUnchanged).
  if (zopt_status st = comm_all_gather(o->comm, mine.data(), all.data(), msg, "STEP settings and gradient mask",
                                       first ? kSigUnchanged : 0))
    return st;
  // Rank 0's values are the reference: name every rank that differs.
  uint64_t h0;
  memcpy(&h0, all.data(), 8);
  std::string bad;
  for (int q = 1; q < o->world; ++q) {
    uint64_t hq;
    memcpy(&hq, all.data() + q * msg, 8);
    if (hq != h0) bad += (bad.empty() ? "" : ", ") + std::to_string(q);
  }
  if (!bad.empty()) return explain_step_disagreement(o);  // every rank saw it: names the settings
  P.global_active.assign(T, 0);
  bool all_on = true;
  for (size_t t = 0; t < T; ++t) {
    for (int q = 0; q < o->world; ++q) P.global_active[t] |= all[q * msg + 8 + t] & 1;
    all_on = all_on && P.global_active[t];
  }
  for (size_t t = 0; t < T; ++t)
    for (int q = 0; q < o->world && P.global_active[t]; ++q)
      if (all[q * msg + 8 + t] == 2)
        return fail(ZOPT_ERR_INVALID_ARGUMENT,
                    "zopt_optimizer_step: tensor %zu has a gradient on some rank but rank %d registered no gradient "
                    "memory for it (zopt_optimizer_set_tensor_memory with grad NULL): the reduced gradient needs it",
                    t, q);
  if (all_on) P.global_active.clear();
  return ZOPT_OK;
}

}  // namespace

// One op of the program on the host (NORM only sums: run_end decides).
zopt_status run_host_op(zopt_optimizer *o, StepState *st, size_t i) {
  Program &P = *o->prog;
  const zopt_step_descriptor *d = o->d;
  const zopt_program_op &op = P.ops[i];
  using clock = std::chrono::steady_clock;
  struct Timer {
    double *out;
    clock::time_point t = clock::now();
    ~Timer() { *out = std::chrono::duration<double>(clock::now() - t).count(); }
  } timer{&P.op_seconds[i]};
  switch (op.code) {
    case ZOPT_OP_COPY: {
      // Staged user tensors (validate allows COPY only then): to the host,
      // wait after the last of a run of such copies (the CPU reads them
      // next); to the device, asynchronous, ordered before the caller's
      // next work on the stream.
      const bool to_host = op.dst == ZOPT_PLACE_CPU;
      const bool more = i + 1 < P.ops.size() && P.ops[i + 1].code == ZOPT_OP_COPY && P.ops[i + 1].dst == op.dst;
      return o->backend->copy_staged(o, (int)op.state, !to_host, to_host && !more);
    }
    case ZOPT_OP_REDUCE_SCATTER:
      // Streaming: the caller reduced the buckets (run_begin checked).
      if (o->stream_grads) return ZOPT_OK;
      return o->world > 1 ? reduce_scatter(o, op) : ZOPT_OK;
    case ZOPT_OP_ALL_GATHER:
      return o->world > 1 ? all_gather(o, op) : ZOPT_OK;
    case ZOPT_OP_PREPARE:
      prepare_rows(o, true, 1.0, st->S);
      return ZOPT_OK;
    case ZOPT_OP_NORM_PARTIALS:
      run_sumsq(o, op.range == ZOPT_RANGE_OWNED ? P.norm_owned : P.norm_all);
      return ZOPT_OK;
    case ZOPT_OP_NORM: {
      // Every rank's partials, added in (bucket, block) order: the same
      // bits on every rank, at any world size, thread count and ISA.
      double sum = 0;
      if (P.norm_range == ZOPT_RANGE_OWNED) {
        const std::vector<double> *all = &P.norm_owned.partials;
        if (o->world > 1) {
          if (zopt_status s = comm_all_gather(o->comm, P.norm_owned.partials.data(), P.gathered.data(),
                                              P.norm_owned.partials.size() * sizeof(double), "NORM partials"))
            return s;
          all = &P.gathered;
        }
        const int64_t bpr = P.L.blocks_per_rank, NB = P.L.block;
        for (const layout::Bucket &k : P.L.buckets) {
          const int64_t nb = k.shard / NB;
          for (int q = 0; q < o->world; ++q)
            for (int64_t j = 0; j < nb; ++j) {
              if ((q * nb + j) * NB >= k.len) break;
              sum += (*all)[(size_t)(q * bpr + k.block_offset + j)];
            }
        }
      } else {
        const int64_t NB = P.L1.block;
        for (const layout::Bucket &k : P.L1.buckets)
          for (int64_t j = 0; j < k.shard / NB && j * NB < k.len; ++j)
            sum += P.norm_all.partials[(size_t)(k.block_offset + j)];
      }
      st->sumsq = sum;
      st->has_norm = true;
      return ZOPT_OK;
    }
    case ZOPT_OP_UPDATE:
      run_update(o, op.range == ZOPT_RANGE_OWNED ? P.update_owned : P.update_all);
      return ZOPT_OK;
    case ZOPT_OP_FINISH:
      // What CONTROL decided at run_end: the counts of the updated
      // tensors and their groups, the loss scaler's next state.
      if (st->ctl.advance) {
        std::vector<uint8_t> touched(o->groups.size(), 0);
        for (size_t t = 0; t < o->tensors.size(); ++t)
          if (active(P, (int)t)) {
            o->tensors[t].steps++;
            touched[o->tensors[t].group] = 1;
          }
        for (size_t g = 0; g < o->groups.size(); ++g) o->groups[g].step_count += touched[g];
      }
      if (d->flags & ZOPT_FLAG_LOSS_SCALE) {
        o->scaler.scale = st->ctl.new_scale;
        o->scaler.good_steps = st->ctl.new_good_steps;
      }
      return ZOPT_OK;
  }
  return ZOPT_OK;
}

// ---- build ------------------------------------------------------------------

static zopt_status validate(zopt_optimizer *o) {
  const zopt_step_descriptor *d = o->d;
  if (d->num_program == 0)
    return fail(ZOPT_ERR_ABI, "step '%s' has no step program", d->name);
  int updates = 0, norms = 0;
  for (uint32_t i = 0; i < d->num_program; ++i) {
    const zopt_program_op &op = d->program[i];
    const char *name = op_name(op.code);
    auto bad = [&](const char *why) {
      return fail(ZOPT_ERR_ABI, "step '%s': program op %u (%s) %s", d->name, i, name, why);
    };
    switch (op.code) {
      case ZOPT_OP_COPY: {
        uint32_t k = d->states[op.state].kind;
        if (!o->backend->stages() || (k != ZOPT_STATE_PARAM && k != ZOPT_STATE_GRAD))
          return bad("copies a state this runtime does not stage (only offloaded params and grads)");
        if (op.src == op.dst) return bad("copies to the same placement");
        break;
      }
      case ZOPT_OP_REDUCE_SCATTER:
        if (d->states[op.state].kind != ZOPT_STATE_GRAD) return bad("reduces a state other than the grad");
        if (op.dtype != d->states[op.state].dtype || op.accum != ZOPT_DTYPE_F32)
          return bad("moves another dtype than the grad's or accumulates in other than f32");
        break;
      case ZOPT_OP_ALL_GATHER: {
        uint32_t k = d->states[op.state].kind;
        if (k != ZOPT_STATE_PARAM && k != ZOPT_STATE_GRAD) return bad("gathers a state other than param or grad");
        if (op.dtype != d->states[op.state].dtype) return bad("moves another dtype than the state's");
        if (d->states[op.state].flags & ZOPT_STATE_PARTITIONED)
          return bad("gathers a state the runtime holds sharded (ZeRO-3 params are gathered on request)");
        break;
      }
      case ZOPT_OP_NORM_PARTIALS:
        if (!(d->flags & ZOPT_FLAG_SUMSQ)) return bad("needs a SUMSQ kernel");
        if (op.range != ZOPT_RANGE_OWNED && op.range != ZOPT_RANGE_ALL) return bad("has no valid range");
        o->prog->norm_range = (int)op.range;
        break;
      case ZOPT_OP_UPDATE:
        if (op.range != ZOPT_RANGE_OWNED && op.range != ZOPT_RANGE_ALL) return bad("has no valid range");
        o->prog->update_range = (int)op.range;
        ++updates;
        break;
      case ZOPT_OP_NORM:
        // run_begin/run_end split the step at the NORM: the norm decides
        // the update.
        if (updates || norms) return bad("is not the one NORM before the UPDATE");
        if (o->prog->norm_range == 0) return bad("has no NORM_PARTIALS before it");
        ++norms;
        break;
      case ZOPT_OP_PREPARE:
      case ZOPT_OP_FINISH:
        break;
      default:
        return bad("is not an op this runtime knows");
    }
    if (op.code != ZOPT_OP_COPY && (op.src != ZOPT_PLACE_CPU))
      return bad("runs on the GPU, but this step's update runs on the CPU");
  }
  if (updates != 1) return fail(ZOPT_ERR_ABI, "step '%s': the program has %d UPDATE ops (need 1)", d->name, updates);
  // CONTROL reads the sum of squares exactly when the step has a SUMSQ
  // kernel: the program takes the norm then, and only then.
  if ((norms != 0) != ((d->flags & ZOPT_FLAG_SUMSQ) != 0))
    return fail(ZOPT_ERR_ABI, "step '%s': the program %s a NORM op but the step %s a SUMSQ kernel", d->name,
                norms ? "has" : "has no", norms ? "has no" : "has");
  if (o->stream_grads) {
    // Streaming replaces the program's reduction of the whole gradient by
    // the caller's per-bucket reductions into runtime-held shards: the
    // program must reduce the gradient, update only owned elements and
    // never need the full gradient (ZeRO-2 and 3).
    bool reduces = false, gathers_grad = false;
    for (uint32_t i = 0; i < d->num_program; ++i) {
      const zopt_program_op &op = d->program[i];
      if (op.code == ZOPT_OP_REDUCE_SCATTER) reduces = true;
      if (op.code == ZOPT_OP_ALL_GATHER && d->states[op.state].kind == ZOPT_STATE_GRAD) gathers_grad = true;
    }
    if (!reduces || gathers_grad || o->prog->update_range != ZOPT_RANGE_OWNED ||
        (o->prog->norm_range && o->prog->norm_range != ZOPT_RANGE_OWNED))
      return fail(ZOPT_ERR_UNSUPPORTED,
                  "zopt_optimizer_finalize: step '%s' (ZeRO stage %u) needs every rank's full gradient; gradient "
                  "streaming (zopt_optimizer_set_grad_streaming) is for ZeRO-2 and ZeRO-3 steps",
                  d->name, d->zero_stage);
  }
  bool any_sharded = false;
  for (uint32_t s = 0; s < d->num_states; ++s) any_sharded |= (d->states[s].flags & ZOPT_STATE_PARTITIONED) != 0;
  if (any_sharded && (o->prog->update_range == ZOPT_RANGE_ALL || o->prog->norm_range == ZOPT_RANGE_ALL))
    return fail(ZOPT_ERR_ABI, "step '%s': the program updates every element but some states are sharded", d->name);
  return ZOPT_OK;
}

// Bytes per element of the widest state a collective of the step moves
// (the grad it reduces, the param or grad it gathers; gather_state moves
// wider sharded states through the same scratch in pieces); 0 for none.
static size_t collective_es(const zopt_optimizer *o) {
  const zopt_step_descriptor *d = o->d;
  size_t es = 0;
  for (uint32_t i = 0; i < d->num_program; ++i) {
    const zopt_program_op &op = d->program[i];
    if (op.code == ZOPT_OP_REDUCE_SCATTER || op.code == ZOPT_OP_ALL_GATHER)
      es = std::max(es, dtype_size(d->states[op.state].dtype));
  }
  if (o->stream_grads) es = std::max(es, dtype_size(d->states[o->step->grad_index].dtype));
  for (uint32_t s = 0; s < d->num_states && !es; ++s)  // sharded states only gathered on request
    if (d->states[s].flags & ZOPT_STATE_PARTITIONED) es = dtype_size(d->states[s].dtype);
  return es;
}

// The bucket size when the caller sets none (docs/DISTRIBUTED.md "Memory"):
// ZeRO must not cost a rank more memory than one rank holds at stage 0, so
// the collective scratch (two buffers of one bucket of `es_c`-byte
// elements) gets at most half of what sharding saves a rank on the `elems`
// elements, per element (times W): the sharded optimizer states' es (W - 1)
// and the streamed gradient's (the rank holds its shard, not the
// gradients), less the ZeRO-3 param shard's es (held besides the user's
// params). Rounded down to a multiple of W blocks, at least W blocks, at
// most kDefaultBucket; kDefaultBucket at W = 1 (no scratch) and where
// sharding saves nothing (ZeRO-0: DDP's reduction needs its scratch).
static int64_t default_bucket(const zopt_optimizer *o, int64_t elems, int64_t block, size_t es_c) {
  const int W = o->world;
  if (W <= 1 || es_c == 0) return layout::kDefaultBucket;
  const zopt_step_descriptor *d = o->d;
  int64_t saved_w = 0;  // bytes saved per element, times W
  for (uint32_t s = 0; s < d->num_states; ++s) {
    const zopt_state_desc &sd = d->states[s];
    const int64_t es = (int64_t)dtype_size(sd.dtype);
    const bool part = sd.flags & ZOPT_STATE_PARTITIONED;
    if (sd.kind == ZOPT_STATE_PARAM) saved_w -= part ? es : 0;
    else if (sd.kind == ZOPT_STATE_GRAD) saved_w += o->stream_grads ? es * (W - 1) : 0;
    else if (part) saved_w += es * (W - 1);
  }
  if (saved_w <= 0) return layout::kDefaultBucket;
  const int64_t quantum = (int64_t)W * block;
  const __int128 fit = (__int128)saved_w * elems / ((__int128)4 * (int64_t)es_c * W);
  int64_t b = fit >= layout::kDefaultBucket ? layout::kDefaultBucket : (int64_t)fit;
  b = b / quantum * quantum;
  return std::max(b, quantum);
}

zopt_status build(zopt_optimizer *o) {
  const zopt_step_descriptor *d = o->d;
  Program *P = new (std::nothrow) Program;
  if (!P) return fail(ZOPT_ERR_OUT_OF_MEMORY, "zopt_optimizer_finalize: out of memory");
  o->prog = P;
  auto bail = [&](zopt_status st) {
    destroy(o);
    return st;
  };
  if (zopt_status st = validate(o)) return bail(st);
  try {
    P->ops.assign(d->program, d->program + d->num_program);
    layout::Input in;
    in.num_groups = (int)o->groups.size();
    for (const Tensor &x : o->tensors) {
      in.group.push_back(x.group);
      in.numel.push_back(x.numel);
    }
    in.align = d->align;
    int64_t elems = 0;
    for (int64_t n : in.numel) elems += n;
    in.block = layout::block_for(elems, in.align);  // the same at every W
    const size_t es_c = collective_es(o);
    in.bucket = o->bucket_elems > 0 ? o->bucket_elems : default_bucket(o, elems, in.block, es_c);
    in.world = o->world;
    P->L = layout::make_layout(in);
    in.world = 1;
    P->L1 = layout::make_layout(in);
    const size_t S = d->num_states;
    P->buf.assign(S, nullptr);
    P->sharded.assign(S, 0);
    P->pinned.assign(S, 0);
    P->buf_bytes.assign(S, 0);
    bool reduces = o->stream_grads;
    for (uint32_t i = 0; i < d->num_program; ++i) reduces |= d->program[i].code == ZOPT_OP_REDUCE_SCATTER;
    for (uint32_t s = 0; s < S; ++s) {
      const zopt_state_desc &sd = d->states[s];
      const size_t es = dtype_size(sd.dtype);
      const bool user = !is_owned_kind(sd.kind);
      const bool zero3_param = sd.kind == ZOPT_STATE_PARAM && (sd.flags & ZOPT_STATE_PARTITIONED);
      const bool streamed_grad = o->stream_grads && sd.kind == ZOPT_STATE_GRAD;
      if (streamed_grad) {
        // This rank's reduced gradient shards (zopt_optimizer_reduce_bucket).
        P->sharded[s] = 1;
        P->buf_bytes[s] = ((size_t)P->L.local_elems * es + 63) & ~(size_t)63;
        if (zopt_status st = alloc_host(P->buf_bytes[s], "streamed gradient shards", &P->buf[s])) return bail(st);
        continue;
      }
      const bool staged = o->backend->stages();
      if (user && !zero3_param && !staged) continue;  // the user's memory
      if (user && staged && !zero3_param) {
        // Staging of device-resident user tensors: full (the backend
        // allocates and frees it: pinned host memory).
        P->buf_bytes[s] = ((size_t)P->L1.local_elems * es + 63) & ~(size_t)63;
        if (zopt_status st = o->backend->alloc_staging(o, P->buf_bytes[s], &P->buf[s])) return bail(st);
        P->pinned[s] = 1;
        continue;
      }
      P->sharded[s] = (sd.flags & ZOPT_STATE_PARTITIONED) ? 1 : 0;
      const int64_t elems = P->sharded[s] ? P->L.local_elems : P->L1.local_elems;
      P->buf_bytes[s] = ((size_t)elems * es + 63) & ~(size_t)63;
      if (zopt_status st = alloc_host(P->buf_bytes[s], state_kind_name(sd.kind), &P->buf[s])) return bail(st);
    }
    // Collective scratch, at W > 1 only (one rank reduces a streamed bucket
    // straight into its shard): one bucket of the collectives' dtype to
    // receive, another to send where the program reduces.
    if (o->world > 1) {
      if (reduces) P->send.resize((size_t)P->L.max_padded * es_c);
      P->recv.resize((size_t)P->L.max_padded * es_c);
      P->gathered.resize((size_t)P->L.blocks_per_rank * o->world);
    }
    P->bucket_reduced.assign(P->L.buckets.size(), 0);
    P->bucket_queued.assign(P->L.buckets.size(), 0);
    P->bucket_ticket.assign(P->L.buckets.size(), 0);
    P->stream_given.assign(o->tensors.size(), 0);
    build_update_work(o, P->update_range == ZOPT_RANGE_OWNED ? P->update_owned : P->update_all, P->update_range);
    if (P->norm_range)
      build_blocks(o, P->norm_range == ZOPT_RANGE_OWNED ? P->norm_owned : P->norm_all, P->norm_range);
  } catch (...) {
    return bail(fail(ZOPT_ERR_OUT_OF_MEMORY, "zopt_optimizer_finalize: out of memory"));
  }
  // Staged params: from the device first (the master is made from them).
  if (o->backend->stages())
    if (zopt_status st = o->backend->copy_staged(o, o->step->param_index, false, true)) return bail(st);
  // Initialize the held states, each chunk by the thread that updates it
  // (first touch): ZeRO-3 params and masters from the user's params,
  // moments zero; then the gaps and padding zero.
  Work &w = P->update_range == ZOPT_RANGE_OWNED ? P->update_owned : P->update_all;
  const int pi = o->step->param_index;
  parallel(o->pool, [&](int tid) {
    for (size_t i = w.thread_begin[tid]; i < w.thread_begin[tid + 1]; ++i) {
      const Chunk &c = w.chunks[i];
      const void *src = user_param(o, c.tensor, c.start);
      for (uint32_t s = 0; s < d->num_states; ++s) {
        if (!P->buf[s] || P->pinned[s]) continue;
        const zopt_state_desc &sd = d->states[s];
        if (sd.kind == ZOPT_STATE_PARAM || sd.init == ZOPT_INIT_FROM_PARAM)
          convert(src, d->states[pi].dtype, c.ptrs[s], sd.dtype, c.len);
        else
          memset(c.ptrs[s], 0, (size_t)c.len * dtype_size(sd.dtype));
      }
    }
  });
  for (uint32_t s = 0; s < d->num_states; ++s)
    if (P->buf[s]) zero_gaps(o, (int)s);
  return ZOPT_OK;
}

// Only for the state ptr of a whole tensor (exec.h runs).
bool holds_whole(const zopt_optimizer *o, int si) {
  const Program *P = o->prog;
  return !P || !P->buf[si] || !P->sharded[si] || o->world == 1;
}

void runs(const zopt_optimizer *o, int t, int si, std::vector<Run> *out) {
  out->clear();
  const Tensor &x = o->tensors[t];
  if (!x.numel) return;
  if (holds_whole(o, si)) {
    out->push_back(Run{0, x.numel, state_ptr(o, t, si)});
    return;
  }
  const Program &P = *o->prog;
  const layout::Segment &seg = P.L.tensors[t];
  for (int b = seg.bucket; b < (int)P.L.buckets.size(); ++b) {
    const layout::Bucket &k = P.L.buckets[b];
    if (k.group != seg.group || k.begin >= seg.flat + seg.numel) break;
    int64_t a, e;
    P.L.shard_range(b, o->rank, &a, &e);
    a = std::max(a, seg.flat);
    e = std::min(e, seg.flat + seg.numel);
    if (a < e)
      out->push_back(Run{a - seg.flat, e - a,
                         (char *)P.buf[si] + (size_t)P.L.local_index(b, o->rank, a) * es_of(o, si)});
  }
}

void rebind(zopt_optimizer *o) {
  Program *P = o->prog;
  if (!P) return;
  if (P->update_owned.built) build_update_work(o, P->update_owned, ZOPT_RANGE_OWNED);
  if (P->update_all.built) build_update_work(o, P->update_all, ZOPT_RANGE_ALL);
  if (P->norm_owned.sumsq.built) build_blocks(o, P->norm_owned, ZOPT_RANGE_OWNED);
  if (P->norm_all.sumsq.built) build_blocks(o, P->norm_all, ZOPT_RANGE_ALL);
}

void repartition(zopt_optimizer *o) {
  Program *P = o->prog;
  if (!P) return;
  for (Work *w : {&P->update_owned, &P->update_all, &P->norm_owned.sumsq, &P->norm_all.sumsq})
    if (w->built) partition(*w, o->num_threads);
}

void destroy(zopt_optimizer *o) {
  if (!o->prog) return;
  free_buffers(o);
  delete o->prog;
  o->prog = nullptr;
}

// ---- run --------------------------------------------------------------------

// The step driver, the same for every backend (backend/backend.h): the
// ops before the update, from the backend's begin_step through the NORM
// op's sum of every rank's partials (or, without a norm, up to the
// UPDATE), leaving S and the sum of squares in `st` (validate puts NORM
// before any UPDATE; the zprog verifier FINISH last).
zopt_status run_begin(zopt_optimizer *o, StepState *st, bool first) {
  const zopt_step_descriptor *d = o->d;
  *st = StepState();
  st->S = loss_scale(o);
  Backend *B = o->backend;
  if (zopt_status s = B->begin_step(o, st, first)) return s;
  for (size_t i = 0; i < d->num_program; ++i) {
    const uint32_t code = d->program[i].code;
    if (code == ZOPT_OP_UPDATE || code == ZOPT_OP_FINISH) break;  // no norm: up to the update
    st->pc = i + 1;
    if (zopt_status s = B->run_op(o, st, i)) return s;
    if (code == ZOPT_OP_NORM) break;
  }
  return ZOPT_OK;
}

// The rest of the program, deciding with the sum of squares `sumsq` (the
// step's own, or several optimizers' in zopt_optimizer_step_linked). The
// UPDATE and the ops flagged UNLESS_SKIPPED do not run on a skipped step.
zopt_status run_end(zopt_optimizer *o, StepState *st, double sumsq, zopt_step_result *result) {
  const zopt_step_descriptor *d = o->d;
  Backend *B = o->backend;
  B->decide(o, st, sumsq);
  for (size_t i = st->pc; i < d->num_program; ++i) {
    const zopt_program_op &op = d->program[i];
    if (st->skipped && (op.code == ZOPT_OP_UPDATE || (op.flags & ZOPT_OPF_UNLESS_SKIPPED))) continue;
    if (zopt_status s = B->run_op(o, st, i)) return s;
  }
  B->end_step(o, st, result);
  return ZOPT_OK;
}

zopt_status run(zopt_optimizer *o, zopt_step_result *result) {
  StepState st;
  if (zopt_status s = run_begin(o, &st)) return s;
  return run_end(o, &st, st.sumsq, result);
}

// ---- the host executor's step (backend/cpu) ------------------------------

zopt_status host_begin(zopt_optimizer *o, StepState *st, bool first) {
  (void)st;
  Program &P = *o->prog;
  if (P.rebind_pending) {
    try {
      rebind(o);
    } catch (...) {
      return fail(ZOPT_ERR_OUT_OF_MEMORY, "zopt_optimizer_step: out of memory rebuilding the work lists");
    }
    P.rebind_pending = false;
  }
  if (o->stream_grads) {
    // Every bucket reduced since the last step (zopt_optimizer_reduce_bucket),
    // checked before any collective of the step.
    for (size_t b = 0; b < P.bucket_reduced.size(); ++b)
      if (!P.bucket_reduced[b]) {
        std::vector<int> ts;
        bucket_tensors(o, (int)b, &ts);
        return fail(ZOPT_ERR_BAD_STATE,
                    "zopt_optimizer_step: gradient bucket %zu of %zu (tensors %s) was not reduced "
                    "(zopt_optimizer_reduce_bucket) since the last step",
                    b, P.bucket_reduced.size(), tensor_list(ts).c_str());
      }
  }
  using clock = std::chrono::steady_clock;
  auto t0 = clock::now();
  if (zopt_status s = agree(o, first)) return s;
  P.agree_seconds = std::chrono::duration<double>(clock::now() - t0).count();
  P.op_seconds.assign(P.ops.size(), 0.0);
  return ZOPT_OK;
}

void host_decide(zopt_optimizer *o, StepState *st, double sumsq) {
  // The step's CONTROL decides (validate: a NORM op exactly when the step
  // has a SUMSQ kernel, so without one sumsq is not read).
  st->ctl = decide(o, st->has_norm ? sumsq : 0.0);
  st->norm = st->ctl.norm;
  st->skipped = st->ctl.skip != 0;
  st->clip = st->ctl.clip_coef;
  if (!st->skipped && (o->d->flags & ZOPT_FLAG_CLIP)) prepare_rows(o, false, st->clip, st->S);
}

void host_end(zopt_optimizer *o, StepState *st, zopt_step_result *result) {
  Program &P = *o->prog;
  if (o->stream_grads) {  // the next step needs every bucket again
    std::fill(P.bucket_reduced.begin(), P.bucket_reduced.end(), 0);
    std::fill(P.bucket_queued.begin(), P.bucket_queued.end(), 0);
    std::fill(P.stream_given.begin(), P.stream_given.end(), 0);
  }
  if (result) {
    result->grad_norm = st->norm;
    result->skipped = st->skipped ? 1 : 0;
    result->loss_scale = st->S;
  }
}

// ---- gradient streaming ------------------------------------------------

void bucket_tensors(const zopt_optimizer *o, int b, std::vector<int> *out) {
  const Program &P = *o->prog;
  const layout::Bucket &k = P.L.buckets[b];
  out->clear();
  for (const Piece &p : P.L.pieces(k.group, k.begin, k.begin + k.len))
    if (out->empty() || out->back() != p.tensor) out->push_back(p.tensor);
}

// The checks of a reduce_bucket call; on success `src` holds each tensor's
// gradient (NULL: none on this rank) and the tensors are marked given.
static zopt_status reduce_accept(zopt_optimizer *o, int b, const void *const *grads, int count, const char *fn,
                                 std::vector<const void *> *src) {
  Program &P = *o->prog;
  if (b < 0 || b >= (int)P.L.buckets.size())
    return fail(ZOPT_ERR_INVALID_ARGUMENT, "%s: bucket %d out of range (have %zu)", fn, b, P.L.buckets.size());
  std::vector<int> ts;
  bucket_tensors(o, b, &ts);
  if (count != (int)ts.size() || (count && !grads))
    return fail(ZOPT_ERR_INVALID_ARGUMENT, "%s: bucket %d holds %zu tensors (%s); got %d gradient pointers", fn, b,
                ts.size(), tensor_list(ts).c_str(), grads ? count : 0);
  // bucket_queued first: a queued bucket's bucket_reduced belongs to the
  // background thread until the pipeline drains.
  if (P.bucket_queued[b] || P.bucket_reduced[b])
    return fail(ZOPT_ERR_BAD_STATE, "%s: bucket %d was already %s since the last step", fn, b,
                P.bucket_queued[b] ? "handed over (zopt_optimizer_reduce_bucket_async)" : "reduced");
  // A tensor spanning buckets has a gradient in all of them or in none.
  for (int i = 0; i < count; ++i) {
    uint8_t g = grads[i] ? 1 : 2, was = P.stream_given[ts[i]];
    if (was && was != g)
      return fail(ZOPT_ERR_INVALID_ARGUMENT,
                  "%s: tensor %d %s a gradient for bucket %d but %s for an earlier bucket it spans", fn, ts[i],
                  g == 1 ? "has" : "has no", b, was == 1 ? "had one" : "had none");
  }
  src->assign(o->tensors.size(), nullptr);
  for (int i = 0; i < count; ++i) (*src)[ts[i]] = grads[i];
  for (int i = 0; i < count; ++i) P.stream_given[ts[i]] = grads[i] ? 1 : 2;
  return ZOPT_OK;
}

// The reduction of bucket b from `src` (per tensor, NULL: none): pack,
// exchange, fold into the held shard. Uses the program's scratch and the
// thread pool; a collective.
static zopt_status reduce_run(zopt_optimizer *o, int b, const std::vector<const void *> &src) {
  Program &P = *o->prog;
  const int W = o->world;
  const int gi = state_index(o->d, ZOPT_STATE_GRAD);
  const uint32_t dt = o->d->states[gi].dtype;
  const size_t es = dtype_size(dt);
  const layout::Bucket &k = P.L.buckets[b];
  auto grad_of = [&](const Piece &p) -> const char * {
    return src[p.tensor] ? (const char *)src[p.tensor] + (size_t)p.start * es : nullptr;
  };
  if (W == 1) {  // the sum of one rank's gradient is itself: packed into the shard
    pack_range(P, b, k.begin, k.begin + k.shard, es, (char *)P.buf[gi] + (size_t)k.local_offset * es, grad_of);
    return ZOPT_OK;
  }
  // Pack every rank's shard of the bucket (zero where no tensor, or a
  // tensor without a gradient on this rank, is), as reduce_scatter does.
  char *send = (char *)P.send.data();
  for (int q = 0; q < W; ++q) {
    int64_t a = k.begin + (int64_t)q * k.shard;
    pack_range(P, b, a, a + k.shard, es, send + (size_t)q * k.shard * es, grad_of);
  }
  char w[96];
  // Nothing folded yet: a mismatch here leaves the bucket to hand over again.
  if (zopt_status st = comm_all_to_all(o->comm, send, P.recv.data(), (size_t)k.shard * es,
                                       what(w, sizeof w, "REDUCE_BUCKET", o, gi, b), kSigUnchanged))
    return st;
  const char *recv = (const char *)P.recv.data();
  // The rank-order f32 sum of the W pieces of this rank's shard, into the
  // held shard (contiguous: the padding folds zeros into zeros).
  char *dst = (char *)P.buf[gi] + (size_t)(k.local_offset) * es;
  parallel(o->pool, [&](int tid) {
    const int T = o->pool->size();
    const int64_t lo = k.shard * tid / T, hi = k.shard * (tid + 1) / T;
    if (lo >= hi) return;
    const char *srcs[4096];
    for (int q = 0; q < W; ++q) srcs[q] = recv + ((size_t)q * k.shard + lo) * es;
    fold(dt, W, srcs, dst + (size_t)lo * es, hi - lo);
  });
  return ZOPT_OK;
}

zopt_status reduce_bucket(zopt_optimizer *o, int b, const void *const *grads, int count) {
  std::vector<const void *> src;
  if (zopt_status st = reduce_accept(o, b, grads, count, "zopt_optimizer_reduce_bucket", &src)) return st;
  if (zopt_status st = reduce_run(o, b, src)) return st;
  o->prog->bucket_reduced[b] = 1;
  return ZOPT_OK;
}

zopt_status reduce_bucket_async(zopt_optimizer *o, int b, const void *const *grads, int count) {
  Program &P = *o->prog;
  std::vector<const void *> src;
  if (zopt_status st = reduce_accept(o, b, grads, count, "zopt_optimizer_reduce_bucket_async", &src)) return st;
  try {
    if (!o->pipe) o->pipe = new pipeline::Pipeline();
    char w[64];
    snprintf(w, sizeof w, "gradient bucket %d", b);
    P.bucket_ticket[b] = o->pipe->submit(
        w, [o, b, src = std::move(src)] { return reduce_run(o, b, src); },
        [o, b](bool ok) {
          if (ok) o->prog->bucket_reduced[b] = 1;
        });
  } catch (...) {  // nothing queued: b may be handed over again
    return fail(ZOPT_ERR_OUT_OF_MEMORY, "zopt_optimizer_reduce_bucket_async: out of memory queueing bucket %d", b);
  }
  P.bucket_queued[b] = 1;
  return ZOPT_OK;
}

bool bucket_finished(const zopt_optimizer *o, int b) {
  const Program &P = *o->prog;
  if (!P.bucket_queued[b]) return P.bucket_reduced[b] != 0;
  return o->pipe && P.bucket_ticket[b] <= o->pipe->completed();
}

zopt_status wait_buckets(zopt_optimizer *o) {
  if (!o->pipe) return ZOPT_OK;
  zopt_status st = o->pipe->drain();
  if (o->prog) {  // a failed or skipped bucket can be handed over again
    Program &P = *o->prog;
    for (size_t b = 0; b < P.bucket_queued.size(); ++b) P.bucket_queued[b] = 0;
  }
  return st;
}

// ---- gathers and accounting ---------------------------------------------

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
        memcpy(dst_of(t), state_ptr(o, t, si), (size_t)o->tensors[t].numel * es);
    return ZOPT_OK;
  }
  // Sharded: the buckets holding any element of the tensors, in order; each
  // rank's shard of the held buffer is sent as it is (its padding is zero).
  std::vector<int> buckets;
  for (int t = first; t < first + count; ++t) {
    const layout::Segment &sg = P.L.tensors[t];
    if (!sg.numel) continue;
    for (int b = sg.bucket; b < (int)P.L.buckets.size(); ++b) {
      const layout::Bucket &k = P.L.buckets[b];
      if (k.group != sg.group || k.begin >= sg.flat + sg.numel) break;
      buckets.push_back(b);
    }
  }
  std::sort(buckets.begin(), buckets.end());
  buckets.erase(std::unique(buckets.begin(), buckets.end()), buckets.end());
  // The scratch holds one bucket of the collectives' dtype: a wider state
  // (an f32 master of bf16 params) goes in pieces of `cap` elements per rank.
  const int W = o->world;
  const size_t cap = P.recv.size() / (es * (size_t)W);
  if (cap == 0) return fail(ZOPT_ERR_INTERNAL, "gather_state: no collective scratch");
  for (int b : buckets) {
    const layout::Bucket &k = P.L.buckets[b];
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
        for (const Piece &p : P.L.pieces(k.group, fa, std::min(fa + c, k.begin + k.len))) {
          if (p.tensor < first || p.tensor >= first + count) continue;
          memcpy(dst_of(p.tensor) + (size_t)p.start * es, recv + (size_t)(p.flat - fa) * es, (size_t)p.len * es);
        }
      }
      off += c;
    }
  }
  return ZOPT_OK;
}

void state_bytes(const zopt_optimizer *o, uint64_t *mine, uint64_t *one_rank, uint64_t *scratch, uint64_t *grads) {
  *mine = *one_rank = *scratch = *grads = 0;
  const Program *P = o->prog;
  if (!P) return;
  for (uint32_t s = 0; s < o->d->num_states; ++s) {
    if (!P->buf[s] || P->pinned[s]) continue;
    if (o->d->states[s].kind == ZOPT_STATE_GRAD) {  // streamed gradient shards
      *grads += P->buf_bytes[s];
      continue;
    }
    *mine += P->buf_bytes[s];
    *one_rank += ((uint64_t)P->L1.local_elems * dtype_size(o->d->states[s].dtype) + 63) & ~(uint64_t)63;
  }
  *scratch = P->send.size() + P->recv.size() + P->gathered.size() * sizeof(double);
}

}  // namespace exec
}  // namespace zopt
