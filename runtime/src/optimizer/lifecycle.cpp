// optimizer/lifecycle.cpp - an optimizer's life (zopt.h): create, its thread
// pool's size, finalize (the backend lays out and allocates), the seed,
// free; what it holds (memory_info) and its last step's op times; the
// descriptor lookups the runtime shares.
#include "optimizer/api.h"

#include "backend/backend.h"
#include "exec/exec.h"
#include "pipeline/pipeline.h"

#include <cstdlib>
#include <new>

using namespace zopt;

namespace {

int default_threads() {
  if (const char *e = getenv("ZOPT_NUM_THREADS")) {
    int v = atoi(e);
    if (v >= 1 && v <= 4096) return v;
  }
  unsigned n = std::thread::hardware_concurrency();
  return n ? (int)n : 1;
}

}  // namespace

namespace zopt {

int state_index(const zopt_step_descriptor *d, uint32_t kind) {
  for (uint32_t i = 0; i < d->num_states; ++i)
    if (d->states[i].kind == kind) return (int)i;
  return -1;
}

int hyper_index(const zopt_step_descriptor *d, uint32_t kind) {
  for (uint32_t i = 0; i < d->num_hypers; ++i)
    if (d->hypers[i].kind == kind) return (int)i;
  return -1;
}

bool is_owned_kind(uint32_t kind) { return kind != ZOPT_STATE_PARAM && kind != ZOPT_STATE_GRAD; }

}  // namespace zopt

extern "C" {

ZOPT_API zopt_status zopt_optimizer_create(const zopt_step *step, zopt_optimizer **out) {
  if (!out) return fail(ZOPT_ERR_INVALID_ARGUMENT, "zopt_optimizer_create: out is NULL");
  *out = nullptr;
  if (!step) return fail(ZOPT_ERR_INVALID_ARGUMENT, "zopt_optimizer_create: step is NULL");
  const zopt_step_descriptor *d = &step->desc;
  zopt_optimizer *o = new (std::nothrow) zopt_optimizer;
  if (!o) return fail(ZOPT_ERR_OUT_OF_MEMORY, "out of memory");
  o->step = step;
  o->d = d;
  o->max_norm = (d->flags & ZOPT_FLAG_CLIP) ? d->max_norm : 0;
  const_cast<zopt_step *>(step)->refcount++;
  o->num_threads = default_threads();
  o->scaler.cfg = {65536.0, 2.0, 0.5, 2000, 1.0, 1};
  o->scaler.scale = 65536.0;
  o->scaler.good_steps = 0;
  if (zopt_status st = make_backend(o, &o->backend)) {
    zopt_optimizer_free(o);
    return st;
  }
  *out = o;
  return ZOPT_OK;
}

ZOPT_API void zopt_optimizer_free(zopt_optimizer *o) {
  if (!o) return;
  o->gate.close();  // waits for a call running on another thread
  (void)join_tail(o, "zopt_optimizer_free");  // its jobs use the backend's buffers (a failure has no caller)
  delete o->pipe;  // skips queued jobs, waits for a running one, joins
  delete o->pool;
  delete o->begun;
  if (o->backend) o->backend->destroy(o);  // buffers, device state, staging
  delete o->backend;
  const zopt_step *s = o->step;
  delete o;
  release_step(s);
}

ZOPT_API zopt_status zopt_optimizer_set_num_threads(zopt_optimizer *o, int n) {
  CHECK_OPT(o, "zopt_optimizer_set_num_threads");
  if (n < 1 || n > 4096) return fail(ZOPT_ERR_INVALID_ARGUMENT, "zopt_optimizer_set_num_threads: n = %d not in [1, 4096]", n);
  if (n == o->num_threads) return ZOPT_OK;
  if (o->finalized) {
    ThreadPool *p = nullptr;
    try {
      p = new ThreadPool(n);
    } catch (...) {
      return fail(ZOPT_ERR_OUT_OF_MEMORY, "zopt_optimizer_set_num_threads: cannot start %d threads", n);
    }
    delete o->pool;
    o->pool = p;
    o->num_threads = n;
    exec::repartition(o);
  } else {
    o->num_threads = n;
  }
  return ZOPT_OK;
}

ZOPT_API zopt_status zopt_optimizer_finalize(zopt_optimizer *o) {
  CHECK_OPT(o, "zopt_optimizer_finalize");
  if (o->finalized) return fail(ZOPT_ERR_BAD_STATE, "zopt_optimizer_finalize: already finalized");
  if (o->tensors.empty()) return fail(ZOPT_ERR_BAD_STATE, "zopt_optimizer_finalize: no tensors were added");
  // A refused finalize leaves the optimizer as it was: world size 1 (the
  // gradient divisor's default, memory_info) until a finalize succeeds.
  struct Undo {
    zopt_optimizer *o;
    ~Undo() {
      if (!o->finalized) o->world = 1, o->rank = 0;
    }
  } undo{o};
  o->world = o->comm ? zopt_comm_size(o->comm) : 1;
  o->rank = o->comm ? zopt_comm_rank(o->comm) : 0;
  if (zopt_status st = o->backend->finalize(o)) return st;
  o->finalized = true;
  return ZOPT_OK;
}

ZOPT_API zopt_status zopt_optimizer_set_seed(zopt_optimizer *o, uint64_t seed) {
  CHECK_OPT(o, "zopt_optimizer_set_seed");
  o->seed = seed;
  return ZOPT_OK;
}

ZOPT_API zopt_status zopt_optimizer_get_seed(const zopt_optimizer *o, uint64_t *seed) {
  CHECK_OPT(o, "zopt_optimizer_get_seed");
  if (!seed) return fail(ZOPT_ERR_INVALID_ARGUMENT, "zopt_optimizer_get_seed: seed is NULL");
  *seed = o->seed;
  return ZOPT_OK;
}

ZOPT_API zopt_status zopt_optimizer_memory_info(const zopt_optimizer *o, zopt_memory_info *info) {
  CHECK_OPT(o, "zopt_optimizer_memory_info");
  if (!info) return fail(ZOPT_ERR_INVALID_ARGUMENT, "zopt_optimizer_memory_info: info is NULL");
  const zopt_step_descriptor *d = o->d;
  memset(info, 0, sizeof *info);
  uint64_t n = 0;
  for (const Tensor &t : o->tensors) n += (uint64_t)t.numel;
  info->num_params = n;
  // Before finalize: the communicator's ranks, as zopt_optimizer_get_world
  // (the optimizer's own world is set at finalize).
  info->world_size = o->finalized ? o->world : o->comm ? zopt_comm_size(o->comm) : 1;
  info->rank = o->finalized ? o->rank : o->comm ? zopt_comm_rank(o->comm) : 0;
  // The user's params and grads where they live (streamed gradients have
  // no registered memory: the runtime holds this rank's shards, grad_bytes).
  for (uint32_t s = 0; s < d->num_states; ++s) {
    const zopt_state_desc &sd = d->states[s];
    if (is_owned_kind(sd.kind) || (sd.kind == ZOPT_STATE_GRAD && o->stream_grads)) continue;
    (sd.placement == ZOPT_PLACE_GPU ? info->bytes_gpu : info->bytes_cpu) += n * dtype_size(sd.dtype);
  }
  if (!o->finalized) return ZOPT_OK;
  o->backend->memory_info(o, info);
  return ZOPT_OK;
}

ZOPT_API zopt_status zopt_optimizer_get_op_times(const zopt_optimizer *o, double *seconds, int n) {
  const char *fn = "zopt_optimizer_get_op_times";
  CHECK_OPT(o, "zopt_optimizer_get_op_times");
  if (!seconds) return fail(ZOPT_ERR_INVALID_ARGUMENT, "%s: seconds is NULL", fn);
  if (zopt_status st = o->backend->supports(o, Feature::OpTimes, fn)) return st;
  if (!o->finalized) return fail(ZOPT_ERR_BAD_STATE, "%s: call zopt_optimizer_finalize first", fn);
  const exec::Program &P = *o->prog;
  if (n < (int)P.ops.size() + 1)
    return fail(ZOPT_ERR_INVALID_ARGUMENT, "%s: n = %d, need %zu", fn, n, P.ops.size() + 1);
  for (size_t i = 0; i < P.ops.size(); ++i) seconds[i] = i < P.op_seconds.size() ? P.op_seconds[i] : 0.0;
  seconds[P.ops.size()] = P.agree_seconds;
  return ZOPT_OK;
}

ZOPT_API zopt_status zopt_optimizer_get_step_stats(const zopt_optimizer *o, zopt_step_stats *stats) {
  const char *fn = "zopt_optimizer_get_step_stats";
  CHECK_OPT(o, "zopt_optimizer_get_step_stats");
  if (!stats) return fail(ZOPT_ERR_INVALID_ARGUMENT, "%s: stats is NULL", fn);
  if (zopt_status st = o->backend->supports(o, Feature::OpTimes, fn)) return st;
  if (!o->finalized) return fail(ZOPT_ERR_BAD_STATE, "%s: call zopt_optimizer_finalize first", fn);
  *stats = o->prog->stats;
  return ZOPT_OK;
}

}  // extern "C"
