// backend/cuda/linked.cpp - a GPU step as a part of a linked step
// (zopt_optimizer_step_linked with other optimizers: one norm, one skip
// decision; docs/GPU.md "A GPU part of a linked step"). The step's
// program runs as always (PREPARE, SUMSQ, UPDATE, FINISH on the
// optimizer's stream); what changes:
//
//   * the NORM: the SUMSQ kernel's last block has added this part's block
//     partials in block order into the step globals' sumsq; that sum comes
//     to the host (a copy and a stream synchronisation), where the linked
//     step adds every part's sum in part order (optimizer/step.cpp);
//   * the decision: the host's CONTROL (the compiled one, exec::decide) on
//     the linked sum, as for the CPU parts; before the first UPDATE or
//     FINISH launch the step globals get the linked sum and that decision
//     (norm, clip coefficient, skip), so the device's UPDATE skips and its
//     FINISH (CONTROL again, on the same sum, max_norm and scaler) counts
//     and scales exactly as the host decided; with clipping, PREPARE runs
//     again with the clip coefficient as the CLIP_COEF global (restored to
//     1 after it), the coefficients SUMSQ's last block wrote from this
//     part's own norm replaced.
//
// No clip arithmetic here: the device and the host run the step's one
// CONTROL. A linked GPU step waits for the device at its NORM, so it is
// not capturable: refused inside a CUDA graph capture.
#include "backend/cuda/cuda_internal.h"

#include "internal.h"

#include <cstddef>
#include <cstring>

using namespace zopt;
using namespace zopt::cu;

namespace zopt {

zopt_status gpu_begin_linked(zopt_optimizer *o, const char *fn) {
  GpuState *g = G(o);
  if (!o->finalized) return ZOPT_OK;  // check_linked refuses it
  ZOPT_CTX_SCOPE(g);
  if (zopt_status st = refuse_if_capturing(
          g, g->stream, ZOPT_ERR_BAD_STATE,
          "%s: step '%s' is a GPU part of a linked step and its stream is capturing a CUDA graph: a linked step "
          "brings the GPU part's sum of squares to the host (a copy and a wait) to decide once for every part, which "
          "a graph cannot hold. Step it outside the capture, or capture a GPU step alone",
          fn, o->d->name))
    return st;
  return gpu_pull(o);  // its counts and scaler, compared with the other parts'
}

zopt_status gpu_linked_sumsq(zopt_optimizer *o, double *sumsq) {
  GpuState *g = G(o);
  ZOPT_CTX_SCOPE(g);
  if (!(o->d->flags & ZOPT_FLAG_SUMSQ)) return ZOPT_OK;  // validate_program: no NORM op then
  CU_TRY(g->cu->MemcpyDtoHAsync(&g->h_linked.sumsq, g->d_sg + offsetof(zopt_gpu_step_globals, sumsq), 8, g->stream),
         "cuMemcpyDtoHAsync(the GPU part's sum of squares)");
  CU_TRY(g->cu->StreamSynchronize(g->stream), "cuStreamSynchronize(the GPU part's sum of squares)");
  *sumsq = g->h_linked.sumsq;
  return ZOPT_OK;
}

// Writes the device double at `p` by value, ordered on the stream.
static CUresult write_f64(GpuState *g, CUdeviceptr p, double value) {
  uint32_t w[2];
  memcpy(w, &value, 8);
  CUresult r = g->cu->MemsetD32Async(p, w[0], 1, g->stream);
  if (!r) r = g->cu->MemsetD32Async(p + 4, w[1], 1, g->stream);
  return r;
}

zopt_status gpu_apply_linked(zopt_optimizer *o, const zopt_control &ctl, size_t prepare_op) {
  GpuState *g = G(o);
  const zopt_step_descriptor *d = o->d;
  if (!(d->flags & ZOPT_FLAG_SUMSQ)) return ZOPT_OK;  // no norm: nothing decided on the device
  ZOPT_CTX_SCOPE(g);
  CUstream s = g->stream;
  // sumsq, norm, clip_coef, nonfinite, skip; not the counters or max_norm.
  zopt_gpu_step_globals &h = g->h_linked;
  h.sumsq = ctl.sumsq;
  h.norm = ctl.norm;
  h.clip_coef = ctl.clip_coef;
  h.nonfinite = h.skip = ctl.skip ? 1u : 0u;
  CU_TRY(g->cu->MemcpyHtoDAsync(g->d_sg, &h, offsetof(zopt_gpu_step_globals, blocks_done), s),
         "cuMemcpyHtoDAsync(the linked step's decision)");
  if (ctl.skip || !(d->flags & ZOPT_FLAG_CLIP)) return ZOPT_OK;
  const size_t NG = o->groups.size();
  for (size_t gi = 0; gi < NG; ++gi)
    if (CUresult r = write_f64(g, g->d_globals + (gi * ZOPT_NUM_GLOBALS + ZOPT_GLOBAL_CLIP_COEF) * 8, ctl.clip_coef))
      return fail(ZOPT_ERR_INTERNAL, "writing the linked step's clip coefficient: %s", error_string(r));
  zopt_status st = gpu_run_op(o, prepare_op);
  // The CLIP_COEF global is 1 between steps (gpu_push), whatever PREPARE did.
  for (size_t gi = 0; gi < NG; ++gi)
    if (CUresult r = write_f64(g, g->d_globals + (gi * ZOPT_NUM_GLOBALS + ZOPT_GLOBAL_CLIP_COEF) * 8, 1.0)) {
      g->globals_dirty = true;
      if (!st) st = fail(ZOPT_ERR_INTERNAL, "restoring the CLIP_COEF global: %s", error_string(r));
    }
  return st;
}

}  // namespace zopt
