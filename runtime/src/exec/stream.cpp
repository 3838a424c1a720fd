// exec/stream.cpp - gradient streaming (docs/DISTRIBUTED.md): the caller
// hands a bucket's gradients over during backward and the runtime reduces
// them into this rank's held gradient shard, at once (reduce_bucket) or on
// the optimizer's pipeline thread (reduce_bucket_async, pipeline/).
#include "exec/exec_internal.h"

#include "comm/comm_internal.h"
#include "exec/speculate.h"
#include "pipeline/pipeline.h"

#include <cstdio>
#include <cstring>

namespace zopt {
namespace exec {

using layout::Piece;

// "3, 4, 7" (at most 8, then "... (N in all)").
std::string tensor_list(const std::vector<int> &ts) {
  std::string s;
  for (size_t i = 0; i < ts.size() && i < 8; ++i) s += (i ? ", " : "") + std::to_string(ts[i]);
  if (ts.size() > 8) s += ", ... (" + std::to_string(ts.size()) + " in all)";
  return s.empty() ? "none" : s;
}

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
    // A failed offload bucket job: the pipelined step is void (its buckets
    // are marked again, or the step runs serially).
    if (st && P.spec) spec_close(o);
  }
  return st;
}
}  // namespace exec
}  // namespace zopt
