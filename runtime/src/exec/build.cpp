// exec/build.cpp - the program at finalize (exec.h build): validated
// against the step and the backend, laid out (layout/), its runtime-held
// buffers allocated and initialized, the work lists and norm blocks of its
// ops; and what the built program answers: a state's runs on this rank,
// its bytes. Rebinding and repartitioning the work, destroying it.
#include "exec/exec_internal.h"

#include "backend/backend.h"
#include "exec/speculate.h"

#include <sys/mman.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <new>

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

// The address of the element at flat offset `flat` of bucket b (tensor t,
// element `start`) in state si, on this rank. For a sharded buffer the
// element must lie in this rank's shard. A PER_BLOCK state: the element's
// block (`flat` is a block boundary: a chunk's first element).
void *addr(const zopt_optimizer *o, int si, int b, int t, int64_t start, int64_t flat) {
  const Program &P = *o->prog;
  if (P.buf[si] && P.sharded[si]) {
    int64_t i = P.L.local_index(b, o->rank, flat);
    if (is_per_block(o->d, si)) i /= ZOPT_Q8_BLOCK;
    return (char *)P.buf[si] + (size_t)i * es_of(o, si);
  }
  return view(o, si, t, start);
}

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
  w.joined_gen = 0;  // UPDATE's joined calls follow (coalesce.cpp)
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

// w.tensor_first / w.of_tensor: each tensor's chunks, in chunk order.
void index_by_tensor(const zopt_optimizer *o, Work &w) {
  const size_t T = o->tensors.size();
  w.tensor_first.assign(T + 2, 0);
  for (const Chunk &c : w.chunks) ++w.tensor_first[(size_t)c.tensor + 2];
  for (size_t t = 2; t < T + 2; ++t) w.tensor_first[t] += w.tensor_first[t - 1];
  w.of_tensor.resize(w.chunks.size());
  for (size_t i = 0; i < w.chunks.size(); ++i) w.of_tensor[w.tensor_first[(size_t)w.chunks[i].tensor + 1]++] = (uint32_t)i;
  w.tensor_first.pop_back();  // [t] = first of t, [T] = the end
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
  index_by_tensor(o, w);
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
  index_by_tensor(o, B.sumsq);
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
  const Layout &L = P.layout_of(o->d, si, sh);
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

}  // namespace

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
    if (sd.flags & ZOPT_STATE_PER_BLOCK) continue;  // a q8 absmax: 4/256 bytes per element
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
  P->coalesce = coalesce_enabled();
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
    // q8 moments: every segment (and so every bucket, shard and norm block)
    // at a multiple of the q8 block of the flat space (layout.h "per block").
    in.align = has_q8(d) ? std::max<int64_t>(d->align, ZOPT_Q8_BLOCK) : d->align;
    int64_t elems = 0;
    for (int64_t n : in.numel) elems += n;
    in.block = layout::block_for(elems, in.align);  // the same at every W
    const size_t es_c = collective_es(o);
    in.bucket = o->bucket_elems > 0 ? o->bucket_elems : default_bucket(o, elems, in.block, es_c);
    in.world = o->world;
    P->L = layout::make_layout(in);
    in.world = 1;
    P->L1 = layout::make_layout(in);
    if (has_q8(d)) {
      P->Lb = layout::per_block(P->L, ZOPT_Q8_BLOCK);
      P->L1b = layout::per_block(P->L1, ZOPT_Q8_BLOCK);
    }
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
      const int64_t elems = P->layout_of(d, (int)s, P->sharded[s]).local_elems;
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
    P->grads_moved.reserve(o->tensors.size());
  } catch (...) {
    return bail(fail(ZOPT_ERR_OUT_OF_MEMORY, "zopt_optimizer_finalize: out of memory"));
  }
  // Staged params: from the device first (the master is made from them).
  if (o->backend->stages())
    if (zopt_status st = o->backend->copy_staged(o, o->step->param_index, false, true)) return bail(st);
  // Initialize the held states, each chunk by the thread that updates it
  // (first touch): ZeRO-3 params and masters from the user's params,
  // moments zero (q8: the zero code, absmax 0); then the gaps and padding
  // zero.
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
          memset(c.ptrs[s], zero_byte(d, (int)s), (size_t)state_numel(d, (int)s, c.len) * dtype_size(sd.dtype));
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
    out->push_back(Run{0, state_numel(o->d, si, x.numel), state_ptr(o, t, si)});
    return;
  }
  const Program &P = *o->prog;
  std::vector<OwnedRange> rs;
  owned_ranges(o, t, &rs);
  const bool pb = is_per_block(o->d, si);
  for (const OwnedRange &r : rs) {
    char *p = (char *)P.buf[si] +
              (size_t)(P.L.local_index(r.bucket, o->rank, r.flat) / (pb ? ZOPT_Q8_BLOCK : 1)) * es_of(o, si);
    if (!pb) {
      out->push_back(Run{r.start, r.len, p});
      continue;
    }
    // Blocks: a range starts at a block boundary (layout.h "per block").
    const int64_t b0 = r.start / ZOPT_Q8_BLOCK, b1 = state_numel(o->d, si, r.start + r.len);
    out->push_back(Run{b0, b1 - b0, p});
  }
}

void owned_ranges(const zopt_optimizer *o, int t, std::vector<OwnedRange> *out) {
  out->clear();
  const Program &P = *o->prog;
  const layout::Segment &seg = P.L.tensors[t];
  for (int b = seg.bucket; b < (int)P.L.buckets.size(); ++b) {
    const layout::Bucket &k = P.L.buckets[b];
    if (k.group != seg.group || k.begin >= seg.flat + seg.numel) break;
    int64_t a, e;
    P.L.shard_range(b, o->rank, &a, &e);
    a = std::max(a, seg.flat);
    e = std::min(e, seg.flat + seg.numel);
    if (a < e) out->push_back(OwnedRange{b, a - seg.flat, e - a, a});
  }
}

// The gradient pointers of the work units of the tensors whose gradients
// moved (all of them when Program::grads_moved_all), as make_chunk
// computes them, for a program whose only change since its lists were
// built is where tensors' gradients are (the lists' shape does not depend
// on it). UPDATE's joined calls are made again only where they could
// change: when some were joined, or a moved chunk now joins a neighbour.
void patch_grads(zopt_optimizer *o) {
  Program &P = *o->prog;
  const int gi = o->step->grad_index;
  const bool all = P.grads_moved_all;
  P.grads_moved_all = false;
  if (P.buf[gi] && P.sharded[gi]) {  // runtime-held shards: nothing moved
    P.grads_moved.clear();
    return;
  }
  // Each list patched per moved tensor where it is indexed by tensor (its
  // chunks of the tensor), else every chunk.
  Work *ws[4] = {&P.update_owned, &P.update_all, &P.norm_owned.sumsq, &P.norm_all.sumsq};
  bool by_tensor[4] = {};
  for (int i = 0; i < 4; ++i) {
    Work &w = *ws[i];
    if (!w.built) continue;
    by_tensor[i] = !all && w.tensor_first.size() == o->tensors.size() + 1;
    if (by_tensor[i]) continue;
    for (Chunk &c : w.chunks) c.ptrs[gi] = view(o, gi, c.tensor, c.start);
    w.joined_gen = 0;  // the joins follow the pointers (coalesce.cpp)
  }
  const bool pb = is_per_block(o->d, gi);
  const size_t es = es_of(o, gi);
  for (int32_t t : P.grads_moved) {
    char *base = nullptr;  // view()'s, once per tensor
    for (int i = 0; i < 4; ++i) {
      if (!by_tensor[i]) continue;
      Work &w = *ws[i];
      for (uint32_t k = w.tensor_first[t]; k < w.tensor_first[t + 1]; ++k) {
        if (!base) base = (char *)state_ptr(o, t, gi);
        Chunk &c = w.chunks[w.of_tensor[k]];
        c.ptrs[gi] = base + (size_t)(pb ? c.start / ZOPT_Q8_BLOCK : c.start) * es;
      }
    }
  }
  // UPDATE's joined calls hold the old pointers: made again where some
  // were joined, or where a moved chunk now joins a neighbour.
  for (int i = 0; i < 2; ++i) {
    Work &w = *ws[i];
    if (!by_tensor[i] || !P.coalesce || w.joined_gen == 0) continue;
    bool rejoin = w.joins;
    for (size_t m = 0; !rejoin && m < P.grads_moved.size(); ++m) {
      const int32_t t = P.grads_moved[m];
      for (uint32_t k = w.tensor_first[t]; !rejoin && k < w.tensor_first[t + 1]; ++k)
        rejoin = joins_a_neighbour(o, w, w.of_tensor[k]);
    }
    if (rejoin) w.joined_gen = 0;
  }
  P.grads_moved.clear();
}

void note_grads_moved(zopt_optimizer *o, const int32_t *tensors, int64_t n) {
  Program &P = *o->prog;
  if (P.grads_moved_all) return;
  if (P.grads_moved.size() + (size_t)n > P.grads_moved.capacity()) {
    P.grads_moved_all = true;
    P.grads_moved.clear();
    return;
  }
  P.grads_moved.insert(P.grads_moved.end(), tensors, tensors + n);
}

void rebind(zopt_optimizer *o) {
  Program *P = o->prog;
  if (!P) return;
  if (P->rebind_grads_only) {
    P->rebind_grads_only = false;
    patch_grads(o);
    return;
  }
  P->grads_moved.clear();
  P->grads_moved_all = false;
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
  spec_free(o);
  free_buffers(o);
  delete o->prog;
  o->prog = nullptr;
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
    *one_rank += ((uint64_t)P->layout_of(o->d, (int)s, false).local_elems * dtype_size(o->d->states[s].dtype) + 63) &
                 ~(uint64_t)63;
  }
  *scratch = P->send.size() + P->recv.size() + P->gathered.size() * sizeof(double);
}
}  // namespace exec
}  // namespace zopt
