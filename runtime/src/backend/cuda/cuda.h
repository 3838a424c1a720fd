// backend/cuda/cuda.h - the CUDA backend: every state in device memory.
//
// runtime/src/backend/cuda/ owns what runs a step on an NVIDIA GPU through
// the driver API, loaded at run time (cuda_driver.h: no build or link
// dependency on CUDA): the driver table, contexts, events and streams the
// CUDA backends share (device.h; the offload backend uses them too), and
// the backend of steps whose states live on the GPU (cuda.cpp over the
// parts cuda_internal.h lists: the step's image and kernels, module.cpp;
// the device tables of segments, work list, hyperparameters, globals and
// scaler, tables.cpp; the program's ops as launches on the optimizer's
// stream, launch.cpp; abi.h "GPU kernels", docs/GPU.md).
#ifndef ZOPT_RUNTIME_BACKEND_CUDA_H
#define ZOPT_RUNTIME_BACKEND_CUDA_H

#include "internal.h"

namespace zopt {

class Backend;
// The driver, a context, the step's image and kernels (refused with a
// message when there is no driver, device or image that runs here).
zopt_status make_cuda_backend(zopt_optimizer *o, Backend **out);

}  // namespace zopt

#endif
