// backend/offload/offload.h - the offload backend: the CPU backend with the
// user's params and grads in device memory.
//
// runtime/src/backend/offload/ owns ZeRO-Offload steps: the optimizer
// states and the update on the CPU (backend/cpu), the params and grads on
// the GPU, staged through pinned host buffers by the program's COPY ops on
// the optimizer's stream (the device's driver, context and events:
// backend/cuda/device.h); with bucket readiness, per bucket and overlapped
// with backward (pipeline.h); the params back on the GPU per bucket in
// forward order on a copy stream, with an event per bucket (params_back.h).
#ifndef ZOPT_RUNTIME_BACKEND_OFFLOAD_H
#define ZOPT_RUNTIME_BACKEND_OFFLOAD_H

#include "internal.h"

namespace zopt {

class Backend;
// A step with only its params and grads on the GPU (and no GPU code).
bool is_offload_step(const zopt_step *s);
// The driver and a context (refused with a message when there is none, or
// when the step cannot be offloaded: params and grads not both on the GPU,
// ZeRO-3).
zopt_status make_offload_backend(zopt_optimizer *o, Backend **out);

}  // namespace zopt

#endif
