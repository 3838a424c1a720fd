// backend/cpu/cpu.cpp - the CPU backend (cpu.h): the host executor of exec/
// behind the backend interface, and state access in host memory.
#include "backend/cpu/cpu.h"

#include "agree.h"
#include "exec/exec.h"
#include "exec/speculate.h"

#include <new>

namespace zopt {

zopt_status CpuBackend::check_comm(const zopt_optimizer *o, zopt_comm *comm) const {
  if (zopt_comm_memory(comm) != ZOPT_COMM_MEM_HOST)
    return fail(ZOPT_ERR_INVALID_ARGUMENT,
                "zopt_optimizer_set_comm: communicator '%s' moves device memory, but step '%s' updates on the CPU: "
                "use a host communicator (mpi, loopback, torch gloo)",
                zopt_comm_name(comm), o->d->name);
  return ZOPT_OK;
}

zopt_status CpuBackend::finalize(zopt_optimizer *o) {
  if (o->world > 4096) return fail(ZOPT_ERR_UNSUPPORTED, "zopt_optimizer_finalize: world size %d > 4096", o->world);
  try {
    o->pool = new ThreadPool(o->num_threads);
  } catch (...) {
    return fail(ZOPT_ERR_OUT_OF_MEMORY, "zopt_optimizer_finalize: cannot start %d threads", o->num_threads);
  }
  auto bail = [&](zopt_status st) {
    exec::destroy(o);
    delete o->pool;
    o->pool = nullptr;
    return st;
  };
  if (zopt_status st = exec::build(o)) return bail(st);
  if (o->world > 1)
    if (zopt_status st = agree_at_finalize(o)) return bail(st);
  return ZOPT_OK;
}

void CpuBackend::destroy(zopt_optimizer *o) { exec::destroy(o); }

zopt_status CpuBackend::begin_step(zopt_optimizer *o, exec::StepState *st, bool first) {
  return exec::host_begin(o, st, first);
}

zopt_status CpuBackend::run_op(zopt_optimizer *o, exec::StepState *st, size_t i) {
  return exec::run_host_op(o, st, i);
}

void CpuBackend::decide(zopt_optimizer *o, exec::StepState *st, double sumsq) { exec::host_decide(o, st, sumsq); }

void CpuBackend::end_step(zopt_optimizer *o, exec::StepState *st, zopt_step_result *result) {
  exec::host_end(o, st, result);
}

void *CpuBackend::state_ptr(const zopt_optimizer *o, int t, int si) const {
  const Tensor &x = o->tensors[t];
  const uint32_t kind = o->d->states[si].kind;
  const exec::Program *P = o->prog;
  if (!P || !P->buf[si]) {  // the user's memory
    if (kind == ZOPT_STATE_PARAM) return x.param;
    if (kind == ZOPT_STATE_GRAD) return x.grad;
    return nullptr;  // not finalized
  }
  if (P->sharded[si] && o->world > 1) return nullptr;  // pieces: exec::runs
  // A full buffer (a sharded one at world size 1 is full): within a group
  // the buckets are contiguous, so the tensor's segment is too.
  const layout::Layout &L = P->layout_of(o->d, si, false);
  const layout::Segment &seg = L.tensors[t];
  char *b = (char *)P->buf[si];
  if (!seg.numel) return b;
  const layout::Bucket &k = L.buckets[seg.bucket];
  return b + (size_t)(k.local_offset + seg.flat - k.begin) * dtype_size(o->d->states[si].dtype);
}

zopt_status CpuBackend::read_state(const zopt_optimizer *o, int t, int si, void *out, size_t bytes) const {
  if (const void *p = state_ptr(o, t, si)) {
    if (bytes) memcpy(out, p, bytes);
    return ZOPT_OK;
  }
  void *dst[1] = {out};  // sharded across ranks: every rank reads
  return exec::gather_state(const_cast<zopt_optimizer *>(o), si, t, 1, dst);
}

zopt_status CpuBackend::write_state(zopt_optimizer *o, int t, int si, const void *in, size_t bytes) {
  if (void *p = state_ptr(o, t, si)) {
    if (bytes) memmove(p, in, bytes);
    return ZOPT_OK;
  }
  // Sharded: each rank keeps the elements it holds (no communication).
  std::vector<exec::Run> runs;
  exec::runs(o, t, si, &runs);
  const size_t es = dtype_size(o->d->states[si].dtype);
  for (const exec::Run &r : runs) memmove(r.ptr, (const char *)in + (size_t)r.start * es, (size_t)r.len * es);
  return ZOPT_OK;
}

zopt_status CpuBackend::refresh_master(zopt_optimizer *o, int first, int count) {
  const zopt_step_descriptor *d = o->d;
  const int pi = o->step->param_index;
  const uint32_t pdt = d->states[pi].dtype;
  for (uint32_t s = 0; s < d->num_states; ++s) {
    const uint32_t kind = d->states[s].kind, dt = d->states[s].dtype;
    const bool held_param = kind == ZOPT_STATE_PARAM && o->prog && o->prog->buf[s] && !o->prog->pinned[s];
    if (kind != ZOPT_STATE_MASTER && !held_param) continue;
    for (int t = first; t < first + count; ++t) {
      const Tensor &x = o->tensors[t];
      if (!x.numel) continue;
      const char *src = (const char *)param_on_host(o, t);
      std::vector<exec::Run> runs;
      exec::runs(o, t, (int)s, &runs);
      for (const exec::Run &r : runs) convert(src + (size_t)r.start * dtype_size(pdt), pdt, r.ptr, dt, r.len);
    }
  }
  return ZOPT_OK;
}

void CpuBackend::memory_info(const zopt_optimizer *o, zopt_memory_info *info) const {
  exec::state_bytes(o, &info->state_bytes, &info->state_bytes_one_rank, &info->scratch_bytes, &info->grad_bytes);
  info->bytes_cpu += info->state_bytes + info->grad_bytes + info->scratch_bytes;
  for (uint32_t s = 0; s < o->d->num_states; ++s)  // staging of device-resident tensors
    if (o->prog->pinned[s]) info->bytes_cpu += o->prog->buf_bytes[s];
  info->bytes_cpu += exec::spec_bytes(o);  // an offloaded step's speculation buffers
}

}  // namespace zopt
