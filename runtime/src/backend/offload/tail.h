// backend/offload/tail.h - the asynchronous tail of a pipelined offloaded
// step at 1 rank in per-bucket mode (docs/GPU.md "Params back early").
//
// This file owns the part of such a step that runs after
// zopt_optimizer_step has returned: per bucket, in forward order (the last
// bucket first), one job on the optimizer's pipeline thread that commits
// or recomputes the bucket's update (exec/speculate.h) and then copies its
// params back with its event (params_back.h); the last job records
// `staging`. The step itself ends once its outcome is decided (norm, clip
// coefficient, skip, loss scale, counts: FINISH ran). zopt_optimizer_wait_params
// waits for one bucket's job (tail_wait_bucket); every other API call joins
// the whole tail first (join_tail from CallHold, internal.h: tail_join),
// which reports a job's failure, naming its bucket, once. A job never
// fails in the pipeline's sense: a failed copy is recorded here and the
// later buckets still update, so the states stay whole; the join issues
// the failed bucket's copy once more (the params on the GPU are the step's
// if that succeeds, whatever the step reads next) and reports both.
#ifndef ZOPT_RUNTIME_BACKEND_OFFLOAD_TAIL_H
#define ZOPT_RUNTIME_BACKEND_OFFLOAD_TAIL_H

#include "backend/cuda/device.h"

#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

namespace zopt {

struct ParamsBack;

struct OffloadTail {
  bool pending = false;          // jobs queued by the last step, not joined
  std::vector<uint64_t> ticket;  // per bucket: its job's pipeline ticket
  double returned = 0;           // when the step returned (the stats' exposed time)
  std::mutex mu;                 // the first failure (jobs write it, the caller reads)
  zopt_status failed = ZOPT_OK;
  int failed_bucket = -1;
  std::string msg;
  GpuState *g = nullptr;   // for the join's retry of a failed copy
  ParamsBack *pb = nullptr;
  int si = -1;             // the param state
};

// Whether a pipelined step's UPDATE leaves its buckets to a tail: 1 rank,
// the params copied back, per-bucket mode.
bool tail_wanted(const zopt_optimizer *o, int mode, int back);
// At the UPDATE (params_back_begin done, the rows final): the jobs, in
// forward order; `si` the param state. Buckets that cannot be queued (out
// of memory) are updated here, after the queued ones.
zopt_status tail_queue(GpuState *g, ParamsBack &pb, OffloadTail &t, zopt_optimizer *o, int si);
// zopt_optimizer_wait_params while the tail runs: waits until bucket b's
// job has issued its copies and recorded its event; a failure of it or an
// earlier job joins the whole tail and is reported.
zopt_status tail_wait_bucket(OffloadTail &t, zopt_optimizer *o, int b, const char *fn);
// Waits for every job; the step's stats recorded, its speculation closed;
// a job's failure reported (ZOPT_ERR_INTERNAL naming the bucket and `fn`)
// after its copy was issued once more.
zopt_status tail_join(OffloadTail &t, zopt_optimizer *o, const char *fn);

}  // namespace zopt

#endif
