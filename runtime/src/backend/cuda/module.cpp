// backend/cuda/module.cpp - the step's GPU image and kernels (abi.h "GPU
// kernels"): the image with the highest SM this device runs, loaded; each
// kernel's parameter list, block size and occupancy checked; the backend's
// state made at zopt_optimizer_create; a tensor's device pointers checked.
#include "backend/cuda/cuda_internal.h"

#include "internal.h"

#include <dlfcn.h>

#include <new>
#include <string>

using namespace zopt;
using namespace zopt::cu;

namespace {

// "13.0" for 13000.
std::string cuda_version_str(int v) { return std::to_string(v / 1000) + "." + std::to_string(v % 1000 / 10); }

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

static zopt_status load_module(GpuState *g, const zopt_step *s);

zopt_status gpu_create(zopt_optimizer *o, GpuState **out) {
  const zopt_step *s = o->step;
  const zopt_step_descriptor *d = o->d;
  for (uint32_t i = 0; i < d->num_states; ++i)
    if (d->states[i].placement != ZOPT_PLACE_GPU)
      return fail(ZOPT_ERR_UNSUPPORTED,
                  "%s state '%s' is on the CPU: mixed CPU/GPU placement (offload) is not implemented by the CUDA "
                  "backend yet",
                  d->name, state_kind_name(d->states[i].kind));
  return gpu_state_create(
      d->name, "runs on the GPU",
      [](GpuState *g, const void *step) { return load_module(g, static_cast<const zopt_step *>(step)); }, s,
      [](GpuState *g) {
        if (g->mod) g->cu->ModuleUnload(g->mod);
        destroy_events(g);
      },
      out);
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

zopt_status gpu_check_tensor(const zopt_optimizer *o, int tensor, void *param, void *grad, const char *fn) {
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
                  "%s: the %s of tensor %d (%p) is not aligned to its dtype %s (%zu bytes): "
                  "the GPU kernels would fault on a misaligned address (a view into a flat %s buffer must start at "
                  "a whole element of that buffer's dtype)",
                  fn, i ? "grad" : "param", tensor, (void *)p, dtype_name(dt), es, dtype_name(dt));
  }
  return gpu_check_pointers(G(o), param, grad, tensor, fn);
}

}  // namespace zopt
