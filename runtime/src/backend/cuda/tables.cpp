// backend/cuda/tables.cpp - a GPU step's device memory and tables: its
// allocations (the caller's allocator or cuMemAlloc), the layout of every
// group's flat state buffers, the segment table and work list built at
// finalize, the masters initialized from the params; the step state the
// host pushes (globals with the gradient scale, tensor counts, the active
// mask, the scaler, hyperparameters, max_norm) and pulls back; a state
// copied to or from the host; everything freed.
#include "backend/cuda/cuda_internal.h"

#include "internal.h"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <vector>

using namespace zopt;
using namespace zopt::cu;

namespace {

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
// scalar head, vector middle, scalar tail). With q8 moments (abi.h "q8
// moments") every segment starts at a multiple of ZOPT_Q8_BLOCK instead, no
// phase: the UPDATE runs an element per thread (no vector accesses), and a
// PER_BLOCK state's segment is then block offset / ZOPT_Q8_BLOCK of its
// buffer (gpu_state_ptr). Returns the largest numel.
int64_t gpu_layout(zopt_optimizer *o) {
  const zopt_step_descriptor *d = o->d;
  const bool q8 = has_q8(d);
  const int64_t A = q8 ? std::max<int64_t>(gpu_align(d), ZOPT_Q8_BLOCK) : gpu_align(d);
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
      const int64_t phase = q8 ? 0 : (lanes - head % lanes) % lanes;
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
// it (a power of two in [64, 2^30], [ZOPT_Q8_BLOCK, 2^30] with q8 moments:
// tests). Chunks start at multiples of it within their tensor, so at q8
// block boundaries.
zopt_status pick_chunk(const zopt_optimizer *o, int64_t target, int64_t *out) {
  if (const char *e = getenv("ZOPT_GPU_CHUNK"); e && *e) {
    char *end = nullptr;
    long long v = strtoll(e, &end, 10);
    // q8 moments: a chunk is whole q8 blocks of its tensor (abi.h).
    const long long lo = has_q8(o->d) ? ZOPT_Q8_BLOCK : 64;
    if (*end || v < lo || v > (1ll << 30) || (v & (v - 1)))
      return fail(ZOPT_ERR_INVALID_ARGUMENT, "ZOPT_GPU_CHUNK=%s: expected a power of two in [%lld, 2^30]%s", e, lo,
                  lo > 64 ? " (a step with q8 moments: whole q8 blocks)" : "");
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

}  // namespace

namespace zopt {

// Bytes of state si's flat buffer in group gr (a PER_BLOCK state: one
// element per ZOPT_Q8_BLOCK of the group's padded elements).
size_t gpu_state_bytes(const zopt_optimizer *o, const Group &gr, int si) {
  return (size_t)state_numel(o->d, si, gr.padded_total) * dtype_size(o->d->states[si].dtype);
}

// State si of tensor t in its group's flat buffer (a PER_BLOCK state: the
// tensor's block 0, its segment starting at a block boundary: gpu_layout).
void *gpu_state_ptr(const zopt_optimizer *o, int t, int si) {
  const Tensor &x = o->tensors[t];
  const uint32_t kind = o->d->states[si].kind;
  if (kind == ZOPT_STATE_PARAM) return x.param;
  if (kind == ZOPT_STATE_GRAD) return x.grad;
  char *b = (char *)o->groups[x.group].buffers[si];
  const int64_t at = is_per_block(o->d, si) ? x.offset / ZOPT_Q8_BLOCK : x.offset;
  return b + (size_t)at * dtype_size(o->d->states[si].dtype);
}

zopt_status gpu_set_allocator(zopt_optimizer *o, const zopt_device_allocator *a) {
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

zopt_status gpu_finalize(zopt_optimizer *o) {
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
  // Flat state buffers per group, zero-filled (moments and padding; q8
  // codes: the map's zero code, their absmax 0: abi.h "q8 moments").
  for (auto &gr : o->groups) {
    if (!gr.padded_total) continue;
    for (uint32_t k = 0; k < d->num_states; ++k) {
      if (!is_owned_kind(d->states[k].kind)) continue;
      size_t bytes = gpu_state_bytes(o, gr, (int)k);
      CUdeviceptr p = 0;
      if (zopt_status st = dalloc(g, bytes, &p, state_kind_name(d->states[k].kind))) return undo(st);
      gr.buffers[k] = (void *)(uintptr_t)p;
      if (CUresult r = cu->MemsetD8Async(p, zero_byte(d, (int)k), bytes, s))
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
  try {
    g->h_ptrs = std::move(ptrs);  // kept for tensors moved later (rebind.cpp)
    g->ptrs_graphed.assign(g->h_ptrs.size(), 0);
  } catch (...) {
    return undo(fail(ZOPT_ERR_OUT_OF_MEMORY, "zopt_optimizer_finalize: out of host memory"));
  }
  g->ptrs_dirty = g->ptrs_in_graph = false;
  gpu_note_null_grads(o, g);
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
zopt_status gpu_push(zopt_optimizer *o) {
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
  // The clip threshold the kernels' CONTROL reads (zopt_optimizer_set_max_norm).
  const double max_norm = o->max_norm;
  if (!r) r = g->cu->MemcpyHtoDAsync(sg_max_norm(g), &max_norm, 8, g->stream);
  if (!r && hypers) r = g->cu->MemcpyHtoDAsync(g->d_hypers, g->h_hypers.data(), g->h_hypers.size() * 8, g->stream);
  if (!r) r = g->cu->StreamSynchronize(g->stream);
  if (r) return fail(ZOPT_ERR_INTERNAL, "writing the GPU step state: %s", error_string(r));
  if (hypers) g->hypers_dirty = false;
  g->max_norm_dirty = false;
  g->device_ahead = false;
  return ZOPT_OK;
}

// Reads the device's step state (globals, scaler, and the step globals when
// `sg` is given) with one stream synchronisation, after the last step
// (wherever it ran), and refreshes the host copies in `o` (step counts,
// scaler).
zopt_status read_device_state(zopt_optimizer *o, zopt_gpu_step_globals *sg, zopt_gpu_scaler *sc,
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

zopt_status gpu_pull(zopt_optimizer *o) {
  // After a capture, replays advance the device's state unseen: always read.
  if (!G(o)->device_ahead && !G(o)->captured) return ZOPT_OK;
  zopt_gpu_scaler sc;
  return read_device_state(o, nullptr, &sc, "reading the GPU step state");
}

void gpu_hypers_changed(zopt_optimizer *o) { G(o)->hypers_dirty = true; }

// Writes `value` to the device double at `p` on the optimizer's stream, by
// value (two memsets: no host buffer to keep alive), after the steps
// already enqueued (on whatever stream: a replay records `done` too) and
// before the next ones (they wait for `hypers_ready`).
static CUresult write_f64_ordered(GpuState *g, CUdeviceptr p, double value) {
  CUstream s = g->stream;
  uint32_t w[2];
  memcpy(w, &value, 8);
  CUresult r = g->done_recorded ? g->cu->StreamWaitEvent(s, g->done, 0) : CUDA_SUCCESS;
  if (!r) r = g->cu->MemsetD32Async(p, w[0], 1, s);
  if (!r) r = g->cu->MemsetD32Async(p + 4, w[1], 1, s);
  if (!r) r = g->cu->EventRecordWithFlags(g->hypers_ready, s, 0);
  if (!r) g->hypers_recorded = true;
  return r;
}

// zopt_optimizer_set_max_norm: the SUMSQ and FINISH kernels read it from the
// step globals at run time, so it is written there as a hyperparameter is.
zopt_status gpu_set_max_norm(zopt_optimizer *o, double value) {
  GpuState *g = G(o);
  if (!g->d_sg || o->max_norm == value) {  // before finalize: finalize pushes it
    o->max_norm = value;
    return ZOPT_OK;
  }
  ZOPT_CTX_SCOPE(g);
  bool cap = false;
  if (zopt_status st = gpu_capturing(g, g->stream, &cap)) return st;
  if (cap)
    return fail(ZOPT_ERR_BAD_STATE,
                "zopt_optimizer_set_max_norm: the optimizer's stream is capturing a CUDA graph; a value written "
                "now would be baked into the graph. Set max_norm between replays, outside the capture: every "
                "replay reads it from the device, so it uses the value set before it");
  if (CUresult r = write_f64_ordered(g, sg_max_norm(g), value)) {
    g->max_norm_dirty = true;  // half written, maybe: the next step or push writes o->max_norm again
    return fail(ZOPT_ERR_INTERNAL, "zopt_optimizer_set_max_norm: writing the device's step globals: %s",
                error_string(r));
  }
  o->max_norm = value;
  return ZOPT_OK;
}

zopt_status gpu_set_hyper(zopt_optimizer *o, int group, int hi, double value) {
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
  if (CUresult r = write_f64_ordered(g, g->d_hypers + (CUdeviceptr)at * 8, value)) {
    g->hypers_dirty = true;  // the next step or push uploads the whole table
    return fail(ZOPT_ERR_INTERNAL, "zopt_optimizer_set_hyper: writing the device's hyperparameter table: %s",
                error_string(r));
  }
  return ZOPT_OK;
}

zopt_status gpu_copy(const zopt_optimizer *o, int t, int si, void *host, size_t bytes, bool to_device) {
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

zopt_status gpu_refresh_master(zopt_optimizer *o, int first, int count) {
  GpuState *g = G(o);
  ZOPT_CTX_SCOPE(g);
  if (zopt_status st = gpu_begin_host_access(g, "zopt_optimizer_refresh_master")) return st;
  return init_from_param(o, first, count);
}

void gpu_free(zopt_optimizer *o) {
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

}  // namespace zopt
