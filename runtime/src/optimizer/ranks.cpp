// optimizer/ranks.cpp - the optimizer across ranks (zopt.h, zopt/comm.h):
// its communicator, the bucket size, the gradient divisor D, and gradient
// streaming (buckets reduced during backward, exec/stream.cpp), an offloaded
// step's bucket readiness and its params' copies back.
#include "optimizer/api.h"

#include "backend/backend.h"
#include "exec/exec.h"
#include "exec/speculate.h"

#include <algorithm>
#include <cmath>
#include <cstring>

using namespace zopt;

extern "C" {

ZOPT_API zopt_status zopt_optimizer_set_comm(zopt_optimizer *o, zopt_comm *comm) {
  CHECK_OPT(o, "zopt_optimizer_set_comm");
  if (o->finalized) return fail(ZOPT_ERR_BAD_STATE, "zopt_optimizer_set_comm: the optimizer is already finalized");
  if (comm) {
    int r = zopt_comm_rank(comm), w = zopt_comm_size(comm);
    if (w < 1 || r < 0 || r >= w)
      return fail(ZOPT_ERR_INVALID_ARGUMENT, "zopt_optimizer_set_comm: rank %d / world size %d out of range", r, w);
    if (zopt_status st = o->backend->check_comm(o, comm)) return st;
  }
  o->comm = comm;
  return ZOPT_OK;
}

ZOPT_API zopt_status zopt_optimizer_get_world(const zopt_optimizer *o, int *rank, int *world) {
  CHECK_OPT(o, "zopt_optimizer_get_world");
  if (!rank || !world) return fail(ZOPT_ERR_INVALID_ARGUMENT, "zopt_optimizer_get_world: NULL argument");
  *world = o->comm ? zopt_comm_size(o->comm) : 1;
  *rank = o->comm ? zopt_comm_rank(o->comm) : 0;
  return ZOPT_OK;
}

ZOPT_API zopt_status zopt_optimizer_set_bucket_elems(zopt_optimizer *o, int64_t elems) {
  CHECK_OPT(o, "zopt_optimizer_set_bucket_elems");
  if (o->finalized) return fail(ZOPT_ERR_BAD_STATE, "zopt_optimizer_set_bucket_elems: already finalized");
  if (elems < 1 || elems > ((int64_t)1 << 40))
    return fail(ZOPT_ERR_INVALID_ARGUMENT, "zopt_optimizer_set_bucket_elems: %lld not in [1, 2^40]", (long long)elems);
  o->bucket_elems = elems;
  return ZOPT_OK;
}

ZOPT_API zopt_status zopt_optimizer_set_grad_divisor(zopt_optimizer *o, double divisor) {
  CHECK_OPT(o, "zopt_optimizer_set_grad_divisor");
  if (!(std::isfinite(divisor) && divisor >= 0))
    return fail(ZOPT_ERR_INVALID_ARGUMENT, "zopt_optimizer_set_grad_divisor: %g must be finite and > 0 (0: the world size)",
                divisor);
  if (zopt_status st = o->backend->pull(o)) return st;  // counts where the backend keeps them
  o->grad_divisor = divisor;
  return o->backend->push(o);
}

ZOPT_API zopt_status zopt_optimizer_get_grad_divisor(const zopt_optimizer *o, double *divisor) {
  CHECK_OPT(o, "zopt_optimizer_get_grad_divisor");
  if (!divisor) return fail(ZOPT_ERR_INVALID_ARGUMENT, "zopt_optimizer_get_grad_divisor: divisor is NULL");
  *divisor = grad_divisor(o);
  return ZOPT_OK;
}

ZOPT_API zopt_status zopt_optimizer_set_grad_streaming(zopt_optimizer *o, int on) {
  const char *fn = "zopt_optimizer_set_grad_streaming";
  CHECK_OPT(o, "zopt_optimizer_set_grad_streaming");
  if (o->finalized) return fail(ZOPT_ERR_BAD_STATE, "%s: the optimizer is already finalized", fn);
  if (on != 0 && on != 1) return fail(ZOPT_ERR_INVALID_ARGUMENT, "%s: on = %d (0 or 1)", fn, on);
  if (on)
    if (zopt_status st = o->backend->supports(o, Feature::GradStreaming, fn)) return st;
  if (!on)
    for (const Tensor &x : o->tensors)
      if (x.numel && !x.grad)
        return fail(ZOPT_ERR_BAD_STATE, "%s: tensors were added without gradient memory for streaming", fn);
  o->stream_grads = on != 0;
  return ZOPT_OK;
}

// The buckets are known: gradient streaming, or an offloaded step (its
// bucket readiness, zopt_optimizer_grad_bucket_ready).
static zopt_status check_buckets(const zopt_optimizer *o, const char *fn) {
  if (o->finalized && o->prog && o->backend->stages()) return ZOPT_OK;
  if (!o->finalized) return fail(ZOPT_ERR_BAD_STATE, "%s: call zopt_optimizer_finalize first", fn);
  if (!o->stream_grads || !o->prog)
    return fail(ZOPT_ERR_BAD_STATE,
                "%s: gradient streaming is off (zopt_optimizer_set_grad_streaming before finalize) and the step is "
                "not offloaded",
                fn);
  return ZOPT_OK;
}

static zopt_status check_streaming(const zopt_optimizer *o, const char *fn) {
  if (!o->finalized) return fail(ZOPT_ERR_BAD_STATE, "%s: call zopt_optimizer_finalize first", fn);
  if (!o->stream_grads || !o->prog)
    return fail(ZOPT_ERR_BAD_STATE, "%s: gradient streaming is off (zopt_optimizer_set_grad_streaming before finalize)",
                fn);
  return ZOPT_OK;
}

static zopt_status check_bucket(const zopt_optimizer *o, int bucket, const char *fn) {
  if (bucket < 0 || bucket >= (int)o->prog->L.buckets.size())
    return fail(ZOPT_ERR_INVALID_ARGUMENT, "%s: bucket %d out of range (have %zu)", fn, bucket,
                o->prog->L.buckets.size());
  return ZOPT_OK;
}

ZOPT_API zopt_status zopt_optimizer_num_buckets(const zopt_optimizer *o, int *n) {
  CHECK_OPT_ANY(o, "zopt_optimizer_num_buckets");
  if (!n) return fail(ZOPT_ERR_INVALID_ARGUMENT, "zopt_optimizer_num_buckets: n is NULL");
  if (zopt_status st = check_buckets(o, "zopt_optimizer_num_buckets")) return st;
  *n = (int)o->prog->L.buckets.size();
  return ZOPT_OK;
}

ZOPT_API zopt_status zopt_optimizer_bucket_tensors(const zopt_optimizer *o, int bucket, int *tensors, int capacity,
                                                   int *count) {
  const char *fn = "zopt_optimizer_bucket_tensors";
  CHECK_OPT_ANY(o, "zopt_optimizer_bucket_tensors");
  if (!count) return fail(ZOPT_ERR_INVALID_ARGUMENT, "%s: count is NULL", fn);
  if (zopt_status st = check_buckets(o, fn)) return st;
  if (zopt_status st = check_bucket(o, bucket, fn)) return st;
  std::vector<int> ts;
  exec::bucket_tensors(o, bucket, &ts);
  *count = (int)ts.size();
  if (tensors) {
    if (capacity < (int)ts.size())
      return fail(ZOPT_ERR_INVALID_ARGUMENT, "%s: capacity %d < %zu tensors", fn, capacity, ts.size());
    std::copy(ts.begin(), ts.end(), tensors);
  }
  return ZOPT_OK;
}

ZOPT_API zopt_status zopt_optimizer_reduce_bucket(zopt_optimizer *o, int bucket, const void *const *grads, int count) {
  CHECK_OPT(o, "zopt_optimizer_reduce_bucket");
  if (zopt_status st = check_streaming(o, "zopt_optimizer_reduce_bucket")) return st;
  return exec::reduce_bucket(o, bucket, grads, count);
}

ZOPT_API zopt_status zopt_optimizer_reduce_bucket_async(zopt_optimizer *o, int bucket, const void *const *grads,
                                                        int count) {
  CHECK_OPT_ANY(o, "zopt_optimizer_reduce_bucket_async");
  if (zopt_status st = check_streaming(o, "zopt_optimizer_reduce_bucket_async")) return st;
  return exec::reduce_bucket_async(o, bucket, grads, count);
}

ZOPT_API zopt_status zopt_optimizer_bucket_done(const zopt_optimizer *o, int bucket, int *done) {
  const char *fn = "zopt_optimizer_bucket_done";
  CHECK_OPT_ANY(o, "zopt_optimizer_bucket_done");
  if (!done) return fail(ZOPT_ERR_INVALID_ARGUMENT, "%s: done is NULL", fn);
  if (zopt_status st = check_streaming(o, fn)) return st;
  if (zopt_status st = check_bucket(o, bucket, fn)) return st;
  *done = exec::bucket_finished(o, bucket) ? 1 : 0;
  return ZOPT_OK;
}

ZOPT_API zopt_status zopt_optimizer_wait_buckets(zopt_optimizer *o) {
  CHECK_OPT_ANY(o, "zopt_optimizer_wait_buckets");
  if (zopt_status st = check_streaming(o, "zopt_optimizer_wait_buckets")) return st;
  return exec::wait_buckets(o);
}

// ---- offloaded steps: bucket readiness (backend/offload/pipeline.h) -----

ZOPT_API zopt_status zopt_optimizer_grad_bucket_ready(zopt_optimizer *o, int bucket) {
  CHECK_OPT_ANY(o, "zopt_optimizer_grad_bucket_ready");
  if (!o->finalized || !o->prog)
    return fail(ZOPT_ERR_BAD_STATE, "zopt_optimizer_grad_bucket_ready: call zopt_optimizer_finalize first");
  return o->backend->grad_bucket_ready(o, bucket);
}

ZOPT_API zopt_status zopt_optimizer_set_speculation_budget(zopt_optimizer *o, uint64_t bytes) {
  const char *fn = "zopt_optimizer_set_speculation_budget";
  CHECK_OPT(o, fn);
  if (!o->finalized || !o->prog) return fail(ZOPT_ERR_BAD_STATE, "%s: call zopt_optimizer_finalize first", fn);
  if (!o->backend->stages())
    return fail(ZOPT_ERR_UNSUPPORTED, "%s: step '%s' is not offloaded (no bucket readiness, no speculation)", fn,
                o->d->name);
  return exec::spec_set_budget(o, bytes, fn);
}

ZOPT_API zopt_status zopt_optimizer_get_pipeline_stats(const zopt_optimizer *o, zopt_pipeline_stats *stats) {
  const char *fn = "zopt_optimizer_get_pipeline_stats";
  CHECK_OPT_ANY(o, fn);
  if (!stats) return fail(ZOPT_ERR_INVALID_ARGUMENT, "%s: stats is NULL", fn);
  const uint32_t want = stats->size;
  if (want < 8)
    return fail(ZOPT_ERR_INVALID_ARGUMENT, "%s: stats->size = %u (set it to sizeof(zopt_pipeline_stats))", fn, want);
  zopt_pipeline_stats s{};
  if (o->prog && o->prog->spec) s = o->prog->spec->stats;
  s.size = (uint32_t)std::min<size_t>(want, sizeof s);
  memcpy(stats, &s, s.size);
  return ZOPT_OK;
}

// ---- offloaded steps: the params back (backend/offload/params_back.h) -----

ZOPT_API zopt_status zopt_optimizer_set_param_wait(zopt_optimizer *o, int mode) {
  const char *fn = "zopt_optimizer_set_param_wait";
  CHECK_OPT(o, fn);
  if (mode != ZOPT_PARAM_WAIT_ALL && mode != ZOPT_PARAM_WAIT_PER_BUCKET)
    return fail(ZOPT_ERR_INVALID_ARGUMENT,
                "%s: mode %d (ZOPT_PARAM_WAIT_ALL = 0 or ZOPT_PARAM_WAIT_PER_BUCKET = 1)", fn, mode);
  return o->backend->set_param_wait(o, mode);
}

ZOPT_API zopt_status zopt_optimizer_get_param_wait(const zopt_optimizer *o, int *mode) {
  CHECK_OPT_ANY(o, "zopt_optimizer_get_param_wait");
  if (!mode) return fail(ZOPT_ERR_INVALID_ARGUMENT, "zopt_optimizer_get_param_wait: mode is NULL");
  *mode = o->backend->param_wait(o);
  return ZOPT_OK;
}

ZOPT_API zopt_status zopt_optimizer_wait_params(zopt_optimizer *o, int bucket, void *cu_stream) {
  const char *fn = "zopt_optimizer_wait_params";
  ZOPT_ENTER_CALL_NO_JOIN(o, fn);  // waits for its bucket's part of a step's tail only
  if (!o->backend->stages()) return o->backend->wait_params(o, bucket, cu_stream);  // UNSUPPORTED
  if (!o->finalized || !o->prog) return fail(ZOPT_ERR_BAD_STATE, "%s: call zopt_optimizer_finalize first", fn);
  if (zopt_status st = check_bucket(o, bucket, fn)) return st;
  return o->backend->wait_params(o, bucket, cu_stream);
}

}  // extern "C"
