// backend/offload/tail.cpp - a pipelined offloaded step's tail on the
// pipeline thread, after the step returned (tail.h; docs/GPU.md "Params
// back early").
#include "backend/offload/tail.h"

#include "backend/offload/params_back.h"
#include "backend/offload/pipeline.h"

#include "exec/exec.h"
#include "exec/speculate.h"
#include "pipeline/pipeline.h"

#include <cstdio>

using namespace zopt::cu;

namespace zopt {

namespace {

// Bucket b's part of the tail: its update, at W ranks its params gathered
// (`gather`: the op; *gathered false when that failed: no copy back),
// then its params back (the last bucket of the step: `staging` after
// them). Any thread.
zopt_status tail_bucket(GpuState *g, ParamsBack &pb, zopt_optimizer *o, int b, int si, int gather, bool last,
                        bool *gathered) {
  exec::spec_update_bucket(o, b);
  *gathered = true;
  zopt_status st = ZOPT_OK;
  if (gather >= 0)
    if ((st = exec::spec_gather_bucket(o, (size_t)gather, b))) *gathered = false;
  CtxScope scope(g);
  if (!st) st = scope.status();
  if (!st) st = params_back_bucket(g, pb, o, b, si);
  if (last && !scope.status()) {
    zopt_status e = params_back_end(g, pb);
    if (!st) st = e;
  }
  return st;
}

}  // namespace

bool tail_wanted(int mode, int back) { return back >= 0 && mode == ZOPT_PARAM_WAIT_PER_BUCKET; }

zopt_status tail_queue(GpuState *g, ParamsBack &pb, OffloadTail &t, zopt_optimizer *o, int si, int gather) {
  exec::Spec &S = *o->prog->spec;
  const int nb = (int)S.ready.size();
  {
    std::lock_guard<std::mutex> l(t.mu);
    t.failed = ZOPT_OK;
    t.failed_bucket = -1;
    t.gather_failed = false;
    t.msg.clear();
  }
  t.g = g;
  t.pb = &pb;
  t.si = si;
  t.gather = gather;
  int b = nb - 1;
  try {
    // FINISH advances the counts before the jobs read them: a stochastic
    // rounding key uses the count of the step being taken.
    if (o->d->flags & ZOPT_FLAG_STOCHASTIC) {
      S.tail_steps.resize(o->tensors.size());
      for (size_t i = 0; i < o->tensors.size(); ++i) S.tail_steps[i] = o->tensors[i].steps;
    }
    t.ticket.assign((size_t)nb, 0);
    if (!o->pipe) o->pipe = new pipeline::Pipeline();
    for (; b >= 0; --b) {
      char w[64];
      snprintf(w, sizeof w, "the step's tail, bucket %d", b);
      const bool last = b == 0;
      t.ticket[(size_t)b] = o->pipe->submit(
          w,
          [g, &pb, &t, o, b, si, gather, last]() -> zopt_status {
            bool gathered = true;
            if (zopt_status st = tail_bucket(g, pb, o, b, si, gather, last, &gathered)) {
              std::lock_guard<std::mutex> l(t.mu);
              if (!t.failed) {
                t.failed = st;
                t.failed_bucket = b;
                t.gather_failed = !gathered;
                t.msg = zopt_last_error();
              }
            }
            return ZOPT_OK;  // the later buckets still update
          },
          [](bool) {});
      t.pending = true;
      o->tail = true;
    }
    return ZOPT_OK;
  } catch (...) {
  }
  // Out of memory queueing: the queued jobs first, the rest here, in order.
  if (o->pipe) (void)o->pipe->drain();
  const bool queued = t.pending;
  t.pending = false;
  o->tail = false;
  bool gathered = true;
  for (; b >= 0; --b)
    if (zopt_status st = tail_bucket(g, pb, o, b, si, gather, b == 0, &gathered)) return st;
  std::lock_guard<std::mutex> l(t.mu);
  if (queued && t.failed)
    return fail(t.failed, "the step's tail (bucket %d's %s): %s", t.failed_bucket,
                t.gather_failed ? "ALL_GATHER of the params" : "params back to the GPU", t.msg.c_str());
  return ZOPT_OK;
}

zopt_status tail_wait_bucket(OffloadTail &t, zopt_optimizer *o, int b, const char *fn) {
  if (!t.pending || (size_t)b >= t.ticket.size()) return ZOPT_OK;
  o->pipe->wait(t.ticket[(size_t)b]);
  bool failed;  // bucket b's job or one before it (a later bucket's failure: reported by the join)
  {
    std::lock_guard<std::mutex> l(t.mu);
    failed = t.failed != ZOPT_OK && t.failed_bucket >= b;
  }
  return failed ? tail_join(t, o, fn) : ZOPT_OK;
}

zopt_status tail_join(OffloadTail &t, zopt_optimizer *o, const char *fn) {
  if (!t.pending) return ZOPT_OK;
  zopt_status st = o->pipe->drain();  // the jobs report nothing (their failures are kept below)
  t.pending = false;
  o->tail = false;
  offload_pipelined_end(o, false, t.returned);
  if (st) return st;
  int b;
  zopt_status failed;
  bool gather_failed;
  std::string msg;
  {
    std::lock_guard<std::mutex> l(t.mu);
    if (!t.failed) return ZOPT_OK;
    failed = t.failed;
    t.failed = ZOPT_OK;
    b = t.failed_bucket;
    gather_failed = t.gather_failed;
    msg = std::move(t.msg);
  }
  // A gather failed (a rank died or disagreed; the communicator is
  // poisoned): no copy again, the staging holds only this rank's shard.
  if (gather_failed)
    return fail(failed,
                "%s: the last step's tail failed in the background (after zopt_optimizer_step returned): bucket %d's "
                "ALL_GATHER of the params: %s. This rank's optimizer states and counts are the step's; the params "
                "on the GPU of bucket %d and of the buckets after it in forward order are not",
                fn, b, msg.c_str(), b);
  // The failed bucket's copy once more (its event and `staging` after it),
  // so that the params on the GPU are the step's where it goes through.
  std::string again;
  {
    CtxScope scope(t.g);
    zopt_status r = scope.status();
    if (!r) r = params_back_bucket(t.g, *t.pb, o, b, t.si);
    if (!r) r = params_back_end(t.g, *t.pb);
    again = r ? std::string("; issued again, it failed too: ") + zopt_last_error()
              : "; its copy was issued again and went through (the params on the GPU are the step's)";
  }
  return fail(ZOPT_ERR_INTERNAL,
              "%s: the last step's tail failed in the background (after zopt_optimizer_step returned): bucket %d's "
              "params back to the GPU: %s%s. The optimizer's states and counts are the step's",
              fn, b, msg.c_str(), again.c_str());
}

}  // namespace zopt
