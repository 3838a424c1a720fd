// backend/offload/params_back.h - an offloaded step's params back on the
// GPU (docs/GPU.md "Params back early").
//
// This file owns the copies of the updated params from the pinned staging
// to the user's device memory: on a copy stream of the optimizer's own
// (non-blocking, made with the offload state), bucket by bucket in forward
// order (the last bucket first), each bucket followed by its own event; the
// stream waits first for the caller's work enqueued on the optimizer's
// stream before the step (it may read the params being overwritten). After
// the last bucket the `staging` event is recorded on the copy stream, so
// everything the runtime does next (gpu_wait_own_work: the next step's
// copies, host accesses, set_stream, free) waits for every copy. The wait
// mode (zopt_optimizer_set_param_wait) says whether the optimizer's stream
// itself then waits for them (ALL, the default) or the caller waits per
// bucket (zopt_optimizer_wait_params). At W ranks the same, after the
// program's ALL_GATHER (serial) or each bucket's gather (the tail, tail.h).
#ifndef ZOPT_RUNTIME_BACKEND_OFFLOAD_PARAMS_BACK_H
#define ZOPT_RUNTIME_BACKEND_OFFLOAD_PARAMS_BACK_H

#include "backend/cuda/device.h"

#include <vector>

namespace zopt {

struct ParamsBack {
  CUstream stream = nullptr;  // the copy stream
  CUevent before = nullptr;   // on the optimizer's stream before a step's first copy back
  // Per bucket: its event, recorded after its copies (kept across layouts;
  // made as needed), and whether it was recorded in the layout `extent`
  // describes (the tensors' count, then each bucket's group, begin, len:
  // a rebuilt layout moves params between buckets).
  std::vector<CUevent> events;
  std::vector<uint8_t> recorded;
  std::vector<int64_t> extent;
  int mode = 0;                 // ZOPT_PARAM_WAIT_*
  bool open = false;            // between begin and end
};

// With the offload state (its context current): the copy stream and the
// `before` event.
zopt_status params_back_init(GpuState *g, ParamsBack &pb);
// A step's copies back: begin (the copy stream after the caller's work on
// the optimizer's stream), bucket b's params (state si) then its event,
// end (`staging` after the last; mode ALL: the optimizer's stream waits
// for it). A failed copy records `staging` behind what was issued.
zopt_status params_back_begin(GpuState *g, ParamsBack &pb, const zopt_optimizer *o);
zopt_status params_back_bucket(GpuState *g, ParamsBack &pb, const zopt_optimizer *o, int b, int si);
zopt_status params_back_end(GpuState *g, ParamsBack &pb);
// All of it in forward order (the serial step's COPY of the params).
zopt_status params_back_all(GpuState *g, ParamsBack &pb, const zopt_optimizer *o, int si);
// zopt_optimizer_wait_params (bucket checked): `stream` (NULL: the
// optimizer's) waits for bucket b's event (for `staging` when the bucket's
// extent changed since).
zopt_status params_back_wait(GpuState *g, ParamsBack &pb, const zopt_optimizer *o, int b, void *stream);
// Waits for the copies, then destroys the stream and the events.
void params_back_free(GpuState *g, ParamsBack &pb);

}  // namespace zopt

#endif
