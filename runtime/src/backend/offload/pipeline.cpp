// backend/offload/pipeline.cpp - the offload pipeline (pipeline.h): bucket
// readiness, its copies and events, the bucket jobs on the optimizer's
// pipeline thread, and the pipelined step's ops. The CPU work and the
// commit / recompute decision are exec/speculate.cpp's.
//
// Streams and events: a bucket's copies to the staging go on the
// optimizer's stream after the optimizer's own earlier work (the previous
// step's param copies read the staging: the `staging` event, waited for on
// the stream at the step's first readiness), then the bucket's event; the
// job waits for that event on the host. At the step (1 rank) the buckets
// are updated in forward order (the last first) and each bucket's params go
// back to the device as soon as it is final, on the copy stream with its
// own event (params_back.h); the `staging` event is recorded after the
// last, as in a serial step. In per-bucket mode that per-bucket work (at W
// ranks: update, the bucket's ALL_GATHER of the params, copy) is the
// step's tail, run after the step returns (tail.h).
#include "backend/offload/pipeline.h"

#include "backend/offload/params_back.h"
#include "backend/offload/tail.h"

#include "exec/exec.h"
#include "exec/speculate.h"
#include "pipeline/pipeline.h"

#include <cstdio>

using namespace zopt::cu;

namespace zopt {

namespace {

const char *kReady = "zopt_optimizer_grad_bucket_ready";

}  // namespace

// State si (PARAM or GRAD) of bucket b between the device and its staging,
// asynchronously on `stream`: one copy per tensor piece.
zopt_status offload_copy_bucket(GpuState *g, const zopt_optimizer *o, int b, int si, bool to_device, CUstream stream) {
  const exec::Program &P = *o->prog;
  const layout::Bucket &k = P.L.buckets[b];
  const size_t es = dtype_size(o->d->states[si].dtype);
  const bool param = o->d->states[si].kind == ZOPT_STATE_PARAM;
  for (const layout::Piece &p : P.L.pieces(k.group, k.begin, k.begin + k.len)) {
    const Tensor &x = o->tensors[p.tensor];
    CUdeviceptr dev = (CUdeviceptr)(uintptr_t)(param ? x.param : x.grad) + (CUdeviceptr)((size_t)p.start * es);
    char *host = (char *)state_ptr(o, p.tensor, si) + (size_t)p.start * es;
    const size_t bytes = (size_t)p.len * es;
    CUresult r = to_device ? g->cu->MemcpyHtoDAsync(dev, host, bytes, stream)
                           : g->cu->MemcpyDtoHAsync(host, dev, bytes, stream);
    if (r)
      return fail(ZOPT_ERR_INTERNAL, "offload: copying the %s of tensor %d (bucket %d) %s the GPU: %s",
                  param ? "param" : "grad", p.tensor, b, to_device ? "to" : "from", error_string(r));
  }
  return ZOPT_OK;
}

namespace {

exec::Spec *open_spec(const zopt_optimizer *o) {
  exec::Spec *S = o->prog ? o->prog->spec : nullptr;
  return S && S->open ? S : nullptr;
}

}  // namespace

bool offload_pipelined(const zopt_optimizer *o) { return open_spec(o) != nullptr; }

zopt_status offload_bucket_ready(GpuState *g, OffloadPipe &pp, zopt_optimizer *o, int b) {
  exec::Program &P = *o->prog;
  const int nb = (int)P.L.buckets.size();
  if (b < 0 || b >= nb) return fail(ZOPT_ERR_INVALID_ARGUMENT, "%s: bucket %d out of range (have %d)", kReady, b, nb);
  if (o->begun)
    return fail(ZOPT_ERR_BAD_STATE, "%s: a step was begun (zopt_optimizer_step_begin): finish it first", kReady);
  exec::Spec *S = open_spec(o);
  if (S && S->ready[b])
    return fail(ZOPT_ERR_BAD_STATE, "%s: bucket %d was already marked ready since the last step", kReady, b);
  ZOPT_CTX_SCOPE(g);
  if (zopt_status st = refuse_if_capturing(
          g, g->stream, ZOPT_ERR_UNSUPPORTED,
          "%s: step '%s' is offloaded (its update runs on the CPU), so its bucket copies need the host and cannot be "
          "captured in a CUDA graph, but the optimizer's stream is capturing: mark buckets ready outside the capture",
          kReady, o->d->name))
    return st;
  const bool opened = S == nullptr;
  if (opened) {
    // The previous step's param copies read the staging: the copies into
    // it go after them (the `staging` event, on the stream).
    if (zopt_status st = gpu_wait_own_work(g, g->stream)) return st;
    if (zopt_status st = exec::spec_open(o, loss_scale(o), kReady)) return st;
    S = P.spec;
  }
  auto undo = [&](zopt_status st) {
    if (opened) exec::spec_close(o);
    return st;
  };
  if (pp.events.size() != (size_t)nb) {
    offload_pipe_free(g, pp);
    pp.events.assign(nb, nullptr);
  }
  if (!pp.events[b])
    if (CUresult r = g->cu->EventCreate(&pp.events[b], EVENT_DISABLE_TIMING))
      return undo(fail(ZOPT_ERR_INTERNAL, "%s: cuEventCreate: %s", kReady, error_string(r)));
  for (const zopt_program_op &op : P.ops)
    if (op.code == ZOPT_OP_COPY && op.dst == ZOPT_PLACE_CPU)
      if (zopt_status st = offload_copy_bucket(g, o, b, (int)op.state, false, g->stream)) return undo(st);
  CUevent ev = pp.events[b];
  if (CUresult r = g->cu->EventRecordWithFlags(ev, g->stream, 0))
    return undo(fail(ZOPT_ERR_INTERNAL, "%s: cuEventRecord after bucket %d's copies: %s", kReady, b, error_string(r)));
  const bool spec = exec::spec_reserve(o, b);
  try {
    if (!o->pipe) o->pipe = new pipeline::Pipeline();
    char w[64];
    snprintf(w, sizeof w, "offloaded gradient bucket %d", b);
    o->pipe->submit(
        w,
        [o, g, ev, b]() -> zopt_status {
          CtxScope scope(g);
          if (zopt_status st = scope.status()) return st;
          if (CUresult r = g->cu->EventSynchronize(ev))
            return fail(ZOPT_ERR_INTERNAL, "waiting for bucket %d's copies from the GPU: %s", b, error_string(r));
          return exec::spec_bucket_work(o, b);
        },
        [](bool) {});
  } catch (...) {
    if (spec) {  // the last reservation: given back
      S->arena_used -= (size_t)S->cost[b];
      S->speculated[b] = 0;
    }
    return undo(fail(ZOPT_ERR_OUT_OF_MEMORY, "%s: out of memory queueing bucket %d", kReady, b));
  }
  S->ready[b] = 1;
  ++S->nready;
  S->last_ready = exec::now_seconds();
  if ((size_t)S->nready == S->ready.size()) {  // the last mark: the copies still running
    S->copies_in_flight = 0;
    for (CUevent e : pp.events)
      S->copies_in_flight += e && g->cu->EventQuery(e) == CUDA_ERROR_NOT_READY;
  }
  return ZOPT_OK;
}

zopt_status offload_pipelined_begin(GpuState *g, zopt_optimizer *o) {
  exec::Spec *S = open_spec(o);
  if (!S) return ZOPT_OK;
  if (S->consumed) {
    // A pipelined step failed after its update began: its speculation is
    // void; this step runs serially (the grads are copied again).
    exec::spec_close(o);
    return ZOPT_OK;
  }
  const size_t nb = S->ready.size();
  if ((size_t)S->nready != nb)
    return fail(ZOPT_ERR_BAD_STATE,
                "zopt_optimizer_step: gradient buckets were marked ready (zopt_optimizer_grad_bucket_ready) but not "
                "all of them: bucket %s of %zu not marked since the last step; mark %s before the step",
                exec::spec_missing(o).c_str(), nb, nb - S->nready == 1 ? "it" : "them");
  ZOPT_CTX_SCOPE(g);
  return refuse_if_capturing(
      g, g->stream, ZOPT_ERR_UNSUPPORTED,
      "zopt_optimizer_step: step '%s' is offloaded (its update runs on the CPU between the copies of the grads and "
      "of the params back), so it cannot be captured in a CUDA graph, but the optimizer's stream is capturing: run "
      "the step outside the capture (its marked buckets stay marked)",
      o->d->name);
}

zopt_status offload_pipelined_op(GpuState *g, ParamsBack &pb, OffloadTail &tail, zopt_optimizer *o,
                                 exec::StepState *st, size_t i, bool *handled) {
  exec::Spec *S = open_spec(o);
  *handled = false;
  if (!S) return ZOPT_OK;
  exec::Program &P = *o->prog;
  const zopt_program_op &op = P.ops[i];
  switch (op.code) {
    case ZOPT_OP_REDUCE_SCATTER:  // each bucket's job reduced it
      *handled = true;
      return ZOPT_OK;
    case ZOPT_OP_ALL_GATHER:
      // The reduced grad (ZeRO-0/1): gathered by each bucket's job; the
      // params at W ranks in per-bucket mode: by each bucket's tail job.
      *handled = o->d->states[op.state].kind == ZOPT_STATE_GRAD || tail.pending;
      return ZOPT_OK;
    case ZOPT_OP_COPY: {
      const bool to_host = op.dst == ZOPT_PLACE_CPU;
      // At W ranks the params go back after the ALL_GATHER: the serial
      // copy, unless the tail gathers and copies them per bucket.
      if (!to_host && o->world > 1 && !tail.pending) return ZOPT_OK;
      *handled = true;
      P.copy_bytes[to_host ? 0 : 1] += exec::copy_size(o, (int)op.state);
      if (to_host) return ZOPT_OK;  // at each bucket's readiness
      // The params went back bucket by bucket at the UPDATE: `staging`,
      // and the optimizer's stream after them unless per bucket (the
      // tail's last job records it).
      if (tail.pending) return ZOPT_OK;
      ZOPT_CTX_SCOPE(g);
      return params_back_end(g, pb);
    }
    case ZOPT_OP_NORM_PARTIALS:
      // The partials of every bucket were computed at its readiness with
      // these rows; else (the rows changed) again, serially.
      *handled = exec::spec_rows_same(o);
      return ZOPT_OK;
    case ZOPT_OP_UPDATE: {
      *handled = true;
      S->consumed = true;
      const double t0 = exec::now_seconds();
      // The params' copy back after the UPDATE (and at W ranks the
      // ALL_GATHER of them before it): at 1 rank each bucket's params go
      // back at once; at W ranks, in per-bucket mode only, each bucket's
      // gather and copy in the tail (tail.h), else the serial ops.
      int back = -1, gather = -1;
      for (size_t j = i + 1; j < P.ops.size(); ++j) {
        const zopt_program_op &q = P.ops[j];
        if (q.code == ZOPT_OP_COPY && q.dst != ZOPT_PLACE_CPU) back = (int)q.state;
        if (q.code == ZOPT_OP_ALL_GATHER && o->d->states[q.state].kind != ZOPT_STATE_GRAD) gather = (int)j;
      }
      if (o->world == 1) gather = -1;  // the ALL_GATHER is a no-op
      else if (!tail_wanted(pb.mode, back) || (gather >= 0 && (int)P.ops[(size_t)gather].state != back))
        back = gather = -1;  // the serial ALL_GATHER and COPY
      ZOPT_CTX_SCOPE(g);
      try {
        exec::spec_try_swap(o);
      } catch (...) {
        return fail(ZOPT_ERR_OUT_OF_MEMORY, "zopt_optimizer_step: out of memory rebuilding the work lists");
      }
      // In forward order (the last bucket first: the first params the
      // next forward needs), each bucket's params back once it is final.
      if (back >= 0)
        if (zopt_status s = params_back_begin(g, pb, o)) return s;
      // Per-bucket mode: the same work per bucket, in the same order, on
      // the pipeline thread after the step returns (tail.h).
      if (tail_wanted(pb.mode, back)) {
        zopt_status s = tail_queue(g, pb, tail, o, back, gather);
        P.op_seconds[i] = exec::now_seconds() - t0;
        return s;
      }
      for (int b = (int)S->ready.size() - 1; b >= 0; --b) {
        exec::spec_update_bucket(o, b);
        if (back >= 0)
          if (zopt_status s = params_back_bucket(g, pb, o, b, back)) return s;
      }
      P.op_seconds[i] = exec::now_seconds() - t0;
      return ZOPT_OK;
    }
    default:
      return ZOPT_OK;
  }
}

void offload_pipelined_end(zopt_optimizer *o, bool skipped, double end) {
  exec::Spec *S = open_spec(o);
  if (!S) return;
  zopt_pipeline_stats &r = S->stats;
  r = zopt_pipeline_stats{};
  r.size = sizeof r;
  r.buckets = (int32_t)S->ready.size();
  for (uint8_t x : S->speculated) r.speculated += x;
  r.committed = S->committed;
  r.recomputed = S->recomputed;
  r.late = S->late;
  r.copies_in_flight = S->copies_in_flight;
  r.outcome = skipped ? ZOPT_SPEC_DISCARD : S->recomputed ? ZOPT_SPEC_RECOMPUTE : ZOPT_SPEC_COMMIT;
  for (double x : S->job_seconds) r.overlapped_seconds += x;
  r.exposed_seconds = end - S->last_ready;
  r.steps = S->stats_steps + 1;
  S->stats_steps = r.steps;
  exec::spec_close(o);
}

void offload_pipe_free(GpuState *g, OffloadPipe &pp) {
  if (!g) return;
  CtxScope scope(g);
  if (!scope.status())
    for (CUevent e : pp.events)
      if (e) {
        g->cu->EventSynchronize(e);  // its copies write the staging
        g->cu->EventDestroy(e);
      }
  pp.events.clear();
}

}  // namespace zopt
