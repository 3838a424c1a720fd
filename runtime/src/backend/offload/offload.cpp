// backend/offload/offload.cpp - the offload backend (offload.h): steps
// whose params and grads live on the GPU while the optimizer states and the
// update run on the CPU (ZeRO-Offload; a `param : bf16 on gpu`,
// `master : f32 on cpu` description). See docs/GPU.md "Offloaded steps".
//
// The CPU backend (backend/cpu, the host executor of exec/) does the work:
// PARAM and GRAD are given pinned host staging buffers in the full layout
// (state_ptr returns them), so the CPU kernels, the norm reduction, the
// collectives, the thread partition and checkpoints are the CPU step's,
// unchanged. The program's COPY ops (zopt-plan puts them first and last)
// call copy_staged on the optimizer's stream:
//   first: grads (and params, if the kernel reads them) device -> staging,
//          then one stream synchronisation (the CPU needs the bytes);
//   last:  unless the step was skipped, the written params staging ->
//          device, asynchronously, then the `staging` event: bucket by
//          bucket in forward order on the optimizer's copy stream, each
//          bucket with its event (params_back.h: the caller's later work on
//          the stream sees them unless the wait mode is per bucket; at W
//          ranks after the ALL_GATHER, or per bucket in the tail). Any
//          new stream (zopt_optimizer_set_stream) is ordered after the
//          event, and the next step's copies wait for it before the staging
//          is written again (whatever stream they run on).
// An offloaded step needs the host between its copies, so it cannot be
// captured in a CUDA graph: the first copy refuses a capturing stream with
// a message that says so (rather than the driver's "operation not permitted
// when stream is capturing" from the synchronisation).
#include "backend/offload/offload.h"

#include "backend/offload/params_back.h"
#include "backend/offload/pipeline.h"
#include "backend/offload/tail.h"

#include "backend/cpu/cpu.h"
#include "backend/cuda/device.h"
#include "exec/exec.h"

#include <new>

using namespace zopt;
using namespace zopt::cu;

namespace zopt {

bool is_offload_step(const zopt_step *s) {
  if (s->has_gpu_code) return false;
  const zopt_step_descriptor *d = &s->desc;
  bool any_gpu = false;
  for (uint32_t i = 0; i < d->num_states; ++i) {
    const zopt_state_desc &sd = d->states[i];
    if (sd.placement != ZOPT_PLACE_GPU) continue;
    if (is_owned_kind(sd.kind)) return false;  // a GPU-placed optimizer state: not an offload
    any_gpu = true;
  }
  return any_gpu;
}

namespace {

zopt_status offload_attach(zopt_optimizer *o, GpuState **out) {
  const zopt_step_descriptor *d = o->d;
  // Params and grads must be on the same side (the verifier's placement
  // rules allow only param/grad on the GPU here; both, for an offload).
  const int pi = o->step->param_index, gi = o->step->grad_index;
  if (d->states[pi].placement != ZOPT_PLACE_GPU || d->states[gi].placement != ZOPT_PLACE_GPU)
    return fail(ZOPT_ERR_UNSUPPORTED,
                "step '%s': offload needs both param and grad on the GPU (param on %s, grad on %s)", d->name,
                d->states[pi].placement == ZOPT_PLACE_GPU ? "gpu" : "cpu",
                d->states[gi].placement == ZOPT_PLACE_GPU ? "gpu" : "cpu");
  // ZeRO-3 partitions the params: the runtime would hold each rank's shard
  // on the host (no staging of the whole tensors), while the copies to and
  // from the GPU address whole tensors (state_ptr is NULL for a sharded
  // state at 2 or more ranks: finalize copied the params into address 0),
  // and zopt_optimizer_gather_params, the only writer of a ZeRO-3 user
  // param, does not serve GPU params. Not implemented: refused here.
  if (d->states[pi].flags & ZOPT_STATE_PARTITIONED)
    return fail(ZOPT_ERR_UNSUPPORTED,
                "step '%s': ZeRO-3 (zero_stage 3: partitioned params) with the params on the GPU and the optimizer "
                "states on the CPU (offload) is not implemented: the offloaded step copies whole params between the "
                "GPU and the host, ZeRO-3 keeps only each rank's shard. Compile the offloaded step with "
                "zero_stage 2 (the same sharded optimizer states on the CPU; params whole on every GPU)",
                d->name);
  return gpu_state_create(
      d->name, "offloads its params from the GPU", [](GpuState *g, const void *) { return gpu_events(g); }, nullptr,
      nullptr, out);
}

zopt_status offload_alloc_staging(GpuState *g, size_t bytes, void **out) {
  ZOPT_CTX_SCOPE(g);
  void *p = nullptr;
  CUresult r = g->cu->MemHostAlloc(&p, std::max<size_t>(bytes, 64), 0);
  if (r != CUDA_SUCCESS || !p)
    return fail(ZOPT_ERR_OUT_OF_MEMORY, "zopt_optimizer_finalize: cuMemHostAlloc(%zu bytes) for a staging buffer: %s",
                bytes, error_string(r));
  g->pinned.push_back(p);
  *out = p;
  return ZOPT_OK;
}

zopt_status offload_copy_state(GpuState *g, ParamsBack &pb, zopt_optimizer *o, int si, bool to_device, bool sync) {
  ZOPT_CTX_SCOPE(g);
  if (zopt_status st = refuse_if_capturing(
          g, g->stream, ZOPT_ERR_UNSUPPORTED,
          "step '%s' is offloaded (ZeRO-Offload: its update runs on the CPU, between copies of the grads from the GPU "
          "and of the params back), so it needs the host in the middle of the step and cannot be captured in a CUDA "
          "graph, but the optimizer's stream is capturing: run the offloaded step outside the capture (e.g. after "
          "torch.cuda.graph's replay of the forward and backward)",
          o->d->name))
    return st;
  const size_t es = dtype_size(o->d->states[si].dtype);
  const bool param = o->d->states[si].kind == ZOPT_STATE_PARAM;
  // The params back bucket by bucket on the copy stream (at W ranks after
  // the program's ALL_GATHER made the staging whole).
  if (to_device && param) return params_back_all(g, pb, o, si);
  // The staging is read by the previous step's copies to the GPU until the
  // `staging` event; copies into it (and the CPU update after them) wait.
  if (!to_device)
    if (zopt_status st = gpu_wait_own_work(g, g->stream)) return st;
  for (size_t t = 0; t < o->tensors.size(); ++t) {
    const Tensor &x = o->tensors[t];
    if (!x.numel) continue;
    CUdeviceptr dev = (CUdeviceptr)(uintptr_t)(param ? x.param : x.grad);
    void *host = state_ptr(o, (int)t, si);
    size_t bytes = (size_t)x.numel * es;
    CUresult r = to_device ? g->cu->MemcpyHtoDAsync(dev, host, bytes, g->stream)
                           : g->cu->MemcpyDtoHAsync(host, dev, bytes, g->stream);
    if (r)
      return fail(ZOPT_ERR_INTERNAL, "offload: copying the %s of tensor %zu %s the GPU: %s", param ? "param" : "grad",
                  t, to_device ? "to" : "from", error_string(r));
  }
  if (to_device) {
    if (CUresult r = g->cu->EventRecordWithFlags(g->staging, g->stream, 0))
      return fail(ZOPT_ERR_INTERNAL, "offload: cuEventRecord after the copies to the GPU: %s", error_string(r));
    g->staging_recorded = true;
  }
  if (sync)
    if (CUresult r = g->cu->StreamSynchronize(g->stream))
      return fail(ZOPT_ERR_INTERNAL, "offload: waiting for the copies %s the GPU: %s", to_device ? "to" : "from",
                  error_string(r));
  return ZOPT_OK;
}

zopt_status offload_copy(GpuState *g, const zopt_optimizer *o, int t, int si, void *host, size_t bytes,
                         bool to_device) {
  ZOPT_CTX_SCOPE(g);
  const Tensor &x = o->tensors[t];
  const bool param = o->d->states[si].kind == ZOPT_STATE_PARAM;
  // After the step's pending param copies (the `staging` event, any stream).
  if (zopt_status st = gpu_begin_host_access(g, param ? "copying a param" : "copying a grad")) return st;
  CUdeviceptr dev = (CUdeviceptr)(uintptr_t)(param ? x.param : x.grad);
  CUresult r = to_device ? g->cu->MemcpyHtoDAsync(dev, host, bytes, g->stream)
                         : g->cu->MemcpyDtoHAsync(host, dev, bytes, g->stream);
  if (!r) r = g->cu->StreamSynchronize(g->stream);
  if (r) return fail(ZOPT_ERR_INTERNAL, "copying the %s of tensor %d: %s", param ? "param" : "grad", t, error_string(r));
  return ZOPT_OK;
}

size_t offload_staging_count(const GpuState *g) { return g ? g->pinned.size() : 0; }

void offload_free_staging(GpuState *g, size_t first, size_t last) {
  if (!g || first >= last || last > g->pinned.size()) return;
  CtxScope scope(g);
  if (!scope.status()) {
    gpu_sync_own_work(g);  // pending copies read the staging
    for (size_t i = first; i < last; ++i) g->cu->MemFreeHost(g->pinned[i]);
  }
  g->pinned.erase(g->pinned.begin() + (long)first, g->pinned.begin() + (long)last);
}

void offload_free(GpuState *g) {
  if (!g) return;
  {
    CtxScope scope(g);
    if (!scope.status()) {
      // Pending param copies read the staging; wait for them by their event,
      // not by the caller's stream (which may be destroyed by now).
      gpu_sync_own_work(g);
      for (void *p : g->pinned) g->cu->MemFreeHost(p);
      for (CUevent e : {g->done, g->hypers_ready, g->staging})
        if (e) g->cu->EventDestroy(e);
    }
  }
  cuda_detach(g);
  delete g;
}

// The CPU backend over staged params and grads.
class OffloadBackend final : public CpuBackend {
 public:
  explicit OffloadBackend(GpuState *state) : g(state) {}
  GpuState *g;
  OffloadPipe pipe;  // bucket readiness (pipeline.h)
  ParamsBack pb;     // the params' copies back (params_back.h)
  OffloadTail tail;  // a step's work after it returned (tail.h)

  const char *name() const override { return "offload"; }
  zopt_status supports(const zopt_optimizer *o, Feature f, const char *fn) const override {
    if (f == Feature::GradStreaming)
      return fail(ZOPT_ERR_UNSUPPORTED,
                  "%s: step '%s' is offloaded; gradient streaming is implemented for steps updated on the CPU from "
                  "host gradients",
                  fn, o->d->name);
    if (f == Feature::GatherParams)
      return fail(ZOPT_ERR_UNSUPPORTED, "%s: the params of step '%s' live on the GPU, whole", fn, o->d->name);
    return CpuBackend::supports(o, f, fn);
  }
  zopt_status check_tensor(const zopt_optimizer *o, int t, void *param, void *grad, const char *fn) const override {
    return gpu_check_pointers(g, param, grad ? grad : param, t, fn);
  }
  void checks_done(const zopt_optimizer *) const override { gpu_forget_checked(g); }
  void destroy(zopt_optimizer *o) override {
    offload_pipe_free(g, pipe);  // the jobs are gone (the pipeline was freed first)
    params_back_free(g, pb);
    CpuBackend::destroy(o);  // host buffers, not the pinned staging
    offload_free(g);         // pinned staging, events, the context
    g = nullptr;
  }
  bool host_state(const zopt_optimizer *o, int si) const override { return is_owned_kind(o->d->states[si].kind); }
  zopt_status read_state(const zopt_optimizer *o, int t, int si, void *out, size_t bytes) const override {
    if (is_owned_kind(o->d->states[si].kind)) return CpuBackend::read_state(o, t, si, out, bytes);
    return offload_copy(g, o, t, si, out, bytes, false);  // the user's device memory
  }
  zopt_status write_state(zopt_optimizer *o, int t, int si, const void *in, size_t bytes) override {
    if (is_owned_kind(o->d->states[si].kind)) return CpuBackend::write_state(o, t, si, in, bytes);
    return offload_copy(g, o, t, si, const_cast<void *>(in), bytes, true);
  }
  zopt_status refresh_master(zopt_optimizer *o, int first, int count) override {
    // The params are on the GPU: to the staging first.
    if (zopt_status st = copy_staged(o, o->step->param_index, false, true)) return st;
    return CpuBackend::refresh_master(o, first, count);
  }
  zopt_status set_stream(zopt_optimizer *, void *stream) override { return gpu_set_stream(g, stream); }
  bool stages() const override { return true; }
  zopt_status alloc_staging(zopt_optimizer *, size_t bytes, void **out) override {
    return offload_alloc_staging(g, bytes, out);
  }
  size_t staging_count(const zopt_optimizer *) const override { return offload_staging_count(g); }
  void free_staging(zopt_optimizer *, size_t first, size_t last) override { offload_free_staging(g, first, last); }
  zopt_status copy_staged(zopt_optimizer *o, int si, bool to_user, bool sync) override {
    return offload_copy_state(g, pb, o, si, to_user, sync);
  }
  // A pipelined step (bucket readiness): its copies were done per bucket,
  // its update commits or recomputes per bucket (pipeline.cpp).
  zopt_status grad_bucket_ready(zopt_optimizer *o, int b) override { return offload_bucket_ready(g, pipe, o, b); }
  zopt_status begin_step(zopt_optimizer *o, exec::StepState *st, bool first) override {
    if (zopt_status s = offload_pipelined_begin(g, o)) return s;
    return CpuBackend::begin_step(o, st, first);
  }
  zopt_status run_op(zopt_optimizer *o, exec::StepState *st, size_t i) override {
    bool handled = false;
    if (zopt_status s = offload_pipelined_op(g, pb, tail, o, st, i, &handled)) return s;
    return handled ? ZOPT_OK : CpuBackend::run_op(o, st, i);
  }
  void end_step(zopt_optimizer *o, exec::StepState *st, zopt_step_result *result) override {
    CpuBackend::end_step(o, st, result);
    if (tail.pending)
      tail.returned = exec::now_seconds();  // the tail ends the pipelined step (tail_join)
    else
      offload_pipelined_end(o, st->skipped, exec::now_seconds());
  }
  zopt_status join_tail(zopt_optimizer *o, const char *fn) override { return tail_join(tail, o, fn); }
  zopt_status set_param_wait(zopt_optimizer *, int mode) override {
    pb.mode = mode;
    return ZOPT_OK;
  }
  int param_wait(const zopt_optimizer *) const override { return pb.mode; }
  zopt_status wait_params(zopt_optimizer *o, int b, void *stream) override {
    if (zopt_status st = tail_wait_bucket(tail, o, b, "zopt_optimizer_wait_params")) return st;
    return params_back_wait(g, pb, o, b, stream);
  }
  const void *param_on_host(const zopt_optimizer *o, int t) const override {
    return state_ptr(o, t, o->step->param_index);  // the staging
  }
};

}  // namespace

zopt_status make_offload_backend(zopt_optimizer *o, Backend **out) {
  GpuState *g = nullptr;
  if (zopt_status st = offload_attach(o, &g)) return st;
  OffloadBackend *be = new (std::nothrow) OffloadBackend(g);
  if (!be) {
    offload_free(g);
    return fail(ZOPT_ERR_OUT_OF_MEMORY, "out of memory");
  }
  zopt_status st;
  {
    CtxScope scope(g);
    st = scope.status();
    if (!st) st = params_back_init(g, be->pb);
  }
  if (st) {
    offload_free(g);
    delete be;
    return st;
  }
  *out = be;
  return ZOPT_OK;
}

}  // namespace zopt
