// backend/offload/pipeline.h - the offload pipeline: bucket readiness for
// offloaded steps (zopt_optimizer_grad_bucket_ready; docs/GPU.md "Offloaded
// steps: bucket readiness and speculation").
//
// This file owns the device side of a pipelined offloaded step: per bucket
// an asynchronous copy of its grads (and params, where the program copies
// them) into the pinned staging on the optimizer's stream, an event, and a
// job on the optimizer's pipeline thread that waits for the event and runs
// the bucket's CPU work (exec/speculate.h); at the step the program's ops
// with the copies already done, the update bucket by bucket (commit or
// recompute), each bucket's params copied back as soon as it is final.
#ifndef ZOPT_RUNTIME_BACKEND_OFFLOAD_PIPELINE_H
#define ZOPT_RUNTIME_BACKEND_OFFLOAD_PIPELINE_H

#include "backend/cuda/device.h"

#include <vector>

namespace zopt {
namespace exec {
struct StepState;
}

struct ParamsBack;
struct OffloadTail;

struct OffloadPipe {
  std::vector<CUevent> events;  // per bucket (made at its first readiness)
};

// State si (PARAM or GRAD) of bucket b between the device and its staging,
// asynchronously on `stream`: one copy per tensor piece.
zopt_status offload_copy_bucket(GpuState *g, const zopt_optimizer *o, int b, int si, bool to_device, CUstream stream);
// zopt_optimizer_grad_bucket_ready.
zopt_status offload_bucket_ready(GpuState *g, OffloadPipe &pp, zopt_optimizer *o, int b);
// Whether a pipelined step is under way (some bucket marked ready).
bool offload_pipelined(const zopt_optimizer *o);
// The step's checks before its first op: every bucket marked ready, the
// stream not capturing (the step's copies back need the host's update).
zopt_status offload_pipelined_begin(GpuState *g, zopt_optimizer *o);
// Program op i of a pipelined step; *handled false: the host executor's.
// At 1 rank the params go back through `pb` (params_back.h): bucket by
// bucket in forward order, each as soon as it is final; in per-bucket mode
// that work (at W ranks with each bucket's ALL_GATHER of the params before
// its copy) is left to `tail` (tail.h), after the step returns.
zopt_status offload_pipelined_op(GpuState *g, ParamsBack &pb, OffloadTail &tail, zopt_optimizer *o,
                                 exec::StepState *st, size_t i, bool *handled);
// After the last op (after the tail, where there is one): the outcome
// recorded (`end`: when the step returned, for the exposed time), the
// step closed.
void offload_pipelined_end(zopt_optimizer *o, bool skipped, double end);
// The events (context current or not).
void offload_pipe_free(GpuState *g, OffloadPipe &pp);

}  // namespace zopt

#endif
