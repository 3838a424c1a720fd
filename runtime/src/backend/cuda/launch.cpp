// backend/cuda/launch.cpp - a GPU step: the program checked at finalize
// (the ops the backend launches), then per step the hyperparameters' wait,
// each op as a launch on the optimizer's stream (PREPARE, SUMSQ whose last
// block decides with the step's control, UPDATE, FINISH), the event every
// later read waits for, and the step's result read back.
#include "backend/cuda/cuda_internal.h"

#include "internal.h"

#include <algorithm>
#include <cmath>
#include <cstring>

using namespace zopt;
using namespace zopt::cu;

namespace zopt {

// The ops the GPU backend launches, as the zprog verifier and the
// descriptor's checks order them (docs/Dialects/Program.md): every op on
// the GPU, no copies, the norm exactly when the step has its SUMSQ kernel.
zopt_status validate_program(const zopt_optimizer *o) {
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

// A step (exec/ drives it through CudaBackend): before the first op, the
// hyperparameter table's upload (after a failed write) and the wait for
// its latest write; `cap` says whether the stream is capturing a graph.
zopt_status gpu_begin_step(zopt_optimizer *o, bool *capturing) {
  GpuState *g = G(o);
  const Driver *cu = g->cu;
  const zopt_step_descriptor *d = o->d;
  ZOPT_CTX_SCOPE(g);
  CUstream s = g->stream;
  bool cap = false;
  if (zopt_status st = gpu_capturing(g, s, &cap)) return st;
  *capturing = cap;
  // Tensors' memory: the pointer table whole where it may be stale, every
  // active tensor with gradient memory.
  if (zopt_status st = gpu_ptrs_before_step(o, cap)) return st;
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
  if (g->globals_dirty) {
    // Only after a linked step failed to write the CLIP_COEF global back
    // to 1 (cuda/linked.cpp).
    if (cap)
      return fail(ZOPT_ERR_BAD_STATE,
                  "zopt_optimizer_step: the device's clip coefficient is stale (a failed write of a linked step) "
                  "and the stream is capturing a CUDA graph: step once outside the capture first");
    for (size_t gi = 0; gi < o->groups.size(); ++gi) {
      const CUdeviceptr p = g->d_globals + (gi * ZOPT_NUM_GLOBALS + ZOPT_GLOBAL_CLIP_COEF) * 8;
      const double one = 1.0;
      uint32_t w[2];
      memcpy(w, &one, 8);
      CU_TRY(cu->MemsetD32Async(p, w[0], 1, s), "cuMemsetD32Async(CLIP_COEF)");
      CU_TRY(cu->MemsetD32Async(p + 4, w[1], 1, s), "cuMemsetD32Async(CLIP_COEF)");
    }
    g->globals_dirty = false;
  }
  if (g->max_norm_dirty) {
    // Only after a failed zopt_optimizer_set_max_norm: the device may hold
    // half of a double; the optimizer's max_norm (the value before that
    // call) is written again, ordered like a hyperparameter write.
    if (cap)
      return fail(ZOPT_ERR_BAD_STATE,
                  "zopt_optimizer_step: the device's max_norm is stale (a failed zopt_optimizer_set_max_norm) and "
                  "the stream is capturing a CUDA graph: step once outside the capture first");
    g->h_max_norm = o->max_norm;
    CU_TRY(cu->MemcpyHtoDAsync(sg_max_norm(g), &g->h_max_norm, 8, s), "cuMemcpyHtoDAsync(max_norm)");
    CU_TRY(cu->EventRecordWithFlags(g->hypers_ready, s, 0), "cuEventRecord");
    g->hypers_recorded = true;
    g->max_norm_dirty = false;
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
zopt_status gpu_run_op(zopt_optimizer *o, size_t i) {
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
      // One block per ZOPT_GPU_FINISH_BLOCK tensors where the kernel strides
      // over any grid (ZOPT_FLAG_FINISH_GRID), else the one block it needs.
      unsigned fgrid = 1;
      if (d->flags & ZOPT_FLAG_FINISH_GRID)
        fgrid = (unsigned)std::min<int64_t>(std::max<int64_t>((nrows + ZOPT_GPU_FINISH_BLOCK - 1) / ZOPT_GPU_FINISH_BLOCK, 1),
                                            1024);
      CU_TRY(cu->LaunchKernel(g->finish, fgrid, 1, 1, ZOPT_GPU_FINISH_BLOCK, 1, 1, 0, s, args, nullptr),
             "launching FINISH");
      return ZOPT_OK;
    }
  }
  return fail(ZOPT_ERR_INTERNAL, "step '%s': program op %zu (code %u) has no GPU launch", d->name, i,
              d->program[i].code);
}

// After the last op: the event every later read and stream waits for.
zopt_status gpu_end_step(zopt_optimizer *o, bool cap, zopt_step_result *result) {
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

zopt_status gpu_result(zopt_optimizer *o, zopt_step_result *result) {
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

}  // namespace zopt
