// gpu.cpp - the CUDA backend of the optimizer: steps whose states live on the
// GPU (abi.h "GPU kernels"). Driver API only, loaded at run time
// (cuda_driver.h); see docs/GPU.md for the design and what has been tested.
#include "gpu_internal.h"

#include <dlfcn.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <new>

using namespace zopt;
using namespace zopt::cu;


namespace {

constexpr unsigned kUpdateBlock = 256;
constexpr unsigned kPrepareBlock = 64;

#define CU_TRY(call, what)                                                                   \
  do {                                                                                       \
    CUresult r_ = (call);                                                                    \
    if (r_ != CUDA_SUCCESS) return fail(ZOPT_ERR_INTERNAL, "%s: %s", what, error_string(r_)); \
  } while (0)


zopt_status dalloc(GpuState *g, size_t bytes, CUdeviceptr *out, const char *what) {
  bytes = std::max<size_t>(bytes, 16);
  CUresult r = g->cu->MemAlloc(out, bytes);
  if (r != CUDA_SUCCESS)
    return fail(ZOPT_ERR_OUT_OF_MEMORY, "zopt_optimizer_finalize: cuMemAlloc(%zu bytes) for %s: %s", bytes, what,
                error_string(r));
  g->allocs.push_back(*out);
  return ZOPT_OK;
}

// Element alignment of segments inside a group's flat device buffers: the
// descriptor's `align`, and at least 16 bytes for every state dtype.
int64_t gpu_align(const zopt_step_descriptor *d) { return std::max<int64_t>(d->align, 8); }

}  // namespace

namespace zopt {

// The driver, a context (the caller's current one, e.g. PyTorch's, else
// device 0's primary context) and the device's properties.
zopt_status make_current(const GpuState *g) {
  CU_TRY(g->cu->CtxSetCurrent(g->ctx), "cuCtxSetCurrent");
  return ZOPT_OK;
}

zopt_status cuda_attach(GpuState *g, const char *name, const char *what) {
  const char *why = "";
  const Driver *cu = driver(&why);
  if (!cu) return fail(ZOPT_ERR_UNSUPPORTED, "step '%s' %s: %s", name, what, why);
  g->cu = cu;
  CUcontext cur = nullptr;
  if (cu->CtxGetCurrent(&cur) == CUDA_SUCCESS && cur) {
    g->ctx = cur;
    if (CUresult r = cu->CtxGetDevice(&g->dev)) return fail(ZOPT_ERR_INTERNAL, "cuCtxGetDevice: %s", error_string(r));
  } else {
    int n = 0;
    if (cu->DeviceGetCount(&n) != CUDA_SUCCESS || n < 1)
      return fail(ZOPT_ERR_UNSUPPORTED, "step '%s' %s: no CUDA device", name, what);
    if (CUresult r = cu->DeviceGet(&g->dev, 0)) return fail(ZOPT_ERR_INTERNAL, "cuDeviceGet: %s", error_string(r));
    if (CUresult r = cu->DevicePrimaryCtxRetain(&g->ctx, g->dev))
      return fail(ZOPT_ERR_INTERNAL, "cuDevicePrimaryCtxRetain: %s", error_string(r));
    g->retained = true;
    if (CUresult r = cu->CtxSetCurrent(g->ctx)) {
      cuda_detach(g);
      return fail(ZOPT_ERR_INTERNAL, "cuCtxSetCurrent: %s", error_string(r));
    }
  }
  int maj = 0, min = 0;
  cu->DeviceGetAttribute(&maj, ATTR_CC_MAJOR, g->dev);
  cu->DeviceGetAttribute(&min, ATTR_CC_MINOR, g->dev);
  cu->DeviceGetAttribute(&g->num_sms, ATTR_MULTIPROCESSOR_COUNT, g->dev);
  g->sm = maj * 10 + min;
  g->num_sms = std::max(g->num_sms, 1);
  return ZOPT_OK;
}

void cuda_detach(GpuState *g) {
  if (g->retained) g->cu->DevicePrimaryCtxRelease(g->dev);
  g->retained = false;
}

zopt_status gpu_check_pointers(const GpuState *g, void *param, void *grad) {
  if (zopt_status st = make_current(g)) return st;
  for (int i = 0; i < 2; ++i) {
    void *p = i ? grad : param;
    unsigned type = 0;
    CUresult r = g->cu->PointerGetAttribute(&type, POINTER_ATTRIBUTE_MEMORY_TYPE, (CUdeviceptr)(uintptr_t)p);
    if (r != CUDA_SUCCESS || (type != MEMORYTYPE_DEVICE && type != MEMORYTYPE_UNIFIED))
      return fail(ZOPT_ERR_INVALID_ARGUMENT,
                  "zopt_optimizer_add_tensor: %s pointer %p is not CUDA device memory (the step's %s are on the "
                  "GPU)",
                  i ? "grad" : "param", p, i ? "grads" : "params");
  }
  return ZOPT_OK;
}

bool gpu_enabled(const zopt_optimizer *o) { return o->gpu != nullptr; }

zopt_status gpu_create(zopt_optimizer *o) {
  const zopt_step *s = o->step;
  const zopt_step_descriptor *d = o->d;
  for (uint32_t i = 0; i < d->num_states; ++i)
    if (d->states[i].placement != ZOPT_PLACE_GPU)
      return fail(ZOPT_ERR_UNSUPPORTED,
                  "%s state '%s' is on the CPU: mixed CPU/GPU placement (offload) is not implemented by the CUDA "
                  "backend yet",
                  d->name, state_kind_name(d->states[i].kind));
  GpuState *g = new (std::nothrow) GpuState;
  if (!g) return fail(ZOPT_ERR_OUT_OF_MEMORY, "out of memory");
  if (zopt_status st = cuda_attach(g, d->name, "runs on the GPU")) {
    delete g;
    return st;
  }
  const Driver *cu = g->cu;
  auto bail = [&](zopt_status st) {
    if (g->mod) cu->ModuleUnload(g->mod);
    cuda_detach(g);
    delete g;
    return st;
  };
  // The image with the highest SM <= the device's.
  const char *image = nullptr;
  std::string have;
  for (uint32_t i = 0; i < d->num_kernels; ++i) {
    const zopt_kernel_desc &k = d->kernels[i];
    if (k.device != ZOPT_PLACE_GPU || k.role != ZOPT_KERNEL_GPU_IMAGE) continue;
    have += (have.empty() ? "sm_" : ", sm_") + std::to_string(k.isa);
    if ((int)k.isa <= g->sm && (int)k.isa > g->image_sm) {
      g->image_sm = (int)k.isa;
      image = k.symbol;
    }
  }
  if (!image)
    return bail(fail(ZOPT_ERR_UNSUPPORTED, "step '%s': no GPU image runs on this sm_%d device (step has %s)", d->name,
                     g->sm, have.c_str()));
  const void *bytes = dlsym(s->handle, image);
  if (!bytes) return bail(fail(ZOPT_ERR_ABI, "step '%s': GPU image '%s' not exported", d->name, image));
  if (CUresult r = cu->ModuleLoadData(&g->mod, bytes))
    return bail(fail(ZOPT_ERR_UNSUPPORTED, "step '%s': cuModuleLoadData(sm_%d image) on sm_%d: %s", d->name,
                     g->image_sm, g->sm, error_string(r)));
  for (uint32_t i = 0; i < d->num_kernels; ++i) {
    const zopt_kernel_desc &k = d->kernels[i];
    if (k.device != ZOPT_PLACE_GPU || k.role == ZOPT_KERNEL_GPU_IMAGE) continue;
    CUfunction *slot = k.role == ZOPT_KERNEL_PREPARE  ? &g->prepare
                       : k.role == ZOPT_KERNEL_SUMSQ  ? &g->sumsq
                       : k.role == ZOPT_KERNEL_FINISH ? &g->finish
                                                      : &g->update;
    if (CUresult r = cu->ModuleGetFunction(slot, g->mod, k.symbol))
      return bail(fail(ZOPT_ERR_ABI, "step '%s': kernel '%s' not in the GPU image: %s", d->name, k.symbol,
                       error_string(r)));
  }
  if (!g->prepare || !g->update || (!g->sumsq && (d->flags & ZOPT_FLAG_SUMSQ)))
    return bail(fail(ZOPT_ERR_ABI, "step '%s': GPU kernel table lacks PREPARE, UPDATE or SUMSQ", d->name));
  if (!g->finish)
    return bail(fail(ZOPT_ERR_ABI,
                     "step '%s': GPU kernel table lacks FINISH (compiled by an older zopt-compile: recompile the step)",
                     d->name));
  o->gpu = g;
  return ZOPT_OK;
}

zopt_status gpu_check_tensor(const zopt_optimizer *o, void *param, void *grad) {
  return gpu_check_pointers(o->gpu, param, grad);
}

zopt_status gpu_set_stream(zopt_optimizer *o, void *stream) {
  o->gpu->stream = (CUstream)stream;
  return ZOPT_OK;
}

zopt_status gpu_finalize(zopt_optimizer *o) {
  GpuState *g = o->gpu;
  const Driver *cu = g->cu;
  const zopt_step_descriptor *d = o->d;
  if (zopt_status st = make_current(g)) return st;
  const int64_t A = gpu_align(d);
  const int64_t max_n = layout_segments(o, A);
  int64_t total = 0;
  for (auto &gr : o->groups) total += gr.padded_total;
  CUstream s = g->stream;
  auto undo = [&](zopt_status st) {
    for (CUdeviceptr p : g->allocs) cu->MemFree(p);
    g->allocs.clear();
    for (auto &gr : o->groups)
      for (void *&b : gr.buffers) b = nullptr;
    return st;
  };
  // Flat state buffers per group, zero-filled (moments and padding).
  for (auto &gr : o->groups) {
    if (!gr.padded_total) continue;
    for (uint32_t k = 0; k < d->num_states; ++k) {
      if (!is_owned_kind(d->states[k].kind)) continue;
      size_t bytes = (size_t)gr.padded_total * dtype_size(d->states[k].dtype);
      CUdeviceptr p = 0;
      if (zopt_status st = dalloc(g, bytes, &p, state_kind_name(d->states[k].kind))) return undo(st);
      gr.buffers[k] = (void *)(uintptr_t)p;
      if (CUresult r = cu->MemsetD8Async(p, 0, bytes, s))
        return undo(fail(ZOPT_ERR_INTERNAL, "cuMemsetD8Async: %s", error_string(r)));
    }
  }
  // Master from the param: staged through the host once, widened there.
  const int pi = o->step->param_index;
  const uint32_t pdt = d->states[pi].dtype;
  for (uint32_t k = 0; k < d->num_states; ++k) {
    if (d->states[k].init != ZOPT_INIT_FROM_PARAM) continue;
    const uint32_t mdt = d->states[k].dtype;
    std::vector<unsigned char> src, dst;
    for (size_t t = 0; t < o->tensors.size(); ++t) {
      const Tensor &x = o->tensors[t];
      try {
        src.resize((size_t)x.numel * dtype_size(pdt));
        dst.resize((size_t)x.numel * dtype_size(mdt));
      } catch (...) {
        return undo(fail(ZOPT_ERR_OUT_OF_MEMORY, "zopt_optimizer_finalize: out of host memory"));
      }
      CUresult r = cu->MemcpyDtoHAsync(src.data(), (CUdeviceptr)(uintptr_t)x.param, src.size(), s);
      if (!r) r = cu->StreamSynchronize(s);
      if (r) return undo(fail(ZOPT_ERR_INTERNAL, "finalize: reading param %zu: %s", t, error_string(r)));
      convert(src.data(), pdt, dst.data(), mdt, x.numel);
      r = cu->MemcpyHtoDAsync((CUdeviceptr)(uintptr_t)state_ptr(o, (int)t, (int)k), dst.data(), dst.size(), s);
      if (!r) r = cu->StreamSynchronize(s);
      if (r) return undo(fail(ZOPT_ERR_INTERNAL, "finalize: writing master %zu: %s", t, error_string(r)));
    }
  }
  // Tables: one segment per tensor.
  const size_t G = o->groups.size(), S = o->tensors.size(), NS = d->num_states;
  std::vector<uint64_t> ptrs(S * NS, 0);
  std::vector<zopt_gpu_segment> segs(S);
  for (size_t t = 0; t < S; ++t) {
    for (size_t k = 0; k < NS; ++k) ptrs[t * NS + k] = (uint64_t)(uintptr_t)state_ptr(o, (int)t, (int)k);
    segs[t].n = o->tensors[t].numel;
    segs[t].group = (uint32_t)o->tensors[t].group;
    segs[t].tensor = (uint32_t)t;
  }
  g->num_segments = (int64_t)S;
  g->h_hypers.assign(std::max<size_t>(G * d->num_hypers, 1), 0.0);
  const int64_t per_block = (int64_t)kUpdateBlock * 8;
  g->update_grid = (unsigned)std::clamp<int64_t>((max_n + per_block - 1) / per_block, 1, (int64_t)g->num_sms * 8);
  g->sumsq_grid = (unsigned)std::clamp<int64_t>((total + per_block - 1) / per_block, 1,
                                                std::min<int64_t>((int64_t)g->num_sms * 4, ZOPT_GPU_MAX_BLOCKS));
  g->prepare_grid = (unsigned)((G + kPrepareBlock - 1) / kPrepareBlock);
  zopt_status st = ZOPT_OK;
  if ((st = dalloc(g, ptrs.size() * 8, &g->d_states, "state table")) ||
      (st = dalloc(g, segs.size() * sizeof(zopt_gpu_segment), &g->d_segs, "segment table")) ||
      (st = dalloc(g, g->h_hypers.size() * 8, &g->d_hypers, "hyperparameter table")) ||
      (st = dalloc(g, G * ZOPT_NUM_GLOBALS * 8, &g->d_globals, "globals table")) ||
      (st = dalloc(g, G * std::max<uint32_t>(d->num_coeffs, 1) * 4, &g->d_coeffs, "coefficient table")) ||
      (st = dalloc(g, (size_t)g->sumsq_grid * 8, &g->d_partials, "norm partials")) ||
      (st = dalloc(g, sizeof(zopt_gpu_step_globals), &g->d_sg, "step globals")) ||
      (st = dalloc(g, sizeof(zopt_gpu_scaler), &g->d_scaler, "loss scaler")))
    return undo(st);
  CUresult r = cu->MemcpyHtoDAsync(g->d_states, ptrs.data(), ptrs.size() * 8, s);
  if (!r) r = cu->MemcpyHtoDAsync(g->d_segs, segs.data(), segs.size() * sizeof(zopt_gpu_segment), s);
  if (!r) r = cu->MemsetD8Async(g->d_sg, 0, sizeof(zopt_gpu_step_globals), s);
  if (!r) r = cu->MemsetD8Async(g->d_partials, 0, (size_t)g->sumsq_grid * 8, s);
  if (!r) r = cu->StreamSynchronize(s);
  if (r) return undo(fail(ZOPT_ERR_INTERNAL, "zopt_optimizer_finalize: building device tables: %s", error_string(r)));
  g->hypers_dirty = true;
  g->device_ahead = false;
  if (zopt_status st2 = gpu_push(o)) return undo(st2);
  return ZOPT_OK;
}

zopt_status gpu_push(zopt_optimizer *o) {
  GpuState *g = o->gpu;
  if (!g->d_globals) return ZOPT_OK;  // not finalized: finalize pushes
  if (zopt_status st = make_current(g)) return st;
  const zopt_step_descriptor *d = o->d;
  const bool ls = d->flags & ZOPT_FLAG_LOSS_SCALE;
  const double S = ls ? o->scaler.scale : 1.0;
  std::vector<double> globals(o->groups.size() * ZOPT_NUM_GLOBALS);
  for (size_t gi = 0; gi < o->groups.size(); ++gi) {
    double *gl = &globals[gi * ZOPT_NUM_GLOBALS];
    gl[ZOPT_GLOBAL_STEP] = (double)(o->groups[gi].step_count + 1);
    gl[ZOPT_GLOBAL_CLIP_COEF] = 1.0;
    gl[ZOPT_GLOBAL_GRAD_SCALE] = 1.0 / (S * grad_divisor(o));
  }
  zopt_gpu_scaler sc;
  memset(&sc, 0, sizeof sc);
  sc.scale = S;
  sc.last_scale = S;
  sc.growth_factor = o->scaler.cfg.growth_factor;
  sc.backoff_factor = o->scaler.cfg.backoff_factor;
  sc.min_scale = o->scaler.cfg.min_scale;
  sc.growth_interval = o->scaler.cfg.growth_interval;
  sc.good_steps = o->scaler.good_steps;
  sc.dynamic = ls && o->scaler.cfg.dynamic ? 1u : 0u;
  sc.grad_divisor = grad_divisor(o);
  CUresult r = g->cu->MemcpyHtoDAsync(g->d_globals, globals.data(), globals.size() * 8, g->stream);
  if (!r) r = g->cu->MemcpyHtoDAsync(g->d_scaler, &sc, sizeof sc, g->stream);
  if (!r) r = g->cu->StreamSynchronize(g->stream);
  if (r) return fail(ZOPT_ERR_INTERNAL, "writing the GPU step state: %s", error_string(r));
  g->device_ahead = false;
  return ZOPT_OK;
}

// Reads the device's step state (globals, scaler, and the step globals when
// `sg` is given) with one stream synchronisation and refreshes the host
// copies in `o` (step counts, scaler).
static zopt_status read_device_state(zopt_optimizer *o, zopt_gpu_step_globals *sg, zopt_gpu_scaler *sc) {
  GpuState *g = o->gpu;
  if (zopt_status st = make_current(g)) return st;
  std::vector<double> globals(o->groups.size() * ZOPT_NUM_GLOBALS);
  CUresult r = g->cu->MemcpyDtoHAsync(globals.data(), g->d_globals, globals.size() * 8, g->stream);
  if (!r) r = g->cu->MemcpyDtoHAsync(sc, g->d_scaler, sizeof *sc, g->stream);
  if (!r && sg) r = g->cu->MemcpyDtoHAsync(sg, g->d_sg, sizeof *sg, g->stream);
  if (!r) r = g->cu->StreamSynchronize(g->stream);
  if (r) return fail(ZOPT_ERR_INTERNAL, "reading the GPU step state: %s", error_string(r));
  for (size_t gi = 0; gi < o->groups.size(); ++gi)
    o->groups[gi].step_count = (int64_t)globals[gi * ZOPT_NUM_GLOBALS + ZOPT_GLOBAL_STEP] - 1;
  if (o->d->flags & ZOPT_FLAG_LOSS_SCALE) {
    o->scaler.scale = sc->scale;
    o->scaler.good_steps = sc->good_steps;
  }
  g->device_ahead = false;
  return ZOPT_OK;
}

zopt_status gpu_pull(zopt_optimizer *o) {
  if (!o->gpu->device_ahead) return ZOPT_OK;
  zopt_gpu_scaler sc;
  return read_device_state(o, nullptr, &sc);
}

void gpu_hypers_changed(zopt_optimizer *o) { o->gpu->hypers_dirty = true; }

zopt_status gpu_step(zopt_optimizer *o, zopt_step_result *result) {
  GpuState *g = o->gpu;
  const Driver *cu = g->cu;
  const zopt_step_descriptor *d = o->d;
  if (zopt_status st = make_current(g)) return st;
  const bool has_sumsq = d->flags & ZOPT_FLAG_SUMSQ;
  const bool ls = d->flags & ZOPT_FLAG_LOSS_SCALE;
  const size_t G = o->groups.size(), H = d->num_hypers;
  CUstream s = g->stream;
  if (g->hypers_dirty) {
    // Only when a hyperparameter changed. A pageable source: the driver
    // stages it before returning, so h_hypers may be rewritten at once.
    for (size_t gi = 0; gi < G; ++gi)
      for (size_t h = 0; h < H; ++h) g->h_hypers[gi * H + h] = o->groups[gi].hypers[h];
    CU_TRY(cu->MemcpyHtoDAsync(g->d_hypers, g->h_hypers.data(), g->h_hypers.size() * 8, s),
           "cuMemcpyHtoDAsync(hypers)");
    g->hypers_dirty = false;
  }
  int64_t ng = (int64_t)G, nseg = g->num_segments;
  CUdeviceptr no_ptr = 0;
  {
    void *args[] = {&g->d_hypers, &g->d_globals, &ng, &g->d_coeffs};
    CU_TRY(cu->LaunchKernel(g->prepare, g->prepare_grid, 1, 1, kPrepareBlock, 1, 1, 0, s, args, nullptr),
           "launching PREPARE");
  }
  if (has_sumsq) {
    void *args[] = {&g->d_states, &g->d_segs, &nseg, &g->d_coeffs, &g->d_partials,
                    &g->d_sg,     &g->d_hypers, &g->d_globals, &ng};
    CU_TRY(cu->LaunchKernel(g->sumsq, g->sumsq_grid, 1, 1, ZOPT_GPU_BLOCK, 1, 1, 0, s, args, nullptr),
           "launching SUMSQ");
  }
  {
    // Stochastic rounding: the device's globals (step t) and the seed too.
    uint64_t seed = o->seed;
    void *args[] = {&g->d_states, &g->d_segs, &nseg, &g->d_coeffs, has_sumsq ? &g->d_sg : &no_ptr,
                    &g->d_globals, &seed};
    CU_TRY(cu->LaunchKernel(g->update, g->update_grid, 1, 1, kUpdateBlock, 1, 1, 0, s, args, nullptr),
           "launching UPDATE");
  }
  {
    void *args[] = {&g->d_globals, &ng, has_sumsq ? &g->d_sg : &no_ptr, ls ? &g->d_scaler : &no_ptr};
    CU_TRY(cu->LaunchKernel(g->finish, 1, 1, 1, 32, 1, 1, 0, s, args, nullptr), "launching FINISH");
  }
  g->stepped = true;
  g->device_ahead = true;
  if (result) {  // on the device: zopt_optimizer_gpu_result reads it
    result->grad_norm = NAN;
    result->skipped = 0;
    result->loss_scale = NAN;
  }
  return ZOPT_OK;
}

zopt_status gpu_result(zopt_optimizer *o, zopt_step_result *result) {
  GpuState *g = o->gpu;
  if (!g->stepped) return fail(ZOPT_ERR_BAD_STATE, "zopt_optimizer_gpu_result: no step has run yet");
  zopt_gpu_step_globals sg;
  zopt_gpu_scaler sc;
  if (zopt_status st = read_device_state(o, &sg, &sc)) return st;
  const bool has_sumsq = o->d->flags & ZOPT_FLAG_SUMSQ;
  result->grad_norm = has_sumsq ? sg.norm : NAN;
  result->skipped = has_sumsq && sg.skip != 0;
  result->loss_scale = (o->d->flags & ZOPT_FLAG_LOSS_SCALE) ? sc.last_scale : 1.0;
  return ZOPT_OK;
}

zopt_status gpu_copy(const zopt_optimizer *o, int t, int si, void *host, size_t bytes, bool to_device) {
  GpuState *g = o->gpu;
  if (zopt_status st = make_current(g)) return st;
  CUdeviceptr p = (CUdeviceptr)(uintptr_t)state_ptr(o, t, si);
  CUresult r = to_device ? g->cu->MemcpyHtoDAsync(p, host, bytes, g->stream)
                         : g->cu->MemcpyDtoHAsync(host, p, bytes, g->stream);
  if (!r) r = g->cu->StreamSynchronize(g->stream);
  if (r) return fail(ZOPT_ERR_INTERNAL, "copying GPU state %s of tensor %d: %s", state_kind_name(o->d->states[si].kind), t,
                     error_string(r));
  return ZOPT_OK;
}

void gpu_free(zopt_optimizer *o) {
  GpuState *g = o->gpu;
  if (!g) return;
  if (g->cu->CtxSetCurrent(g->ctx) == CUDA_SUCCESS) {
    g->cu->StreamSynchronize(g->stream);
    for (CUdeviceptr p : g->allocs) g->cu->MemFree(p);
    if (g->mod) g->cu->ModuleUnload(g->mod);
  }
  for (auto &gr : o->groups)
    for (void *&b : gr.buffers) b = nullptr;
  cuda_detach(g);
  delete g;
  o->gpu = nullptr;
}

}  // namespace zopt

extern "C" {

ZOPT_API zopt_status zopt_optimizer_set_stream(zopt_optimizer *o, void *cu_stream) {
  if (!o) return fail(ZOPT_ERR_INVALID_ARGUMENT, "zopt_optimizer_set_stream: optimizer is NULL");
  if (o->offload) return offload_set_stream(o, cu_stream);
  if (!o->gpu)
    return fail(ZOPT_ERR_BAD_STATE, "zopt_optimizer_set_stream: step '%s' has nothing on the GPU", o->d->name);
  return gpu_set_stream(o, cu_stream);
}

ZOPT_API zopt_status zopt_optimizer_gpu_result(zopt_optimizer *o, zopt_step_result *result) {
  if (!o) return fail(ZOPT_ERR_INVALID_ARGUMENT, "zopt_optimizer_gpu_result: optimizer is NULL");
  if (!result) return fail(ZOPT_ERR_INVALID_ARGUMENT, "zopt_optimizer_gpu_result: result is NULL");
  if (!o->gpu) return fail(ZOPT_ERR_BAD_STATE, "zopt_optimizer_gpu_result: step '%s' does not run on the GPU", o->d->name);
  return gpu_result(o, result);
}

}  // extern "C"
