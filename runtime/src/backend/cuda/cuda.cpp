// backend/cuda/cuda.cpp - the CUDA backend (cuda.h): steps whose states
// live on the GPU (abi.h "GPU kernels"). Driver API only, loaded at run
// time (cuda_driver.h); the program's ops are kernel launches on the
// optimizer's stream. See docs/GPU.md for the design and what has been
// tested.
#include "backend/cuda/cuda.h"

#include "backend/backend.h"
#include "backend/cuda/device.h"
#include "exec/exec.h"

#include <dlfcn.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <new>

using namespace zopt;
using namespace zopt::cu;

namespace {

// "13.0" for 13000.
std::string cuda_version_str(int v) { return std::to_string(v / 1000) + "." + std::to_string(v % 1000 / 10); }

zopt_status dalloc(GpuState *g, size_t bytes, CUdeviceptr *out, const char *what) {
  bytes = std::max<size_t>(bytes, 16);
  if (g->allocator.alloc) {
    g->alloc_stream = g->stream;
    void *p = g->allocator.alloc(g->allocator.user, bytes, g->alloc_stream);
    if (!p)
      return fail(ZOPT_ERR_OUT_OF_MEMORY,
                  "zopt_optimizer_finalize: the caller's device allocator returned NULL for %zu bytes (%s)", bytes,
                  what);
    if ((uintptr_t)p % 256) {
      g->allocator.free(g->allocator.user, p, bytes, g->alloc_stream);
      return fail(ZOPT_ERR_INVALID_ARGUMENT,
                  "zopt_optimizer_finalize: the caller's device allocator returned %p for %s, not 256-byte aligned",
                  p, what);
    }
    *out = (CUdeviceptr)(uintptr_t)p;
  } else {
    CUresult r = g->cu->MemAlloc(out, bytes);
    if (r != CUDA_SUCCESS)
      return fail(ZOPT_ERR_OUT_OF_MEMORY,
                  "zopt_optimizer_finalize: cuMemAlloc(%zu bytes) for %s: %s (device memory comes from cuMemAlloc, "
                  "outside the caching allocator of PyTorch: torch.cuda.empty_cache() returns its cached blocks, or "
                  "pass torch's allocator: zopt_optimizer_set_device_allocator)",
                  bytes, what, error_string(r));
  }
  g->allocs.emplace_back(*out, bytes);
  return ZOPT_OK;
}

void dfree_all(GpuState *g) {
  for (auto &a : g->allocs) {
    if (g->allocator.free) g->allocator.free(g->allocator.user, (void *)(uintptr_t)a.first, a.second, g->alloc_stream);
    else g->cu->MemFree(a.first);
  }
  g->allocs.clear();
}

// Element alignment of segments inside a group's flat device buffers: the
// descriptor's `align`, and at least 16 bytes for every state dtype.
int64_t gpu_align(const zopt_step_descriptor *d) { return std::max<int64_t>(d->align, 8); }

// The GPU layout of every group's flat buffers (Tensor::offset,
// Group::padded_total): each tensor's segment starts at a multiple of the
// alignment plus a phase (< 16 bytes) that gives its owned states the
// 16-byte alignment phase of its param, so that when the param is a view
// at an odd element offset (a flat buffer of DeepSpeed or FSDP) the kernels
// still find one element where every pointer is 16-byte aligned (abi.h:
// scalar head, vector middle, scalar tail). Returns the largest numel.
int64_t gpu_layout(zopt_optimizer *o) {
  const zopt_step_descriptor *d = o->d;
  const int64_t A = gpu_align(d);
  const size_t ep = dtype_size(d->states[o->step->param_index].dtype);
  size_t eo = 4;  // the narrowest owned state
  for (uint32_t k = 0; k < d->num_states; ++k)
    if (is_owned_kind(d->states[k].kind)) eo = std::min(eo, dtype_size(d->states[k].dtype));
  const int64_t lanes = (int64_t)(16 / eo);
  int64_t max_n = 0;
  for (auto &gr : o->groups) {
    int64_t off = 0;
    for (int t : gr.tensors) {
      Tensor &x = o->tensors[t];
      const uintptr_t p = (uintptr_t)x.param;
      const int64_t head = p % ep ? 0 : (int64_t)((16 - p % 16) % 16 / ep);  // param elements to 16 bytes
      const int64_t phase = (lanes - head % lanes) % lanes;
      x.offset = (off + A - 1) / A * A + phase;
      off = x.offset + x.numel;
      max_n = std::max(max_n, x.numel);
    }
    gr.padded_total = (off + A - 1) / A * A;
  }
  return max_n;
}

// Elements per chunk of the work list: a power of two (so that no chunk
// straddles a multiple of 2^32 elements), 65536 for big models, smaller
// until there are `target` chunks (at least 4096). ZOPT_GPU_CHUNK overrides
// it (a power of two in [64, 2^30]: tests).
zopt_status pick_chunk(const zopt_optimizer *o, int64_t target, int64_t *out) {
  if (const char *e = getenv("ZOPT_GPU_CHUNK"); e && *e) {
    char *end = nullptr;
    long long v = strtoll(e, &end, 10);
    if (*end || v < 64 || v > (1ll << 30) || (v & (v - 1)))
      return fail(ZOPT_ERR_INVALID_ARGUMENT, "ZOPT_GPU_CHUNK=%s: expected a power of two in [64, 2^30]", e);
    *out = v;
    return ZOPT_OK;
  }
  auto count = [&](int64_t c) {
    int64_t k = 0;
    for (const Tensor &x : o->tensors) k += (x.numel + c - 1) / c;
    return k;
  };
  int64_t c = 1 << 16;
  while (c > 4096 && count(c) < target) c /= 2;
  *out = c;
  return ZOPT_OK;
}

// The parameter list of a kernel (count, every one 8 bytes) against the
// image's, when the driver can tell (cuFuncGetParamInfo, CUDA 12.4+).
zopt_status check_params(const GpuState *g, CUfunction f, const char *name, size_t want, const char *step) {
  if (!g->cu->FuncGetParamInfo) return ZOPT_OK;
  std::vector<size_t> sizes;
  size_t off = 0, size = 0;
  while (sizes.size() < 64 && g->cu->FuncGetParamInfo(f, sizes.size(), &off, &size) == CUDA_SUCCESS)
    sizes.push_back(size);
  bool ok = sizes.size() == want;
  std::string list;
  for (size_t z : sizes) {
    ok &= z == 8;
    list += (list.empty() ? "" : ", ") + std::to_string(z);
  }
  if (!ok)
    return fail(ZOPT_ERR_ABI,
                "step '%s': GPU kernel '%s' takes %zu parameters (%s bytes), this runtime passes %zu of 8 bytes "
                "(abi.h \"GPU kernels\"; compiled by another zopt-compile? recompile the step)",
                step, name, sizes.size(), list.empty() ? "none" : list.c_str(), want);
  return ZOPT_OK;
}

// Blocks of `block` threads of f that fit on one SM (at least 1), after
// checking that f may be launched with `block` threads (its .reqntid).
zopt_status occupancy(const GpuState *g, CUfunction f, const char *name, int block, int *per_sm, const char *step) {
  int max_threads = 0;
  if (CUresult r = g->cu->FuncGetAttribute(&max_threads, FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK, f))
    return fail(ZOPT_ERR_INTERNAL, "cuFuncGetAttribute(%s): %s", name, error_string(r));
  if (max_threads < block)
    return fail(ZOPT_ERR_ABI,
                "step '%s': GPU kernel '%s' allows %d threads per block, abi.h launches it with %d (compiled by "
                "another zopt-compile? recompile the step)",
                step, name, max_threads, block);
  int n = 0;
  if (per_sm) {
    if (CUresult r = g->cu->OccupancyMaxActiveBlocksPerMultiprocessor(&n, f, block, 0))
      return fail(ZOPT_ERR_INTERNAL, "cuOccupancyMaxActiveBlocksPerMultiprocessor(%s): %s", name, error_string(r));
    if (n < 1)
      return fail(ZOPT_ERR_UNSUPPORTED, "step '%s': GPU kernel '%s' cannot run %d threads per block on this sm_%d device",
                  step, name, block, g->sm);
    *per_sm = n;
  }
  return ZOPT_OK;
}

}  // namespace

namespace zopt {

// ---- the optimizer's GPU backend ---------------------------------------------

class CudaBackend;
static GpuState *G(const zopt_optimizer *o);
static zopt_status load_module(GpuState *g, const zopt_step *s);
static zopt_status gpu_push(zopt_optimizer *o);

static zopt_status gpu_create(zopt_optimizer *o, GpuState **out) {
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
  zopt_status st;
  {
    CtxScope scope(g);
    st = scope.status();
    if (!st) st = load_module(g, s);
    if (st) {
      if (!scope.status() && g->mod) g->cu->ModuleUnload(g->mod);
      if (!scope.status()) destroy_events(g);
    }
  }
  if (st) {
    cuda_detach(g);
    delete g;
    return st;
  }
  *out = g;
  return ZOPT_OK;
}

// The image for this device, its kernels (parameters, block sizes,
// occupancy) and the events; the optimizer's context is current.
static zopt_status load_module(GpuState *g, const zopt_step *s) {
  const zopt_step_descriptor *d = &s->desc;
  const Driver *cu = g->cu;
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
    return fail(ZOPT_ERR_UNSUPPORTED, "step '%s': no GPU image runs on this sm_%d device (step has %s)", d->name,
                g->sm, have.c_str());
  const void *bytes = dlsym(s->handle, image);
  if (!bytes) return fail(ZOPT_ERR_ABI, "step '%s': GPU image '%s' not exported", d->name, image);
  // The driver must know the toolkit's CUDA version: a cubin of CUDA N needs
  // a driver of CUDA N.0 or newer.
  const std::string tk_sym = std::string(image) + "_cuda_version";
  if (const uint32_t *v = (const uint32_t *)dlsym(s->handle, tk_sym.c_str())) g->image_cuda_version = *v;
  const int need = (int)(g->image_cuda_version / 1000 * 1000);
  if (need && g->driver_version < need)
    return fail(ZOPT_ERR_UNSUPPORTED,
                "step '%s' was built by CUDA toolkit %s (sm_%d cubin + PTX), but the CUDA driver supports CUDA %s "
                "(cuDriverGetVersion = %d): CUDA %d binaries need a CUDA %d.0 driver or newer (R%d or newer). "
                "Update the driver, or compile the step with an older toolkit (zopt-compile --cuda-path)",
                d->name, cuda_version_str((int)g->image_cuda_version).c_str(), g->image_sm,
                cuda_version_str(g->driver_version).c_str(), g->driver_version, need / 1000, need / 1000,
                need >= 13000 ? 580 : 525);
  if (CUresult r = cu->ModuleLoadData(&g->mod, bytes))
    return fail(ZOPT_ERR_UNSUPPORTED,
                "step '%s': cuModuleLoadData(sm_%d image, built by CUDA %s) on sm_%d with a CUDA %s driver: %s",
                d->name, g->image_sm,
                g->image_cuda_version ? cuda_version_str((int)g->image_cuda_version).c_str() : "(unknown)",
                g->sm, cuda_version_str(g->driver_version).c_str(), error_string(r));
  g->sr = d->flags & ZOPT_FLAG_STOCHASTIC;
  for (uint32_t i = 0; i < d->num_kernels; ++i) {
    const zopt_kernel_desc &k = d->kernels[i];
    if (k.device != ZOPT_PLACE_GPU || k.role == ZOPT_KERNEL_GPU_IMAGE) continue;
    CUfunction *slot = k.role == ZOPT_KERNEL_PREPARE  ? &g->prepare
                       : k.role == ZOPT_KERNEL_SUMSQ  ? &g->sumsq
                       : k.role == ZOPT_KERNEL_FINISH ? &g->finish
                                                      : &g->update;
    if (CUresult r = cu->ModuleGetFunction(slot, g->mod, k.symbol))
      return fail(ZOPT_ERR_ABI, "step '%s': kernel '%s' not in the GPU image: %s", d->name, k.symbol,
                  error_string(r));
    const size_t nparams = k.role == ZOPT_KERNEL_PREPARE  ? 6
                           : k.role == ZOPT_KERNEL_SUMSQ  ? 12
                           : k.role == ZOPT_KERNEL_FINISH ? 7
                                                          : (g->sr ? 9 : 7);
    if (zopt_status st = check_params(g, *slot, k.symbol, nparams, d->name)) return st;
  }
  if (!g->prepare || !g->update || (!g->sumsq && (d->flags & ZOPT_FLAG_SUMSQ)))
    return fail(ZOPT_ERR_ABI, "step '%s': GPU kernel table lacks PREPARE, UPDATE or SUMSQ", d->name);
  if (!g->finish)
    return fail(ZOPT_ERR_ABI,
                "step '%s': GPU kernel table lacks FINISH (compiled by an older zopt-compile: recompile the step)",
                d->name);
  const std::string init = std::string(d->name) + "_init_gpu";
  if (cu->ModuleGetFunction(&g->init, g->mod, init.c_str()) != CUDA_SUCCESS) g->init = nullptr;
  if (g->init)
    if (zopt_status st = check_params(g, g->init, init.c_str(), 4, d->name)) return st;
  // Block sizes (.reqntid) and occupancy.
  if (zopt_status st = occupancy(g, g->prepare, "PREPARE", ZOPT_GPU_PREPARE_BLOCK, nullptr, d->name)) return st;
  if (zopt_status st = occupancy(g, g->finish, "FINISH", ZOPT_GPU_FINISH_BLOCK, nullptr, d->name)) return st;
  if (zopt_status st = occupancy(g, g->update, "UPDATE", ZOPT_GPU_BLOCK, &g->update_blocks_per_sm, d->name))
    return st;
  if (g->sumsq)
    if (zopt_status st = occupancy(g, g->sumsq, "SUMSQ", ZOPT_GPU_BLOCK, &g->sumsq_blocks_per_sm, d->name))
      return st;
  if (g->init)
    if (zopt_status st = occupancy(g, g->init, "INIT", ZOPT_GPU_BLOCK, nullptr, d->name)) return st;
  return gpu_events(g);
}

static zopt_status gpu_check_tensor(const zopt_optimizer *o, int tensor, void *param, void *grad) {
  // The kernels access param and grad element by element where the chunk
  // has no common 16-byte aligned element (abi.h), so each pointer must be
  // aligned to its own dtype: a device access off its natural alignment
  // traps (CUDA_ERROR_MISALIGNED_ADDRESS), and that error poisons the
  // context. The grad's dtype may be wider than the param's (f32 grads of
  // bf16/f16 params): a grad view laid out at the param's element size in
  // an f32 flat buffer lands at a 2-byte offset.
  const zopt_step_descriptor *d = o->d;
  for (int i = 0; i < 2; ++i) {
    const uint32_t dt = d->states[i ? o->step->grad_index : o->step->param_index].dtype;
    const size_t es = dtype_size(dt);
    const uintptr_t p = (uintptr_t)(i ? grad : param);
    if (es && p % es)
      return fail(ZOPT_ERR_INVALID_ARGUMENT,
                  "zopt_optimizer_add_tensor: the %s of tensor %d (%p) is not aligned to its dtype %s (%zu bytes): "
                  "the GPU kernels would fault on a misaligned address (a view into a flat %s buffer must start at "
                  "a whole element of that buffer's dtype)",
                  i ? "grad" : "param", tensor, (void *)p, dtype_name(dt), es, dtype_name(dt));
  }
  return gpu_check_pointers(G(o), param, grad, tensor);
}

static zopt_status gpu_set_allocator(zopt_optimizer *o, const zopt_device_allocator *a) {
  if (o->finalized)
    return fail(ZOPT_ERR_BAD_STATE, "zopt_optimizer_set_device_allocator: the optimizer is already finalized");
  if (a && (!a->alloc || !a->free))
    return fail(ZOPT_ERR_INVALID_ARGUMENT, "zopt_optimizer_set_device_allocator: alloc and free must both be set");
  G(o)->allocator = a ? *a : zopt_device_allocator{};
  return ZOPT_OK;
}

// Master (and any state initialized from the param) of tensors
// [first, first + count): INIT on their chunks, or through the host.
static zopt_status init_from_param(zopt_optimizer *o, int first, int count) {
  GpuState *g = G(o);
  const zopt_step_descriptor *d = o->d;
  bool any = false;
  for (uint32_t k = 0; k < d->num_states; ++k) any |= d->states[k].init == ZOPT_INIT_FROM_PARAM;
  if (!any || count <= 0) return ZOPT_OK;
  CUstream s = g->stream;
  if (g->init) {
    const int64_t c0 = g->chunk_first[(size_t)first], c1 = g->chunk_first[(size_t)first + (size_t)count];
    if (c1 == c0) return ZOPT_OK;
    CUdeviceptr chunks = g->d_chunks + (CUdeviceptr)c0 * sizeof(zopt_gpu_chunk);
    int64_t n = c1 - c0;
    unsigned grid = (unsigned)std::clamp<int64_t>(n, 1, std::min<int64_t>((int64_t)g->update_blocks_per_sm * g->num_sms,
                                                                         ZOPT_GPU_MAX_BLOCKS));
    void *args[] = {&g->d_states, &g->d_segs, &chunks, &n};
    CU_TRY(g->cu->LaunchKernel(g->init, grid, 1, 1, ZOPT_GPU_BLOCK, 1, 1, 0, s, args, nullptr), "launching INIT");
    CU_TRY(g->cu->EventRecordWithFlags(g->done, s, 0), "cuEventRecord");
    g->done_recorded = true;
    return ZOPT_OK;
  }
  // A step.so without INIT: through host memory, one tensor at a time.
  const int pi = o->step->param_index;
  const uint32_t pdt = d->states[pi].dtype;
  std::vector<unsigned char> src, dst;
  for (uint32_t k = 0; k < d->num_states; ++k) {
    if (d->states[k].init != ZOPT_INIT_FROM_PARAM) continue;
    const uint32_t mdt = d->states[k].dtype;
    for (int t = first; t < first + count; ++t) {
      const Tensor &x = o->tensors[t];
      if (!x.numel) continue;
      try {
        src.resize((size_t)x.numel * dtype_size(pdt));
        dst.resize((size_t)x.numel * dtype_size(mdt));
      } catch (...) {
        return fail(ZOPT_ERR_OUT_OF_MEMORY, "initializing the master: out of host memory");
      }
      CUresult r = g->cu->MemcpyDtoHAsync(src.data(), (CUdeviceptr)(uintptr_t)x.param, src.size(), s);
      if (!r) r = g->cu->StreamSynchronize(s);
      if (r) return fail(ZOPT_ERR_INTERNAL, "reading param %d: %s", t, error_string(r));
      convert(src.data(), pdt, dst.data(), mdt, x.numel);
      r = g->cu->MemcpyHtoDAsync((CUdeviceptr)(uintptr_t)state_ptr(o, t, (int)k), dst.data(), dst.size(), s);
      if (!r) r = g->cu->StreamSynchronize(s);
      if (r) return fail(ZOPT_ERR_INTERNAL, "writing the master of tensor %d: %s", t, error_string(r));
    }
  }
  return ZOPT_OK;
}

static zopt_status gpu_finalize(zopt_optimizer *o) {
  GpuState *g = G(o);
  const Driver *cu = g->cu;
  const zopt_step_descriptor *d = o->d;
  ZOPT_CTX_SCOPE(g);
  bool cap = false;
  if (zopt_status st = gpu_capturing(g, g->stream, &cap)) return st;
  if (cap)
    return fail(ZOPT_ERR_BAD_STATE,
                "zopt_optimizer_finalize: the optimizer's stream is capturing a CUDA graph (finalize allocates and "
                "synchronizes): finalize before capturing");
  gpu_layout(o);
  CUstream s = g->stream;
  auto undo = [&](zopt_status st) {
    cu->StreamSynchronize(s);
    dfree_all(g);
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
  // Tables: one segment per tensor, the work list, grids.
  const size_t G = o->groups.size(), S = o->tensors.size(), NS = d->num_states;
  std::vector<uint64_t> ptrs(S * NS, 0);
  std::vector<zopt_gpu_segment> segs(S);
  for (size_t t = 0; t < S; ++t) {
    for (size_t k = 0; k < NS; ++k) ptrs[t * NS + k] = (uint64_t)(uintptr_t)state_ptr(o, (int)t, (int)k);
    segs[t].n = o->tensors[t].numel;
    segs[t].group = (uint32_t)o->tensors[t].group;
    segs[t].tensor = (uint32_t)t;
  }
  const int64_t resident = std::min<int64_t>((int64_t)g->update_blocks_per_sm * g->num_sms, ZOPT_GPU_MAX_BLOCKS);
  if (zopt_status st = pick_chunk(o, 4 * resident, &g->chunk_elems)) return undo(st);
  std::vector<zopt_gpu_chunk> chunks;
  try {
    g->chunk_first.assign(S + 1, 0);
    for (size_t t = 0; t < S; ++t) {
      g->chunk_first[t] = (int64_t)chunks.size();
      for (int64_t b = 0; b < segs[t].n; b += g->chunk_elems)
        chunks.push_back({b, (uint32_t)t, (uint32_t)std::min<int64_t>(g->chunk_elems, segs[t].n - b)});
    }
    g->chunk_first[S] = (int64_t)chunks.size();
  } catch (...) {
    return undo(fail(ZOPT_ERR_OUT_OF_MEMORY, "zopt_optimizer_finalize: out of host memory for the work list"));
  }
  g->num_segments = (int64_t)S;
  g->num_chunks = (int64_t)chunks.size();
  g->update_grid = (unsigned)std::clamp<int64_t>(g->num_chunks, 1, resident);
  g->sumsq_grid = (unsigned)std::clamp<int64_t>(
      g->num_chunks, 1, std::min<int64_t>((int64_t)std::max(g->sumsq_blocks_per_sm, 1) * g->num_sms, ZOPT_GPU_MAX_BLOCKS));
  g->prepare_grid = (unsigned)((S + ZOPT_GPU_PREPARE_BLOCK - 1) / ZOPT_GPU_PREPARE_BLOCK);  // a row per tensor
  g->h_hypers.assign(std::max<size_t>(G * d->num_hypers, 1), 0.0);
  for (size_t gi = 0; gi < G; ++gi)
    for (size_t h = 0; h < d->num_hypers; ++h) g->h_hypers[gi * d->num_hypers + h] = o->groups[gi].hypers[h];
  zopt_status st = ZOPT_OK;
  if ((st = dalloc(g, ptrs.size() * 8, &g->d_states, "state table")) ||
      (st = dalloc(g, segs.size() * sizeof(zopt_gpu_segment), &g->d_segs, "segment table")) ||
      (st = dalloc(g, chunks.size() * sizeof(zopt_gpu_chunk), &g->d_chunks, "work list")) ||
      (st = dalloc(g, g->h_hypers.size() * 8, &g->d_hypers, "hyperparameter table")) ||
      (st = dalloc(g, G * ZOPT_NUM_GLOBALS * 8, &g->d_globals, "globals table")) ||
      (st = dalloc(g, S * std::max<uint32_t>(d->num_coeffs, 1) * 4, &g->d_coeffs, "coefficient table")) ||
      (st = dalloc(g, S * 8, &g->d_tensor_t, "tensors' steps")) ||
      (st = dalloc(g, S + G, &g->d_active, "active mask")) ||
      (st = dalloc(g, (size_t)g->sumsq_grid * 8, &g->d_partials, "norm partials")) ||
      (st = dalloc(g, sizeof(zopt_gpu_step_globals), &g->d_sg, "step globals")) ||
      (st = dalloc(g, sizeof(zopt_gpu_scaler), &g->d_scaler, "loss scaler")))
    return undo(st);
  CUresult r = cu->MemcpyHtoDAsync(g->d_states, ptrs.data(), ptrs.size() * 8, s);
  if (!r) r = cu->MemcpyHtoDAsync(g->d_segs, segs.data(), segs.size() * sizeof(zopt_gpu_segment), s);
  if (!r && !chunks.empty())
    r = cu->MemcpyHtoDAsync(g->d_chunks, chunks.data(), chunks.size() * sizeof(zopt_gpu_chunk), s);
  if (!r) r = cu->MemcpyHtoDAsync(g->d_hypers, g->h_hypers.data(), g->h_hypers.size() * 8, s);
  if (!r) r = cu->MemsetD8Async(g->d_sg, 0, sizeof(zopt_gpu_step_globals), s);
  if (!r) r = cu->MemsetD8Async(g->d_partials, 0, (size_t)g->sumsq_grid * 8, s);
  if (!r) r = cu->StreamSynchronize(s);  // the pageable sources above
  if (r) return undo(fail(ZOPT_ERR_INTERNAL, "zopt_optimizer_finalize: building device tables: %s", error_string(r)));
  g->hypers_dirty = false;
  // The master from the params, on the device (INIT).
  if (zopt_status st2 = init_from_param(o, 0, (int)S)) return undo(st2);
  if (CUresult r2 = cu->StreamSynchronize(s))
    return undo(fail(ZOPT_ERR_INTERNAL, "zopt_optimizer_finalize: initializing the states: %s", error_string(r2)));
  g->device_ahead = false;
  if (zopt_status st2 = gpu_push(o)) return undo(st2);
  return ZOPT_OK;
}

// Copies of the globals, the scaler and (when stale) the hyperparameter
// table to the device, then a stream synchronisation.
static zopt_status gpu_push(zopt_optimizer *o) {
  GpuState *g = G(o);
  if (!g->d_globals) return ZOPT_OK;  // not finalized: finalize pushes
  ZOPT_CTX_SCOPE(g);
  if (zopt_status st = gpu_begin_host_access(g, "writing the GPU step state")) return st;
  const zopt_step_descriptor *d = o->d;
  const bool ls = d->flags & ZOPT_FLAG_LOSS_SCALE;
  const double S = loss_scale(o);
  std::vector<double> globals(o->groups.size() * ZOPT_NUM_GLOBALS);
  // Per tensor the t of its next step; the active mask (zopt_optimizer_set_active;
  // empty: every tensor), then per group whether any of its tensors is.
  const size_t T = o->tensors.size(), NG = o->groups.size();
  std::vector<double> tensor_t(T);
  std::vector<uint8_t> active(T + NG, 0);
  for (size_t t = 0; t < T; ++t) {
    tensor_t[t] = (double)(o->tensors[t].steps + 1);
    active[t] = o->active.empty() || o->active[t];
    if (active[t]) active[T + (size_t)o->tensors[t].group] = 1;
  }
  for (size_t gi = 0; gi < o->groups.size(); ++gi) {
    double *gl = &globals[gi * ZOPT_NUM_GLOBALS];
    gl[ZOPT_GLOBAL_STEP] = (double)(o->groups[gi].step_count + 1);
    gl[ZOPT_GLOBAL_CLIP_COEF] = 1.0;
    // Negative for a maximizing group; FINISH keeps each group's sign when
    // it rewrites the scale.
    gl[ZOPT_GLOBAL_GRAD_SCALE] = grad_scale(o, S, o->groups[gi].flags);
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
  const bool hypers = g->hypers_dirty;
  if (hypers) {
    const size_t H = d->num_hypers;
    for (size_t gi = 0; gi < o->groups.size(); ++gi)
      for (size_t h = 0; h < H; ++h) g->h_hypers[gi * H + h] = o->groups[gi].hypers[h];
  }
  CUresult r = g->cu->MemcpyHtoDAsync(g->d_globals, globals.data(), globals.size() * 8, g->stream);
  if (!r) r = g->cu->MemcpyHtoDAsync(g->d_tensor_t, tensor_t.data(), tensor_t.size() * 8, g->stream);
  if (!r) r = g->cu->MemcpyHtoDAsync(g->d_active, active.data(), active.size(), g->stream);
  if (!r) r = g->cu->MemcpyHtoDAsync(g->d_scaler, &sc, sizeof sc, g->stream);
  if (!r && hypers) r = g->cu->MemcpyHtoDAsync(g->d_hypers, g->h_hypers.data(), g->h_hypers.size() * 8, g->stream);
  if (!r) r = g->cu->StreamSynchronize(g->stream);
  if (r) return fail(ZOPT_ERR_INTERNAL, "writing the GPU step state: %s", error_string(r));
  if (hypers) g->hypers_dirty = false;
  g->device_ahead = false;
  return ZOPT_OK;
}

// Reads the device's step state (globals, scaler, and the step globals when
// `sg` is given) with one stream synchronisation, after the last step
// (wherever it ran), and refreshes the host copies in `o` (step counts,
// scaler).
static zopt_status read_device_state(zopt_optimizer *o, zopt_gpu_step_globals *sg, zopt_gpu_scaler *sc,
                                     const char *what) {
  GpuState *g = G(o);
  ZOPT_CTX_SCOPE(g);
  if (zopt_status st = gpu_begin_host_access(g, what)) return st;
  std::vector<double> globals(o->groups.size() * ZOPT_NUM_GLOBALS), tensor_t(o->tensors.size());
  CUresult r = g->cu->MemcpyDtoHAsync(globals.data(), g->d_globals, globals.size() * 8, g->stream);
  if (!r) r = g->cu->MemcpyDtoHAsync(tensor_t.data(), g->d_tensor_t, tensor_t.size() * 8, g->stream);
  if (!r) r = g->cu->MemcpyDtoHAsync(sc, g->d_scaler, sizeof *sc, g->stream);
  if (!r && sg) r = g->cu->MemcpyDtoHAsync(sg, g->d_sg, sizeof *sg, g->stream);
  if (!r) r = g->cu->StreamSynchronize(g->stream);
  if (r) return fail(ZOPT_ERR_INTERNAL, "reading the GPU step state: %s", error_string(r));
  for (size_t gi = 0; gi < o->groups.size(); ++gi)
    o->groups[gi].step_count = (int64_t)globals[gi * ZOPT_NUM_GLOBALS + ZOPT_GLOBAL_STEP] - 1;
  for (size_t t = 0; t < o->tensors.size(); ++t) o->tensors[t].steps = (int64_t)tensor_t[t] - 1;
  if (o->d->flags & ZOPT_FLAG_LOSS_SCALE) {
    o->scaler.scale = sc->scale;
    o->scaler.good_steps = sc->good_steps;
  }
  g->device_ahead = false;
  return ZOPT_OK;
}

static zopt_status gpu_pull(zopt_optimizer *o) {
  // After a capture, replays advance the device's state unseen: always read.
  if (!G(o)->device_ahead && !G(o)->captured) return ZOPT_OK;
  zopt_gpu_scaler sc;
  return read_device_state(o, nullptr, &sc, "reading the GPU step state");
}

static void gpu_hypers_changed(zopt_optimizer *o) { G(o)->hypers_dirty = true; }

static zopt_status gpu_set_hyper(zopt_optimizer *o, int group, int hi, double value) {
  GpuState *g = G(o);
  if (!g->d_hypers) {  // before finalize: finalize uploads the table
    o->groups[group].hypers[hi] = value;
    return ZOPT_OK;
  }
  ZOPT_CTX_SCOPE(g);
  CUstream s = g->stream;
  bool cap = false;
  if (zopt_status st = gpu_capturing(g, s, &cap)) return st;
  if (cap)
    return fail(ZOPT_ERR_BAD_STATE,
                "zopt_optimizer_set_hyper(group %d, %s): the optimizer's stream is capturing a CUDA graph; a value "
                "written now would be baked into the graph. Set hyperparameters between replays, outside the "
                "capture: every replay reads the device's table, so it uses the value set before it",
                group, hyper_name(o->d->hypers[hi].kind));
  o->groups[group].hypers[hi] = value;
  const size_t at = (size_t)group * o->d->num_hypers + (size_t)hi;
  g->h_hypers[at] = value;
  // Ordered after the steps already enqueued, on whatever stream (a replay
  // records `done` too), and before the next ones (they wait for
  // `hypers_ready`); the value travels in the memsets' arguments, so there
  // is no host buffer to keep alive.
  uint32_t w[2];
  memcpy(w, &value, 8);
  const CUdeviceptr p = g->d_hypers + (CUdeviceptr)at * 8;
  CUresult r = g->done_recorded ? g->cu->StreamWaitEvent(s, g->done, 0) : CUDA_SUCCESS;
  if (!r) r = g->cu->MemsetD32Async(p, w[0], 1, s);
  if (!r) r = g->cu->MemsetD32Async(p + 4, w[1], 1, s);
  if (!r) r = g->cu->EventRecordWithFlags(g->hypers_ready, s, 0);
  if (r) {
    g->hypers_dirty = true;  // the next step or push uploads the whole table
    return fail(ZOPT_ERR_INTERNAL, "zopt_optimizer_set_hyper: writing the device's hyperparameter table: %s",
                error_string(r));
  }
  g->hypers_recorded = true;
  return ZOPT_OK;
}

// A step (exec/ drives it through CudaBackend): before the first op, the
// hyperparameter table's upload (after a failed write) and the wait for
// its latest write; `cap` says whether the stream is capturing a graph.
static zopt_status gpu_begin_step(zopt_optimizer *o, bool *capturing) {
  GpuState *g = G(o);
  const Driver *cu = g->cu;
  const zopt_step_descriptor *d = o->d;
  ZOPT_CTX_SCOPE(g);
  CUstream s = g->stream;
  bool cap = false;
  if (zopt_status st = gpu_capturing(g, s, &cap)) return st;
  *capturing = cap;
  if (g->hypers_dirty) {
    // Only after a failed hyperparameter write.
    if (cap)
      return fail(ZOPT_ERR_BAD_STATE,
                  "zopt_optimizer_step: the device's hyperparameter table is stale (a failed write) and the stream "
                  "is capturing a CUDA graph: step once outside the capture first");
    const size_t H = d->num_hypers;
    for (size_t gi = 0; gi < o->groups.size(); ++gi)
      for (size_t h = 0; h < H; ++h) g->h_hypers[gi * H + h] = o->groups[gi].hypers[h];
    CU_TRY(cu->MemcpyHtoDAsync(g->d_hypers, g->h_hypers.data(), g->h_hypers.size() * 8, s),
           "cuMemcpyHtoDAsync(hypers)");
    CU_TRY(cu->EventRecordWithFlags(g->hypers_ready, s, 0), "cuEventRecord");
    g->hypers_recorded = true;
    g->hypers_dirty = false;
  }
  // After the latest hyperparameter write, wherever it ran. In a capture,
  // always (also before any write: writes may come between the replays):
  // an external wait node, so each replay waits for the latest write made
  // before its launch (an event never recorded is complete).
  if (g->hypers_recorded || cap)
    CU_TRY(cu->StreamWaitEvent(s, g->hypers_ready, cap ? EVENT_WAIT_EXTERNAL : 0), "cuStreamWaitEvent(hypers)");
  return ZOPT_OK;
}

// Program op i as launches on the optimizer's stream (validate_program
// checked the program): PREPARE, NORM_PARTIALS (the SUMSQ kernel, whose
// last block takes the norm and decides with the step's control), UPDATE
// (returns at once on a skipped step) and FINISH (counts, loss scaler).
// The NORM is SUMSQ's last block; at world size 1 the collectives move
// nothing.
static zopt_status gpu_run_op(zopt_optimizer *o, size_t i) {
  GpuState *g = G(o);
  const Driver *cu = g->cu;
  const zopt_step_descriptor *d = o->d;
  const bool has_sumsq = d->flags & ZOPT_FLAG_SUMSQ;
  const bool ls = d->flags & ZOPT_FLAG_LOSS_SCALE;
  int64_t ng = (int64_t)o->groups.size(), nchunks = g->num_chunks, nrows = g->num_segments;
  CUdeviceptr no_ptr = 0;
  switch (d->program[i].code) {
    case ZOPT_OP_REDUCE_SCATTER:
    case ZOPT_OP_ALL_GATHER:
    case ZOPT_OP_NORM:
      return ZOPT_OK;
    default:
      break;
  }
  ZOPT_CTX_SCOPE(g);
  CUstream s = g->stream;
  switch (d->program[i].code) {
    case ZOPT_OP_PREPARE: {
      void *args[] = {&g->d_hypers, &g->d_globals, &g->d_segs, &g->d_tensor_t, &nrows, &g->d_coeffs};
      CU_TRY(cu->LaunchKernel(g->prepare, g->prepare_grid, 1, 1, ZOPT_GPU_PREPARE_BLOCK, 1, 1, 0, s, args, nullptr),
             "launching PREPARE");
      return ZOPT_OK;
    }
    case ZOPT_OP_NORM_PARTIALS: {
      void *args[] = {&g->d_states,  &g->d_segs, &g->d_chunks,  &nchunks, &g->d_coeffs,
                      &g->d_partials, &g->d_sg,  &g->d_hypers, &g->d_globals, &nrows,
                      &g->d_tensor_t, &g->d_active};
      CU_TRY(cu->LaunchKernel(g->sumsq, g->sumsq_grid, 1, 1, ZOPT_GPU_BLOCK, 1, 1, 0, s, args, nullptr),
             "launching SUMSQ");
      return ZOPT_OK;
    }
    case ZOPT_OP_UPDATE: {
      // Stochastic rounding: the tensors' steps t and the seed too.
      uint64_t seed = o->seed;
      void *args[] = {&g->d_states, &g->d_segs, &g->d_chunks, &nchunks, &g->d_coeffs,
                      has_sumsq ? &g->d_sg : &no_ptr, &g->d_active, &g->d_tensor_t, &seed};
      CU_TRY(cu->LaunchKernel(g->update, g->update_grid, 1, 1, ZOPT_GPU_BLOCK, 1, 1, 0, s, args, nullptr),
             "launching UPDATE");
      return ZOPT_OK;
    }
    case ZOPT_OP_FINISH: {
      void *args[] = {&g->d_globals, &ng,         has_sumsq ? &g->d_sg : &no_ptr, ls ? &g->d_scaler : &no_ptr,
                      &g->d_tensor_t, &g->d_active, &nrows};
      CU_TRY(cu->LaunchKernel(g->finish, 1, 1, 1, ZOPT_GPU_FINISH_BLOCK, 1, 1, 0, s, args, nullptr),
             "launching FINISH");
      return ZOPT_OK;
    }
  }
  return fail(ZOPT_ERR_INTERNAL, "step '%s': program op %zu (code %u) has no GPU launch", d->name, i,
              d->program[i].code);
}

// After the last op: the event every later read and stream waits for.
static zopt_status gpu_end_step(zopt_optimizer *o, bool cap, zopt_step_result *result) {
  GpuState *g = G(o);
  ZOPT_CTX_SCOPE(g);
  // Reads wait for this; captured, it is a record node that every replay
  // runs, so reads after a replay on any stream wait for that replay.
  CU_TRY(g->cu->EventRecordWithFlags(g->done, g->stream, cap ? EVENT_RECORD_EXTERNAL : 0), "cuEventRecord(step)");
  g->done_recorded = true;
  g->captured |= cap;
  g->stepped = true;
  g->device_ahead = true;
  if (result) {  // on the device: zopt_optimizer_gpu_result reads it
    result->grad_norm = NAN;
    result->skipped = 0;
    result->loss_scale = NAN;
  }
  return ZOPT_OK;
}

// The ops the GPU backend launches, as the zprog verifier and the
// descriptor's checks order them (docs/Dialects/Program.md): every op on
// the GPU, no copies, the norm exactly when the step has its SUMSQ kernel.
static zopt_status validate_program(const zopt_optimizer *o) {
  const zopt_step_descriptor *d = o->d;
  int prepares = 0, updates = 0, finishes = 0, partials = 0, norms = 0;
  for (uint32_t i = 0; i < d->num_program; ++i) {
    const zopt_program_op &op = d->program[i];
    if (op.code == ZOPT_OP_COPY || op.src != ZOPT_PLACE_GPU)
      return fail(ZOPT_ERR_ABI, "step '%s': program op %u (code %u) %s, but the step's update runs on the GPU",
                  d->name, i, op.code, op.code == ZOPT_OP_COPY ? "copies between placements" : "runs on the CPU");
    prepares += op.code == ZOPT_OP_PREPARE;
    updates += op.code == ZOPT_OP_UPDATE;
    finishes += op.code == ZOPT_OP_FINISH;
    partials += op.code == ZOPT_OP_NORM_PARTIALS;
    norms += op.code == ZOPT_OP_NORM;
    if (op.code == ZOPT_OP_NORM_PARTIALS && !prepares)
      return fail(ZOPT_ERR_ABI, "step '%s': program op %u: the norm's partials before the PREPARE", d->name, i);
    if (op.code == ZOPT_OP_UPDATE && (!prepares || partials != norms))
      return fail(ZOPT_ERR_ABI, "step '%s': program op %u: the UPDATE before the PREPARE or the NORM", d->name, i);
  }
  const bool sumsq = d->flags & ZOPT_FLAG_SUMSQ;
  if (prepares != 1 || updates != 1 || finishes != 1 || d->program[d->num_program - 1].code != ZOPT_OP_FINISH ||
      partials != norms || partials > 1 || (partials == 1) != sumsq)
    return fail(ZOPT_ERR_ABI,
                "step '%s': the program is not one the GPU backend runs (one PREPARE, [NORM_PARTIALS NORM exactly "
                "with a SUMSQ kernel], one UPDATE, FINISH last)",
                d->name);
  return ZOPT_OK;
}

static zopt_status gpu_result(zopt_optimizer *o, zopt_step_result *result) {
  GpuState *g = G(o);
  if (!g->stepped) return fail(ZOPT_ERR_BAD_STATE, "zopt_optimizer_gpu_result: no step has run yet");
  zopt_gpu_step_globals sg;
  zopt_gpu_scaler sc;
  if (zopt_status st = read_device_state(o, &sg, &sc, "zopt_optimizer_gpu_result")) return st;
  const bool has_sumsq = o->d->flags & ZOPT_FLAG_SUMSQ;
  result->grad_norm = has_sumsq ? sg.norm : NAN;
  result->skipped = has_sumsq && sg.skip != 0;
  result->loss_scale = (o->d->flags & ZOPT_FLAG_LOSS_SCALE) ? sc.last_scale : 1.0;
  return ZOPT_OK;
}

static zopt_status gpu_copy(const zopt_optimizer *o, int t, int si, void *host, size_t bytes, bool to_device) {
  GpuState *g = G(o);
  ZOPT_CTX_SCOPE(g);
  if (zopt_status st = gpu_begin_host_access(g, to_device ? "writing a GPU state" : "reading a GPU state")) return st;
  CUdeviceptr p = (CUdeviceptr)(uintptr_t)state_ptr(o, t, si);
  CUresult r = to_device ? g->cu->MemcpyHtoDAsync(p, host, bytes, g->stream)
                         : g->cu->MemcpyDtoHAsync(host, p, bytes, g->stream);
  if (!r) r = g->cu->StreamSynchronize(g->stream);
  if (r) return fail(ZOPT_ERR_INTERNAL, "copying GPU state %s of tensor %d: %s", state_kind_name(o->d->states[si].kind), t,
                     error_string(r));
  return ZOPT_OK;
}

static zopt_status gpu_refresh_master(zopt_optimizer *o, int first, int count) {
  GpuState *g = G(o);
  ZOPT_CTX_SCOPE(g);
  if (zopt_status st = gpu_begin_host_access(g, "zopt_optimizer_refresh_master")) return st;
  return init_from_param(o, first, count);
}

static void gpu_free(zopt_optimizer *o) {
  GpuState *g = G(o);
  if (!g) return;
  {
    CtxScope scope(g);
    if (!scope.status()) {
      // The optimizer's own work only: the caller's stream may be destroyed.
      gpu_sync_own_work(g);
      dfree_all(g);
      if (g->mod) g->cu->ModuleUnload(g->mod);
      destroy_events(g);
    }
  }
  for (auto &gr : o->groups)
    for (void *&b : gr.buffers) b = nullptr;
  cuda_detach(g);
  delete g;
}

// ---- the backend ----------------------------------------------------------------

class CudaBackend final : public Backend {
 public:
  explicit CudaBackend(GpuState *state) : g(state) {}
  GpuState *g;
  bool capturing = false;  // the current step's stream captures a graph

  const char *name() const override { return "cuda"; }

  zopt_status supports(const zopt_optimizer *o, Feature f, const char *fn) const override {
    const char *name = o->d->name;
    switch (f) {
      case Feature::SplitStep:
        return fail(ZOPT_ERR_UNSUPPORTED, "%s: step '%s' updates on the GPU, whose step runs as one stream of kernels",
                    fn, name);
      case Feature::LinkedStep:
        return fail(ZOPT_ERR_UNSUPPORTED, "%s: step '%s' is a GPU step: linked steps run CPU-updated steps", fn, name);
      case Feature::RuntimeMaxNorm:
        return fail(ZOPT_ERR_UNSUPPORTED,
                    "%s: step '%s' updates on the GPU, whose kernels hold the compiled max_norm %g", fn, name,
                    o->d->max_norm);
      case Feature::GradStreaming:
        return fail(ZOPT_ERR_UNSUPPORTED,
                    "%s: step '%s' updates on the GPU; gradient streaming is implemented for steps updated on the "
                    "CPU from host gradients",
                    fn, name);
      case Feature::TensorMemory:
        return fail(ZOPT_ERR_UNSUPPORTED, "%s: GPU steps keep their tensors' device pointers in device tables", fn);
      case Feature::OpTimes:
        return fail(ZOPT_ERR_UNSUPPORTED, "%s: a GPU step's ops run asynchronously on its stream", fn);
      case Feature::GatherParams:
        return fail(ZOPT_ERR_UNSUPPORTED, "%s: the params of step '%s' live on the GPU, whole", fn, name);
      case Feature::AddTensors:
        return fail(ZOPT_ERR_UNSUPPORTED,
                    "%s: step '%s' updates on the GPU, whose device tables (segments, states, work list) are built "
                    "once at finalize: adding tensors to a finalized GPU step is not implemented. Build a new "
                    "optimizer with every tensor and move the state over (zopt_optimizer_export_state + "
                    "zopt_optimizer_import_begin)",
                    fn, name);
    }
    return ZOPT_OK;
  }

  zopt_status check_comm(const zopt_optimizer *, zopt_comm *) const override { return ZOPT_OK; }

  zopt_status check_tensor(const zopt_optimizer *o, int t, void *param, void *grad) const override {
    return gpu_check_tensor(o, t, param, grad);
  }

  zopt_status finalize(zopt_optimizer *o) override {
    if (o->world > 1)
      return fail(ZOPT_ERR_UNSUPPORTED,
                  "zopt_optimizer_finalize: step '%s' updates on the GPU, which runs at world size 1 for now "
                  "(the communicator has %d ranks); ZeRO across GPU ranks is not implemented yet",
                  o->d->name, o->world);
    if (zopt_status st = validate_program(o)) return st;
    return gpu_finalize(o);
  }

  void destroy(zopt_optimizer *o) override { gpu_free(o); }

  zopt_status begin_step(zopt_optimizer *o, exec::StepState *, bool) override {
    return gpu_begin_step(o, &capturing);  // the active mask is on the device (push)
  }
  zopt_status run_op(zopt_optimizer *o, exec::StepState *, size_t i) override { return gpu_run_op(o, i); }
  // The device decides (SUMSQ's last block): nothing is skipped on the host.
  void decide(zopt_optimizer *, exec::StepState *, double) override {}
  void end_step(zopt_optimizer *o, exec::StepState *, zopt_step_result *result) override {
    gpu_end_step(o, capturing, result);
  }

  void *state_ptr(const zopt_optimizer *o, int t, int si) const override {
    const Tensor &x = o->tensors[t];
    const uint32_t kind = o->d->states[si].kind;
    if (kind == ZOPT_STATE_PARAM) return x.param;
    if (kind == ZOPT_STATE_GRAD) return x.grad;
    char *b = (char *)o->groups[x.group].buffers[si];  // the group's flat device buffers
    return b + (size_t)x.offset * dtype_size(o->d->states[si].dtype);
  }
  bool host_state(const zopt_optimizer *, int) const override { return false; }
  zopt_status read_state(const zopt_optimizer *o, int t, int si, void *out, size_t bytes) const override {
    return gpu_copy(o, t, si, out, bytes, false);
  }
  zopt_status write_state(zopt_optimizer *o, int t, int si, const void *in, size_t bytes) override {
    return gpu_copy(o, t, si, const_cast<void *>(in), bytes, true);
  }
  zopt_status refresh_master(zopt_optimizer *o, int first, int count) override {
    return gpu_refresh_master(o, first, count);
  }
  void memory_info(const zopt_optimizer *o, zopt_memory_info *info) const override {
    const zopt_step_descriptor *d = o->d;
    for (uint32_t s = 0; s < d->num_states; ++s)
      if (is_owned_kind(d->states[s].kind))
        for (const Group &gr : o->groups)
          info->state_bytes += ((uint64_t)gr.padded_total * dtype_size(d->states[s].dtype) + 63) & ~(uint64_t)63;
    info->state_bytes_one_rank = info->state_bytes;
    info->bytes_gpu += info->state_bytes;
  }

  zopt_status pull(zopt_optimizer *o) override { return o->finalized ? gpu_pull(o) : ZOPT_OK; }
  zopt_status push(zopt_optimizer *o) override { return o->finalized ? gpu_push(o) : ZOPT_OK; }
  zopt_status set_hyper(zopt_optimizer *o, int group, int hi, double value) override {
    if (o->groups[group].hypers[hi] == value) return ZOPT_OK;
    return gpu_set_hyper(o, group, hi, value);  // and into the device's table
  }
  void hypers_changed(zopt_optimizer *o) override { gpu_hypers_changed(o); }

  zopt_status set_stream(zopt_optimizer *, void *stream) override { return gpu_set_stream(g, stream); }
  zopt_status device_result(zopt_optimizer *o, zopt_step_result *result) override { return gpu_result(o, result); }
  zopt_status set_device_allocator(zopt_optimizer *o, const zopt_device_allocator *a) override {
    return gpu_set_allocator(o, a);
  }
};

static GpuState *G(const zopt_optimizer *o) { return static_cast<const CudaBackend *>(o->backend)->g; }

zopt_status make_cuda_backend(zopt_optimizer *o, Backend **out) {
  GpuState *g = nullptr;
  if (zopt_status st = gpu_create(o, &g)) return st;
  *out = new (std::nothrow) CudaBackend(g);
  if (!*out) {
    {
      CtxScope scope(g);
      if (!scope.status()) {
        if (g->mod) g->cu->ModuleUnload(g->mod);
        destroy_events(g);
      }
    }
    cuda_detach(g);
    delete g;
    return fail(ZOPT_ERR_OUT_OF_MEMORY, "out of memory");
  }
  return ZOPT_OK;
}

}  // namespace zopt
