// backend/offload/tail.h - the asynchronous tail of a pipelined offloaded
// step in per-bucket mode (docs/GPU.md "Params back early").
//
// This file owns the part of such a step that runs after
// zopt_optimizer_step has returned: per bucket, in forward order (the last
// bucket first), one job on the optimizer's pipeline thread that commits
// or recomputes the bucket's update (exec/speculate.h), at W ranks then
// gathers the bucket's params from every rank (the program's ALL_GATHER
// restricted to the bucket: the layout shards each bucket across the
// ranks, so the bucket's gather needs no other bucket; every rank queues
// its jobs in the same order, so the collectives pair up), and then copies
// its params back with its event (params_back.h); the last job records
// `staging`. The step itself ends once its outcome is decided (norm, clip
// coefficient, skip, loss scale, counts: FINISH ran). zopt_optimizer_wait_params
// waits for one bucket's job (tail_wait_bucket); every other API call joins
// the whole tail first (join_tail from CallHold, internal.h: tail_join),
// which reports a job's failure, naming its bucket, once. A job never
// fails in the pipeline's sense: a failure is recorded here and the later
// buckets still update, so the states stay whole. A failed copy: the join
// issues the failed bucket's copy once more (the params on the GPU are the
// step's if that succeeds, whatever the step reads next) and reports both.
// A failed gather (a rank died or disagreed: the communicator's error,
// which names the rank, and poisons it as every collective failure does,
// docs/COMM.md): that bucket's params are not copied back (the staging
// holds only this rank's shard of the step), the later buckets' gathers
// fail at once on the poisoned communicator, and the join reports it.
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
  int gather = -1;         // W ranks: the program's ALL_GATHER of the params (op index), else -1
  bool gather_failed = false;  // the first failure was a bucket's gather
};

// Whether a pipelined step's UPDATE leaves its buckets to a tail: the
// params copied back, per-bucket mode.
bool tail_wanted(int mode, int back);
// At the UPDATE (params_back_begin done, the rows final): the jobs, in
// forward order; `si` the param state, `gather` the program's ALL_GATHER
// of it at W ranks (op index; -1: none). Buckets that cannot be queued
// (out of memory) are updated here, after the queued ones.
zopt_status tail_queue(GpuState *g, ParamsBack &pb, OffloadTail &t, zopt_optimizer *o, int si, int gather);
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
