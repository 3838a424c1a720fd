// backend/offload/params_back.cpp - an offloaded step's params back on the
// GPU, bucket by bucket in forward order on the optimizer's copy
// stream (params_back.h; docs/GPU.md "Params back early").
#include "backend/offload/params_back.h"

#include "backend/offload/pipeline.h"
#include "exec/exec.h"

using namespace zopt::cu;

namespace zopt {

namespace {

// What makes a bucket's event its bucket's: the tensors' count and every
// bucket's extent (a layout rebuilt around other tensors or another bucket
// size moves the params between buckets).
std::vector<int64_t> layout_key(const zopt_optimizer *o) {
  const layout::Layout &L = o->prog->L;
  std::vector<int64_t> k;
  k.reserve(2 + 3 * L.buckets.size());
  k.push_back((int64_t)o->tensors.size());
  k.push_back((int64_t)L.buckets.size());
  for (const layout::Bucket &b : L.buckets) {
    k.push_back(b.group);
    k.push_back(b.begin);
    k.push_back(b.len);
  }
  return k;
}

// `staging` behind every copy issued on the copy stream: the runtime's own
// later work waits for them.
zopt_status seal(GpuState *g, ParamsBack &pb) {
  pb.open = false;
  if (CUresult r = g->cu->EventRecordWithFlags(g->staging, pb.stream, 0))
    return fail(ZOPT_ERR_INTERNAL, "offload: cuEventRecord after the params' copies to the GPU: %s", error_string(r));
  g->staging_recorded = true;
  return ZOPT_OK;
}

}  // namespace

zopt_status params_back_init(GpuState *g, ParamsBack &pb) {
  if (CUresult r = g->cu->StreamCreate(&pb.stream, STREAM_NON_BLOCKING))
    return fail(ZOPT_ERR_INTERNAL, "offload: cuStreamCreate (the params' copy stream): %s", error_string(r));
  if (CUresult r = g->cu->EventCreate(&pb.before, EVENT_DISABLE_TIMING)) {
    g->cu->StreamDestroy(pb.stream);
    pb.stream = nullptr;
    return fail(ZOPT_ERR_INTERNAL, "offload: cuEventCreate: %s", error_string(r));
  }
  return ZOPT_OK;
}

zopt_status params_back_begin(GpuState *g, ParamsBack &pb, const zopt_optimizer *o) {
  const size_t nb = o->prog->L.buckets.size();
  // Events are kept (a smaller layout leaves some unused) and made as
  // needed; the extents say which are valid.
  while (pb.events.size() < nb) {
    CUevent e = nullptr;
    if (CUresult r = g->cu->EventCreate(&e, EVENT_DISABLE_TIMING))
      return fail(ZOPT_ERR_INTERNAL, "offload: cuEventCreate (a bucket's params): %s", error_string(r));
    pb.events.push_back(e);
  }
  // The copies overwrite params that the caller's work enqueued before the
  // step may still read (the rest of backward, a metric): after it.
  if (CUresult r = g->cu->EventRecordWithFlags(pb.before, g->stream, 0))
    return fail(ZOPT_ERR_INTERNAL, "offload: cuEventRecord before the params' copies: %s", error_string(r));
  if (CUresult r = g->cu->StreamWaitEvent(pb.stream, pb.before, 0))
    return fail(ZOPT_ERR_INTERNAL, "offload: cuStreamWaitEvent (the params' copy stream): %s", error_string(r));
  std::vector<int64_t> key = layout_key(o);
  if (key != pb.extent) {
    pb.extent = std::move(key);
    pb.recorded.assign(nb, 0);
  }
  pb.open = true;
  return ZOPT_OK;
}

zopt_status params_back_bucket(GpuState *g, ParamsBack &pb, const zopt_optimizer *o, int b, int si) {
  pb.recorded[(size_t)b] = 0;  // its event is behind copies not issued yet
  zopt_status st = offload_copy_bucket(g, o, b, si, true, pb.stream);
  if (!st)
    if (CUresult r = g->cu->EventRecordWithFlags(pb.events[(size_t)b], pb.stream, 0))
      st = fail(ZOPT_ERR_INTERNAL, "offload: cuEventRecord after bucket %d's params: %s", b, error_string(r));
  if (st) {
    seal(g, pb);  // what was issued reads the staging
    return st;
  }
  pb.recorded[(size_t)b] = 1;
  return ZOPT_OK;
}

zopt_status params_back_end(GpuState *g, ParamsBack &pb) {
  if (zopt_status st = seal(g, pb)) return st;
  if (pb.mode == ZOPT_PARAM_WAIT_ALL)
    if (CUresult r = g->cu->StreamWaitEvent(g->stream, g->staging, 0))
      return fail(ZOPT_ERR_INTERNAL, "offload: cuStreamWaitEvent (the params back on the optimizer's stream): %s",
                  error_string(r));
  return ZOPT_OK;
}

zopt_status params_back_all(GpuState *g, ParamsBack &pb, const zopt_optimizer *o, int si) {
  ZOPT_CTX_SCOPE(g);
  if (zopt_status st = params_back_begin(g, pb, o)) return st;
  for (int b = (int)o->prog->L.buckets.size() - 1; b >= 0; --b)  // forward order
    if (zopt_status st = params_back_bucket(g, pb, o, b, si)) return st;
  return params_back_end(g, pb);
}

zopt_status params_back_wait(GpuState *g, ParamsBack &pb, const zopt_optimizer *o, int b, void *stream) {
  ZOPT_CTX_SCOPE(g);
  CUstream s = stream ? (CUstream)stream : g->stream;
  CUevent e = nullptr;
  if ((size_t)b < pb.recorded.size() && pb.recorded[(size_t)b] && pb.extent == layout_key(o))
    e = pb.events[(size_t)b];
  else if (g->staging_recorded)
    e = g->staging;  // every copy (a rebuilt layout)
  if (!e) return ZOPT_OK;  // no copies yet: the params are the caller's
  bool cap = false;
  if (zopt_status st = gpu_capturing(g, s, &cap)) return st;
  // In a capture: a wait node, so each replay waits for the event's last
  // record before its launch (the last step's copies).
  if (CUresult r = g->cu->StreamWaitEvent(s, e, cap ? EVENT_WAIT_EXTERNAL : 0))
    return fail(ZOPT_ERR_INTERNAL, "zopt_optimizer_wait_params: cuStreamWaitEvent (bucket %d): %s", b,
                error_string(r));
  return ZOPT_OK;
}

void params_back_free(GpuState *g, ParamsBack &pb) {
  if (g && pb.stream) {
    CtxScope scope(g);
    if (!scope.status()) {
      // The copies read the staging; `staging` follows the last one (its
      // event, not a stream synchronisation: free waits for no stream).
      if (g->staging_recorded) g->cu->EventSynchronize(g->staging);
      for (CUevent e : pb.events) g->cu->EventDestroy(e);
      if (pb.before) g->cu->EventDestroy(pb.before);
      g->cu->StreamDestroy(pb.stream);
    }
  }
  pb = ParamsBack{};
}

}  // namespace zopt
