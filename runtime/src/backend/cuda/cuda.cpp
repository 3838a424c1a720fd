// backend/cuda/cuda.cpp - the CUDA backend (cuda.h): steps whose states
// live on the GPU (abi.h "GPU kernels"). Driver API only, loaded at run
// time (cuda_driver.h); the program's ops are kernel launches on the
// optimizer's stream. This file is the Backend over the parts listed in
// cuda_internal.h. See docs/GPU.md for the design and what has been
// tested.
#include "backend/cuda/cuda.h"

#include "backend/backend.h"
#include "backend/cuda/cuda_internal.h"
#include "exec/exec.h"

#include <cmath>
#include <new>

using namespace zopt;
using namespace zopt::cu;

namespace zopt {

// ---- the backend ----------------------------------------------------------------

class CudaBackend final : public Backend {
 public:
  explicit CudaBackend(GpuState *state) : g(state) {}
  GpuState *g;
  bool capturing = false;  // the current step's stream captures a graph
  bool applied = false;    // a linked step's decision is on the device (linked.cpp)

  const char *name() const override { return "cuda"; }

  zopt_status supports(const zopt_optimizer *o, Feature f, const char *fn) const override {
    const char *name = o->d->name;
    switch (f) {
      case Feature::SplitStep:
        return fail(ZOPT_ERR_UNSUPPORTED, "%s: step '%s' updates on the GPU, whose step runs as one stream of kernels",
                    fn, name);
      case Feature::LinkedStep:
        return ZOPT_OK;  // its sum of squares to the host, the decision back (linked.cpp)
      case Feature::GradStreaming:
        return fail(ZOPT_ERR_UNSUPPORTED,
                    "%s: step '%s' updates on the GPU; gradient streaming is implemented for steps updated on the "
                    "CPU from host gradients",
                    fn, name);
      case Feature::TensorMemory:
        return ZOPT_OK;  // the device's pointer table rewritten (rebind.cpp)
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

  zopt_status check_tensor(const zopt_optimizer *o, int t, void *param, void *grad, const char *fn) const override {
    return gpu_check_tensor(o, t, param, grad, fn);
  }
  void checks_done(const zopt_optimizer *) const override { gpu_forget_checked(g); }

  zopt_status memory_moved(zopt_optimizer *o, const int32_t *tensors, int64_t n) override {
    return gpu_memory_moved(o, tensors, n);
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

  zopt_status begin_linked(zopt_optimizer *o, const char *fn) override { return gpu_begin_linked(o, fn); }

  zopt_status begin_step(zopt_optimizer *o, exec::StepState *st, bool) override {
    applied = false;
    if (st->linked)  // check_linked asked begin_linked already; a caller of exec:: may not have
      if (zopt_status s = gpu_begin_linked(o, "zopt_optimizer_step_linked")) return s;
    return gpu_begin_step(o, &capturing);  // the active mask is on the device (push)
  }
  zopt_status run_op(zopt_optimizer *o, exec::StepState *st, size_t i) override {
    const uint32_t code = o->d->program[i].code;
    if (st->linked && code == ZOPT_OP_NORM) {  // this part's sum to the host
      st->has_norm = true;
      return gpu_linked_sumsq(o, &st->sumsq);
    }
    if (st->linked && !applied && (code == ZOPT_OP_UPDATE || code == ZOPT_OP_FINISH)) {
      size_t prepare = 0;
      while (o->d->program[prepare].code != ZOPT_OP_PREPARE) ++prepare;  // validate_program: there is one
      if (zopt_status s = gpu_apply_linked(o, st->ctl, prepare)) return s;
      applied = true;
    }
    return gpu_run_op(o, i);
  }
  // Alone, the device decides (SUMSQ's last block): nothing is skipped on
  // the host. Linked, the host's CONTROL on every part's sum (the skip
  // leaves UPDATE out; run_op writes the decision to the device).
  void decide(zopt_optimizer *o, exec::StepState *st, double sumsq) override {
    if (!st->linked) return;
    st->ctl = exec::decide(o, st->has_norm ? sumsq : 0.0);
    st->norm = st->ctl.norm;
    st->skipped = st->has_norm && st->ctl.skip != 0;
    st->clip = st->ctl.clip_coef;
  }
  void end_step(zopt_optimizer *o, exec::StepState *st, zopt_step_result *result) override {
    gpu_end_step(o, capturing, result);
    if (st->linked && result) {  // decided on the host: known now
      result->grad_norm = st->has_norm ? st->norm : NAN;
      result->skipped = st->skipped ? 1 : 0;
      result->loss_scale = st->S;
    }
  }

  void *state_ptr(const zopt_optimizer *o, int t, int si) const override { return gpu_state_ptr(o, t, si); }
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
          info->state_bytes += ((uint64_t)gpu_state_bytes(o, gr, (int)s) + 63) & ~(uint64_t)63;
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
  zopt_status set_max_norm(zopt_optimizer *o, double value) override {
    return gpu_set_max_norm(o, value);  // and into the device's step globals
  }

  zopt_status set_stream(zopt_optimizer *, void *stream) override { return gpu_set_stream(g, stream); }
  zopt_status device_result(zopt_optimizer *o, zopt_step_result *result) override { return gpu_result(o, result); }
  zopt_status set_device_allocator(zopt_optimizer *o, const zopt_device_allocator *a) override {
    return gpu_set_allocator(o, a);
  }
};

GpuState *G(const zopt_optimizer *o) { return static_cast<const CudaBackend *>(o->backend)->g; }

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
