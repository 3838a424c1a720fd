// backend/backend.cpp - the choice of a step's backend and the interface's
// defaults (backend/backend.h).
#include "backend/backend.h"

#include "backend/cpu/cpu.h"
#include "backend/cuda/cuda.h"
#include "backend/offload/offload.h"

#include <new>

namespace zopt {

zopt_status make_backend(zopt_optimizer *o, Backend **out) {
  const zopt_step *step = o->step;
  const zopt_step_descriptor *d = o->d;
  *out = nullptr;
  if (step->has_gpu_code) return make_cuda_backend(o, out);
  if (is_offload_step(step)) return make_offload_backend(o, out);
  for (uint32_t i = 0; i < d->num_states; ++i)
    if (d->states[i].placement == ZOPT_PLACE_GPU)
      return fail(ZOPT_ERR_UNSUPPORTED,
                  "%s state '%s': GPU-placed state needs the CUDA backend and the step has no GPU code", d->name,
                  state_kind_name(d->states[i].kind));
  if (!step->has_cpu_kernels)
    return fail(ZOPT_ERR_UNSUPPORTED, "step '%s' has no CPU kernels (needs the CUDA backend)", d->name);
  *out = new (std::nothrow) CpuBackend;
  if (!*out) return fail(ZOPT_ERR_OUT_OF_MEMORY, "out of memory");
  return ZOPT_OK;
}

void *state_ptr(const zopt_optimizer *o, int t, int si) { return o->backend->state_ptr(o, t, si); }

zopt_status Backend::supports(const zopt_optimizer *, Feature, const char *) const { return ZOPT_OK; }

zopt_status Backend::check_tensor(const zopt_optimizer *, int, void *, void *, const char *) const { return ZOPT_OK; }

ChecksScope::~ChecksScope() { o->backend->checks_done(o); }

zopt_status Backend::set_hyper(zopt_optimizer *o, int group, int hi, double value) {
  o->groups[group].hypers[hi] = value;
  return ZOPT_OK;
}

zopt_status Backend::set_max_norm(zopt_optimizer *o, double value) {
  o->max_norm = value;
  return ZOPT_OK;
}

zopt_status Backend::set_stream(zopt_optimizer *o, void *) {
  return fail(ZOPT_ERR_BAD_STATE, "zopt_optimizer_set_stream: step '%s' has nothing on the GPU", o->d->name);
}

zopt_status Backend::device_result(zopt_optimizer *o, zopt_step_result *) {
  return fail(ZOPT_ERR_BAD_STATE, "zopt_optimizer_gpu_result: step '%s' does not run on the GPU", o->d->name);
}

zopt_status Backend::set_device_allocator(zopt_optimizer *o, const zopt_device_allocator *) {
  return fail(ZOPT_ERR_BAD_STATE,
              "zopt_optimizer_set_device_allocator: step '%s' allocates no device memory (not a GPU step)",
              o->d->name);
}

zopt_status Backend::alloc_staging(zopt_optimizer *o, size_t, void **) {
  return fail(ZOPT_ERR_INTERNAL, "step '%s': backend %s stages no tensors", o->d->name, name());
}

zopt_status Backend::copy_staged(zopt_optimizer *o, int, bool, bool) {
  return fail(ZOPT_ERR_INTERNAL, "step '%s': backend %s stages no tensors", o->d->name, name());
}

const void *Backend::param_on_host(const zopt_optimizer *o, int t) const { return o->tensors[t].param; }

zopt_status Backend::grad_bucket_ready(zopt_optimizer *o, int) {
  return fail(ZOPT_ERR_UNSUPPORTED,
              "zopt_optimizer_grad_bucket_ready: step '%s' is not offloaded (bucket readiness is for steps with the "
              "params and grads on the GPU and the update on the CPU; CPU steps stream buckets with "
              "zopt_optimizer_reduce_bucket_async)",
              o->d->name);
}

static zopt_status no_params_back(const zopt_optimizer *o, const char *fn) {
  return fail(ZOPT_ERR_UNSUPPORTED,
              "%s: step '%s' is not offloaded (the params' copies back to the GPU are an offloaded step's: params "
              "and grads on the GPU, the update on the CPU)",
              fn, o->d->name);
}

zopt_status Backend::set_param_wait(zopt_optimizer *o, int) {
  return no_params_back(o, "zopt_optimizer_set_param_wait");
}

zopt_status Backend::wait_params(zopt_optimizer *o, int, void *) {
  return no_params_back(o, "zopt_optimizer_wait_params");
}

}  // namespace zopt

using namespace zopt;

extern "C" {

// The zopt.h "GPU" calls: whatever the backend does with them.
ZOPT_API zopt_status zopt_optimizer_set_stream(zopt_optimizer *o, void *cu_stream) {
  ZOPT_ENTER_CALL(o, "zopt_optimizer_set_stream");
  return o->backend->set_stream(o, cu_stream);
}

ZOPT_API zopt_status zopt_optimizer_gpu_result(zopt_optimizer *o, zopt_step_result *result) {
  ZOPT_ENTER_CALL(o, "zopt_optimizer_gpu_result");
  if (!result) return fail(ZOPT_ERR_INVALID_ARGUMENT, "zopt_optimizer_gpu_result: result is NULL");
  return o->backend->device_result(o, result);
}

ZOPT_API zopt_status zopt_optimizer_set_device_allocator(zopt_optimizer *o, const zopt_device_allocator *allocator) {
  ZOPT_ENTER_CALL(o, "zopt_optimizer_set_device_allocator");
  return o->backend->set_device_allocator(o, allocator);
}

}  // extern "C"
