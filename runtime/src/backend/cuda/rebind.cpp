// backend/cuda/rebind.cpp - tensors whose memory moves after finalize
// (zopt_optimizer_set_tensor_memory, zopt_optimizer_set_grad_memory: a
// framework's fresh gradient tensors read in place). The kernels read each
// tensor's param and grad addresses from the device's state pointer table
// (d_states) at run time; its host copy (GpuState::h_ptrs) is patched and
// the changed entries written on the optimizer's stream, after the steps
// already enqueued (the `done` event: a replay on another stream records it
// too) and before the next (they wait for `hypers_ready`), as a
// hyperparameter write is ordered (docs/GPU.md "Tensor memory").
//
// Inside a CUDA graph capture the changed entries are written by value
// (two 32-bit memset nodes each: no host buffer in the graph), so every
// replay reads the memory the capture saw; since a replay may then have
// rewritten them, every later step outside a capture uploads the whole
// table again, and a later capture writes every entry a capture wrote.
#include "backend/cuda/cuda_internal.h"

#include "internal.h"

#include <algorithm>
#include <cstring>
#include <vector>

using namespace zopt;
using namespace zopt::cu;

namespace {

uint64_t entry(const zopt_optimizer *o, size_t t, size_t k) {
  return (uint64_t)(uintptr_t)state_ptr(o, (int)t, (int)k);
}

// Entry `at` of the table set to `v` by value on stream s (memset nodes in
// a capture).
CUresult write_entry(GpuState *g, CUstream s, size_t at, uint64_t v) {
  uint32_t w[2];
  memcpy(w, &v, 8);
  const CUdeviceptr p = g->d_states + (CUdeviceptr)at * 8;
  CUresult r = g->cu->MemsetD32Async(p, w[0], 1, s);
  if (!r) r = g->cu->MemsetD32Async(p + 4, w[1], 1, s);
  return r;
}

// The host copy of the whole table, from o->tensors.
void refill(const zopt_optimizer *o, GpuState *g) {
  const size_t NS = o->d->num_states;
  for (size_t t = 0; t < o->tensors.size(); ++t)
    for (size_t k = 0; k < NS; ++k) g->h_ptrs[t * NS + k] = entry(o, t, k);
}

// The pinned sources of the uploads, made at the first (a pageable source
// would let the driver synchronize with the stream to stage it: the host
// would wait for the steps already enqueued). On failure, none: pageable.
void make_pinned(GpuState *g) {
  const size_t bytes = std::max<size_t>(g->h_ptrs.size() * 8, 64);
  for (int k = 0; k < 2; ++k) {
    if (g->cu->MemHostAlloc(&g->ptrs_pinned[k], bytes, 0)) g->ptrs_pinned[k] = nullptr;
    if (g->ptrs_pinned[k] && g->cu->EventCreate(&g->ptrs_copied[k], EVENT_DISABLE_TIMING)) g->ptrs_copied[k] = nullptr;
    if (!g->ptrs_pinned[k] || !g->ptrs_copied[k]) {
      for (int j = 0; j <= k; ++j) {
        if (g->ptrs_pinned[j]) g->cu->MemFreeHost(g->ptrs_pinned[j]);
        if (g->ptrs_copied[j]) g->cu->EventDestroy(g->ptrs_copied[j]);
        g->ptrs_pinned[j] = nullptr;
        g->ptrs_copied[j] = nullptr;
      }
      return;
    }
  }
}

// The table's entries [lo, hi) from the host copy, after the steps already
// enqueued and before the next ones (outside a capture). The source is the
// pinned copy whose turn it is, once the copy made from it two uploads ago
// ran (its event: as a rule long done).
CUresult upload(GpuState *g, size_t lo, size_t hi) {
  CUstream s = g->stream;
  if (!g->ptrs_pinned[0]) make_pinned(g);
  const int k = g->ptrs_turn;
  const void *src = g->h_ptrs.data() + lo;
  CUresult r = CUDA_SUCCESS;
  if (g->ptrs_pinned[k]) {
    if (g->ptrs_copy_recorded[k]) r = g->cu->EventSynchronize(g->ptrs_copied[k]);
    if (r) return r;
    uint64_t *pin = (uint64_t *)g->ptrs_pinned[k] + lo;
    memcpy(pin, src, (hi - lo) * 8);
    src = pin;
  }  // else pageable: the driver stages it before the call returns
  if (g->done_recorded) r = g->cu->StreamWaitEvent(s, g->done, 0);
  if (!r) r = g->cu->MemcpyHtoDAsync(g->d_states + (CUdeviceptr)lo * 8, src, (hi - lo) * 8, s);
  if (!r && g->ptrs_pinned[k]) {
    r = g->cu->EventRecordWithFlags(g->ptrs_copied[k], s, 0);
    if (!r) {
      g->ptrs_copy_recorded[k] = true;
      g->ptrs_turn = k ^ 1;
    }
  }
  if (!r) r = g->cu->EventRecordWithFlags(g->hypers_ready, s, 0);
  if (!r) g->hypers_recorded = true;
  return r;
}

}  // namespace

namespace zopt {

void gpu_note_null_grads(const zopt_optimizer *o, GpuState *g) {
  g->null_grads = false;
  for (const Tensor &x : o->tensors) g->null_grads |= x.numel > 0 && !x.grad;
}

zopt_status gpu_memory_moved(zopt_optimizer *o, const int32_t *tensors, int64_t n) {
  GpuState *g = G(o);
  if (!g->d_states) return ZOPT_OK;  // not finalized: finalize builds the table
  ZOPT_CTX_SCOPE(g);
  CUstream s = g->stream;
  bool cap = false;
  if (zopt_status st = gpu_capturing(g, s, &cap)) return st;
  if (cap && g->ptrs_dirty)
    return fail(ZOPT_ERR_BAD_STATE,
                "moving a tensor's memory inside a CUDA graph capture: the device's state pointer table is stale (a "
                "failed write) and is rewritten whole by the next step outside a capture: step once outside the "
                "capture first");
  const zopt_step_descriptor *d = o->d;
  const size_t NS = d->num_states;
  const size_t kinds[2] = {(size_t)o->step->param_index, (size_t)o->step->grad_index};
  std::vector<size_t> changed;
  try {
    for (int64_t i = 0; i < n; ++i)
      for (size_t k : kinds) {
        const size_t at = (size_t)tensors[i] * NS + k;
        if (g->ptrs_dirty || g->h_ptrs[at] != entry(o, (size_t)tensors[i], k)) changed.push_back(at);
      }
  } catch (...) {
    return fail(ZOPT_ERR_OUT_OF_MEMORY, "out of memory");
  }
  gpu_note_null_grads(o, g);
  if (changed.empty()) return ZOPT_OK;
  CUresult r = CUDA_SUCCESS;
  if (cap) {
    // After every step already enqueued wherever it ran (an external wait
    // node: each replay waits for the latest step before its launch).
    r = g->cu->StreamWaitEvent(s, g->done, EVENT_WAIT_EXTERNAL);
    for (size_t i = 0; !r && i < changed.size(); ++i) {
      const size_t at = changed[i];
      const uint64_t v = entry(o, at / NS, at % NS);
      r = write_entry(g, s, at, v);
      if (!r) {
        g->h_ptrs[at] = v;
        g->ptrs_graphed[at] = 1;
        g->ptrs_in_graph = true;
      }
    }
  } else if (g->ptrs_dirty) {
    refill(o, g);
    r = upload(g, 0, g->h_ptrs.size());
  } else {
    size_t lo = changed[0], hi = changed[0] + 1;
    for (size_t at : changed) {
      g->h_ptrs[at] = entry(o, at / NS, at % NS);
      lo = std::min(lo, at);
      hi = std::max(hi, at + 1);
    }
    r = upload(g, lo, hi);  // one copy: the span of the changed entries
  }
  if (r) {
    g->ptrs_dirty = true;  // the caller puts the old pointers back; the next step rebuilds and uploads
    return fail(ZOPT_ERR_INTERNAL, "writing the device's state pointer table (tensor %d%s moved): %s",
                n ? (int)tensors[0] : -1, n > 1 ? " and others" : "", error_string(r));
  }
  if (!cap) g->ptrs_dirty = false;
  return ZOPT_OK;
}

zopt_status gpu_ptrs_before_step(zopt_optimizer *o, bool cap) {
  GpuState *g = G(o);
  if (g->ptrs_dirty) gpu_note_null_grads(o, g);  // (a failed call put other pointers back)
  if (g->null_grads)
    for (size_t t = 0; t < o->tensors.size(); ++t) {
      const Tensor &x = o->tensors[t];
      if (!x.grad && x.numel && (o->active.empty() || o->active[t]))
        return fail(ZOPT_ERR_INVALID_ARGUMENT,
                    "zopt_optimizer_step: tensor %zu has no gradient memory (zopt_optimizer_set_tensor_memory or "
                    "zopt_optimizer_set_grad_memory with grad NULL) but is active: mark it inactive with "
                    "zopt_optimizer_set_active",
                    t);
    }
  if (!g->ptrs_dirty && !g->ptrs_in_graph) return ZOPT_OK;
  CUstream s = g->stream;
  if (cap) {
    if (g->ptrs_dirty)
      return fail(ZOPT_ERR_BAD_STATE,
                  "zopt_optimizer_step: the device's state pointer table is stale (a failed write) and the stream "
                  "is capturing a CUDA graph: step once outside the capture first");
    // Another graph's replays may have written entries by value: this
    // graph writes them as the host has them.
    CU_TRY(g->cu->StreamWaitEvent(s, g->done, EVENT_WAIT_EXTERNAL), "cuStreamWaitEvent(done)");
    for (size_t at = 0; at < g->h_ptrs.size(); ++at)
      if (g->ptrs_graphed[at]) CU_TRY(write_entry(g, s, at, g->h_ptrs[at]), "cuMemsetD32Async(state table)");
    return ZOPT_OK;
  }
  if (g->ptrs_dirty) refill(o, g);
  if (CUresult r = upload(g, 0, g->h_ptrs.size())) {
    g->ptrs_dirty = true;
    return fail(ZOPT_ERR_INTERNAL, "zopt_optimizer_step: writing the device's state pointer table: %s",
                error_string(r));
  }
  g->ptrs_dirty = false;  // (ptrs_in_graph stays: replays may rewrite entries again)
  return ZOPT_OK;
}

}  // namespace zopt
