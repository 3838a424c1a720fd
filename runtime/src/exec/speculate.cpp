// exec/speculate.cpp - a pipelined offloaded step's host side (speculate.h):
// per bucket its norm partials and speculative update (out of place, into
// the speculation arena), and at the step the commit or recompute of each
// bucket by comparing coefficient rows bit for bit.
#include "exec/speculate.h"

#include "exec/exec_internal.h"

#include <sys/mman.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <new>

namespace zopt {
namespace exec {

namespace {

Spec &spec_of(zopt_optimizer *o) {
  Program &P = *o->prog;
  if (!P.spec) {
    P.spec = new Spec();  // may throw std::bad_alloc
  }
  return *P.spec;
}

Work &update_work(Program &P) { return P.update_range == ZOPT_RANGE_OWNED ? P.update_owned : P.update_all; }
Blocks &norm_blocks(Program &P) { return P.norm_range == ZOPT_RANGE_OWNED ? P.norm_owned : P.norm_all; }

// f(i) for i in [a, e), split evenly over the pool's threads.
template <class F>
void par_range(zopt_optimizer *o, size_t a, size_t e, F f) {
  if (a >= e) return;
  parallel(o->pool, [&](int tid) {
    const size_t T = (size_t)o->pool->size(), n = e - a;
    for (size_t i = a + n * tid / T; i < a + n * (tid + 1) / T; ++i) f(i);
  });
}

// UPDATE of one chunk from c.ptrs into `out` (c.ptrs: in place).
void update_chunk(zopt_optimizer *o, const Chunk &c, void *const *out) {
  const Program &P = *o->prog;
  const float *co = coeffs_of(P, c.tensor);
  if (o->d->flags & ZOPT_FLAG_STOCHASTIC) {
    // The key of exec.cpp run_update: (seed, step being taken, tensor,
    // high half of the chunk's first index); the bits depend on the
    // element, not on the chunking.
    const std::vector<int64_t> &ts = P.spec->tail_steps;
    uint64_t t = (uint64_t)(ts.empty() ? o->tensors[c.tensor].steps : ts[(size_t)c.tensor]) + 1;
    uint32_t key = zopt_sr_key(o->seed, t, (uint32_t)c.tensor, (uint32_t)((uint64_t)c.start >> 32));
    ((zopt_update_sr_fn)(void *)o->step->update)(c.ptrs, out, c.len, co, key, (uint32_t)c.start);
  } else {
    o->step->update(c.ptrs, out, c.len, co);
  }
}

// The bytes of state s over chunk c (a PER_BLOCK state, a q8 absmax: one
// element per ZOPT_Q8_BLOCK of the chunk's, the last block partial).
size_t chunk_bytes(const zopt_optimizer *o, const Chunk &c, uint32_t s) {
  return (size_t)state_numel(o->d, (int)s, c.len) * es_of(o, (int)s);
}

// The speculation buffer of state s for chunk c of bucket b. The arena
// holds per bucket and state its elements over the rank's flat range (a
// PER_BLOCK state: its blocks; the range and every chunk start on q8 block
// boundaries, the layout is block-aligned).
char *spec_ptr(const zopt_optimizer *o, const Spec &S, int b, const Chunk &c, uint32_t s) {
  const Program &P = *o->prog;
  if (S.mirror) return S.shadow[s] + ((char *)c.ptrs[s] - (char *)P.buf[s]);
  const size_t so = S.state_off[(size_t)b * o->d->num_states + s];
  const int64_t flat = P.L.tensors[c.tensor].flat + c.start;
  int64_t i = flat - S.first_flat[b];
  if (is_per_block(o->d, (int)s)) i /= ZOPT_Q8_BLOCK;
  return S.arena + S.off[b] + so + (size_t)i * es_of(o, (int)s);
}

}  // namespace

void spec_build(zopt_optimizer *o) {
  Program &P = *o->prog;
  Spec &S = spec_of(o);
  if (S.built) return;
  const size_t nb = P.L.buckets.size(), NS = o->d->num_states;
  const Work &w = update_work(P);
  S.upd_first.assign(nb + 1, w.chunks.size());
  size_t i = 0;
  for (size_t b = 0; b < nb; ++b) {
    S.upd_first[b] = i;
    while (i < w.chunks.size()) {
      const Chunk &c = w.chunks[i];
      const int cb = P.L.bucket_of(c.group, P.L.tensors[c.tensor].flat + c.start);
      if (cb != (int)b) break;
      ++i;
    }
  }
  S.blk_first.assign(nb + 1, 0);
  if (P.norm_range == ZOPT_RANGE_OWNED) {
    size_t k = 0;
    for (size_t b = 0; b < nb; ++b) {
      S.blk_first[b] = k;
      k += (size_t)(P.L.buckets[b].shard / P.L.block);
    }
    S.blk_first[nb] = k;
  } else if (P.norm_range) {
    // ALL: the blocks of the 1-rank layout (build.cpp build_blocks), in
    // their order; each lies in one bucket of this layout (bucket and
    // block boundaries are multiples of the block), the buckets' blocks
    // consecutive.
    size_t k = 0, b = 0;
    for (const layout::Bucket &k1 : P.L1.buckets)
      for (int64_t j = 0; j < k1.shard / P.L1.block; ++j, ++k) {
        const size_t at = (size_t)P.L.bucket_of(k1.group, k1.begin + j * P.L1.block);
        while (b < at) S.blk_first[++b] = k;
      }
    while (b < nb) S.blk_first[++b] = k;
  }
  S.cost.assign(nb, 0);
  S.first_flat.assign(nb, 0);
  S.state_off.assign(nb * NS, SIZE_MAX);
  for (size_t b = 0; b < nb; ++b) {
    // The flat range this rank updates (its shard; the bucket at 1 rank
    // or where the program updates ALL).
    int64_t a = 0, e = 0;
    if (P.update_range == ZOPT_RANGE_OWNED) {
      P.L.shard_range((int)b, o->rank, &a, &e);
    } else {
      a = P.L.buckets[b].begin;
      e = a + P.L.buckets[b].len;
    }
    S.first_flat[b] = a;
    const uint64_t elems = e > a ? (uint64_t)(e - a) : 0;
    uint64_t off = 0;
    for (uint32_t s = 0; s < NS; ++s) {
      if (!(o->d->states[s].access & ZOPT_ACCESS_WRITE)) continue;
      S.state_off[b * NS + s] = (size_t)off;
      off += ((uint64_t)state_numel(o->d, (int)s, (int64_t)elems) * es_of(o, (int)s) + 63) & ~(uint64_t)63;
    }
    S.cost[b] = off;
  }
  S.built = true;
}

zopt_status spec_set_budget(zopt_optimizer *o, uint64_t bytes, const char *fn) {
  try {
    spec_build(o);
  } catch (...) {
    return fail(ZOPT_ERR_OUT_OF_MEMORY, "%s: out of memory", fn);
  }
  Spec &S = *o->prog->spec;
  uint64_t largest = 0;
  size_t which = 0;
  for (size_t b = 0; b < S.cost.size(); ++b)
    if (S.cost[b] > largest) largest = S.cost[b], which = b;
  if (bytes != 0 && bytes < largest)
    return fail(ZOPT_ERR_INVALID_ARGUMENT,
                "%s: a budget of %llu bytes is smaller than one bucket's speculation buffers (bucket %zu needs %llu "
                "bytes: every state the update writes, over the bucket); give at least that, or 0 for no speculation",
                fn, (unsigned long long)bytes, which, (unsigned long long)largest);
  S.budget = bytes;
  if (S.arena_bytes > bytes) {  // the memory back; the next step allocates what the budget allows
    free(S.arena);
    S.arena = nullptr;
    S.arena_bytes = 0;
  }
  uint64_t total = 0;
  for (uint64_t c : S.cost) total += c;
  if (bytes < total) {
    for (char *&p : S.shadow) {
      free(p);
      p = nullptr;
    }
    S.mirror = false;
  }
  return ZOPT_OK;
}

zopt_status spec_open(zopt_optimizer *o, double scale, const char *fn) {
  Program &P = *o->prog;
  try {
    if (P.rebind_pending) {
      rebind(o);
      P.rebind_pending = false;
    }
    spec_build(o);
    Spec &S = *P.spec;
    uint64_t total = 0;
    for (uint64_t c : S.cost) total += c;
    // Every bucket fits: shadows of the written states' buffers (each
    // written state has one: runtime-held, whole or this rank's shards, or
    // the param's staging), mirrored element for element.
    const uint32_t NS = o->d->num_states;
    bool mirror = S.budget >= total;
    for (uint32_t s = 0; s < NS && mirror; ++s)
      if (o->d->states[s].access & ZOPT_ACCESS_WRITE) mirror = P.buf[s] != nullptr;
    S.shadow.resize(NS, nullptr);
    for (uint32_t s = 0; s < NS && mirror; ++s) {
      if (!(o->d->states[s].access & ZOPT_ACCESS_WRITE) || S.shadow[s]) continue;
      const size_t huge = size_t(2) << 20, bytes = P.buf_bytes[s];
      void *p = nullptr;
      if (posix_memalign(&p, bytes >= 2 * huge ? huge : 64, std::max<size_t>(bytes, 64)) != 0 || !p)
        return fail(ZOPT_ERR_OUT_OF_MEMORY, "%s: cannot allocate %zu bytes of speculation buffers", fn, bytes);
      if (bytes >= 2 * huge) madvise(p, bytes, MADV_HUGEPAGE);  // advice only
      memset(p, 0, bytes);  // the gaps and padding stay zero (a swapped-in buffer's too)
      S.shadow[s] = (char *)p;
    }
    S.mirror = mirror;
    S.swapped = false;
    const size_t want = mirror ? 0 : (size_t)std::min(S.budget, total);
    if (mirror && S.arena) {
      free(S.arena);
      S.arena = nullptr;
      S.arena_bytes = 0;
    }
    if (S.arena_bytes < want) {
      free(S.arena);
      S.arena = nullptr;
      S.arena_bytes = 0;
      void *p = nullptr;
      if (posix_memalign(&p, 64, want) != 0 || !p)
        return fail(ZOPT_ERR_OUT_OF_MEMORY, "%s: cannot allocate %zu bytes of speculation buffers", fn, want);
      S.arena = (char *)p;
      S.arena_bytes = want;
    }
    const size_t nb = P.L.buckets.size();
    // The ranks' agreement (the gradient mask every bucket's reduction and
    // update use) and the step's PREPARE rows (clip coefficient 1, nothing
    // skipped), as host_begin and the PREPARE op will compute them again.
    if (zopt_status st = agree_step(o, true)) return st;
    prepare_rows(o, true, 1.0, scale);
    S.rows = P.coeffs;
    S.row_of = P.row_of_tensor;
    S.ready.assign(nb, 0);
    S.speculated.assign(nb, 0);
    S.off.assign(nb, 0);
    S.job_seconds.assign(nb, 0.0);
    S.arena_used = 0;
    S.nready = 0;
    S.committed = S.recomputed = S.late = 0;
    S.open = true;
    S.consumed = false;
  } catch (...) {
    return fail(ZOPT_ERR_OUT_OF_MEMORY, "%s: out of memory", fn);
  }
  return ZOPT_OK;
}

bool spec_reserve(zopt_optimizer *o, int b) {
  Spec &S = *o->prog->spec;
  if (S.mirror) {
    S.speculated[b] = 1;
    return true;
  }
  if (S.budget == 0 || S.arena_bytes - S.arena_used < S.cost[b]) return false;
  S.off[b] = S.arena_used;
  S.arena_used += (size_t)S.cost[b];
  S.speculated[b] = 1;
  return true;
}

zopt_status spec_gather_bucket(zopt_optimizer *o, size_t i, int b) {
  return all_gather_bucket(o, o->prog->ops[i], b);
}

zopt_status spec_bucket_work(zopt_optimizer *o, int b) {
  Program &P = *o->prog;
  Spec &S = *P.spec;
  const double t0 = now_seconds();
  // At W ranks the bucket's reduction first (a collective: every rank's
  // jobs run in the order of its marks, which must be the same), then, in
  // a ZeRO-0/1 program, the ALL_GATHER of its reduced grad. Before them the
  // step has written only its scratch (the reduced grads of earlier
  // buckets, in the grad staging, which a serial step copies again): ranks
  // that marked in different orders fail here alike (the jobs after a
  // failed one are skipped, wait_buckets closes the speculation), and the
  // communicator stays usable for the step run again.
  if (o->world > 1)
    for (const zopt_program_op &op : P.ops) {
      if (op.code == ZOPT_OP_REDUCE_SCATTER)
        if (zopt_status st = reduce_scatter_bucket(o, op, b, true)) return st;
      if (op.code == ZOPT_OP_ALL_GATHER && o->d->states[op.state].kind == ZOPT_STATE_GRAD)
        if (zopt_status st = all_gather_bucket(o, op, b, true)) return st;
    }
  if (P.norm_range) {
    // exec.cpp run_sumsq for this bucket's blocks: each chunk's partial,
    // then each block's in-order sum (the same bits, in the same slots).
    Blocks &B = norm_blocks(P);
    zopt_sumsq_fn f = o->step->sumsq;
    const size_t k0 = S.blk_first[b], k1 = S.blk_first[b + 1];
    par_range(o, B.first[k0], B.first[k1], [&](size_t i) {
      const Chunk &c = B.sumsq.chunks[i];
      B.chunk_partials[i] = active(P, c.tensor) ? f(c.ptrs, c.len, coeffs_of(P, c.tensor)) : 0.0;
    });
    for (size_t k = k0; k < k1; ++k) {
      double s = 0;
      for (size_t i = B.first[k]; i < B.first[k + 1]; ++i) s += B.chunk_partials[i];
      B.partials[k] = s;
    }
  }
  if (S.speculated[b]) {
    Work &w = update_work(P);
    const uint32_t NS = o->d->num_states;
    par_range(o, S.upd_first[b], S.upd_first[b + 1], [&](size_t i) {
      const Chunk &c = w.chunks[i];
      if (!active(P, c.tensor)) return;
      void *out[ZOPT_MAX_STATES];
      for (uint32_t s = 0; s < ZOPT_MAX_STATES; ++s)
        out[s] = s < NS && S.state_off[(size_t)b * NS + s] != SIZE_MAX ? spec_ptr(o, S, b, c, s) : c.ptrs[s];
      update_chunk(o, c, out);
    });
  }
  S.job_seconds[b] = now_seconds() - t0;
  return ZOPT_OK;
}

bool spec_rows_same(const zopt_optimizer *o) {
  const Program &P = *o->prog;
  const Spec &S = *P.spec;
  return P.coeffs.size() == S.rows.size() && P.row_of_tensor == S.row_of &&
         memcmp(P.coeffs.data(), S.rows.data(), S.rows.size() * sizeof(float)) == 0;
}

void spec_try_swap(zopt_optimizer *o) {
  Program &P = *o->prog;
  Spec &S = *P.spec;
  if (!S.mirror || !spec_rows_same(o)) return;
  for (uint8_t a : P.global_active)  // an inactive tensor's shadow is stale
    if (!a) return;
  for (uint8_t x : S.speculated)
    if (!x) return;
  // Every bucket commits and every element was speculated: the shadows of
  // the runtime-held states are the new states (their gaps zero as well).
  const uint32_t NS = o->d->num_states;
  auto swap_all = [&] {
    for (uint32_t s = 0; s < NS; ++s)
      if (S.shadow[s] && !P.pinned[s]) {
        char *x = (char *)P.buf[s];
        P.buf[s] = S.shadow[s];
        S.shadow[s] = x;
      }
  };
  swap_all();
  try {
    rebind(o);  // the work lists' pointers: the same chunks in the same order
  } catch (...) {
    swap_all();  // the states as they were; the next step rebinds
    P.rebind_pending = true;
    throw;
  }
  S.swapped = true;
}

void spec_update_bucket(zopt_optimizer *o, int b) {
  Program &P = *o->prog;
  Spec &S = *P.spec;
  Work &w = update_work(P);
  const size_t a = S.upd_first[b], e = S.upd_first[b + 1];
  const uint32_t NS = o->d->num_states;
  if (S.swapped) {  // the staged param's speculation copied in; the rest swapped
    par_range(o, a, e, [&](size_t i) {
      const Chunk &c = w.chunks[i];
      for (uint32_t s = 0; s < NS; ++s)
        if (S.shadow[s] && P.pinned[s])
          memcpy(c.ptrs[s], spec_ptr(o, S, b, c, s), chunk_bytes(o, c, s));
    });
    ++S.committed;
    return;
  }
  // Commit only if every row the speculation used is the row the step
  // uses now, bit for bit.
  bool same = S.speculated[b] != 0;
  for (size_t i = a; i < e && same; ++i) {
    const int t = w.chunks[i].tensor;
    if (!active(P, t)) continue;
    const int r = P.row_of_tensor[t], r0 = S.row_of[t];
    same = r >= 0 && r0 >= 0 &&
           memcmp(P.coeffs.data() + (size_t)r * ZOPT_MAX_COEFFS, S.rows.data() + (size_t)r0 * ZOPT_MAX_COEFFS,
                  ZOPT_MAX_COEFFS * sizeof(float)) == 0;
  }
  if (same) {
    par_range(o, a, e, [&](size_t i) {
      const Chunk &c = w.chunks[i];
      if (!active(P, c.tensor)) return;
      for (uint32_t s = 0; s < NS; ++s)
        if (S.state_off[(size_t)b * NS + s] != SIZE_MAX)
          memcpy(c.ptrs[s], spec_ptr(o, S, b, c, s), chunk_bytes(o, c, s));
    });
    ++S.committed;
  } else {
    // The states are untouched (the speculation wrote elsewhere): the
    // serial step's update, in place, with the true rows.
    par_range(o, a, e, [&](size_t i) {
      const Chunk &c = w.chunks[i];
      if (active(P, c.tensor)) update_chunk(o, c, c.ptrs);
    });
    ++(S.speculated[b] ? S.recomputed : S.late);
  }
}

void spec_close(zopt_optimizer *o) {
  if (!o->prog || !o->prog->spec) return;
  Spec &S = *o->prog->spec;
  S.open = S.consumed = false;
  S.tail_steps.clear();
  std::fill(S.ready.begin(), S.ready.end(), 0);
  std::fill(S.speculated.begin(), S.speculated.end(), 0);
  S.nready = 0;
  S.arena_used = 0;
}

void spec_free(zopt_optimizer *o) {
  if (!o->prog || !o->prog->spec) return;
  for (char *p : o->prog->spec->shadow) free(p);
  free(o->prog->spec->arena);
  delete o->prog->spec;
  o->prog->spec = nullptr;
}

uint64_t spec_bytes(const zopt_optimizer *o) {
  const Spec *S = o->prog ? o->prog->spec : nullptr;
  if (!S) return 0;
  uint64_t n = S->arena_bytes;
  for (size_t s = 0; s < S->shadow.size(); ++s)
    if (S->shadow[s]) n += o->prog->buf_bytes[s];
  return n;
}

std::string spec_missing(const zopt_optimizer *o) {
  const Spec &S = *o->prog->spec;
  std::vector<int> bs;
  for (size_t b = 0; b < S.ready.size(); ++b)
    if (!S.ready[b]) bs.push_back((int)b);
  return tensor_list(bs);
}

bool spec_marking(const zopt_optimizer *o) { return o->prog && o->prog->spec && o->prog->spec->open; }

int64_t spec_first_marked(const zopt_optimizer *o, int64_t n, const int32_t *tensors, int *bucket) {
  const Spec &S = *o->prog->spec;
  std::vector<int> of(o->tensors.size(), -1), ts;  // per tensor: a marked bucket holding it
  for (size_t b = 0; b < S.ready.size(); ++b)
    if (S.ready[b]) {
      bucket_tensors(o, (int)b, &ts);
      for (int t : ts) of[t] = (int)b;
    }
  for (int64_t i = 0; i < n; ++i)
    if (of[tensors[i]] >= 0) {
      *bucket = of[tensors[i]];
      return i;
    }
  return -1;
}

}  // namespace exec
}  // namespace zopt
