//===- fake-cuda-twin.cpp - the stand-in runs a GPU step's kernels on the CPU --===//
//
// With ZOPT_FAKE_CUDA_TWIN=<twin.so> (the same description compiled for
// the CPU: the same states in the same order, the same prepare and control),
// libzopt-fake-cuda.so executes every kernel of a GPU step it is launched
// with, as abi.h "GPU kernels" defines it, through the twin's CPU kernels:
//
//   PREPARE  the twin's PREPARE per segment (its group's hyperparameters and
//            globals, the tensor's own t)
//   SUMSQ    the twin's SUMSQ over the chunks of the active segments, in
//            chunk order; the twin's CONTROL on the sum (norm, clip, skip
//            into the step globals); PREPARE again with the clip
//   UPDATE   the twin's UPDATE over the chunks of the active segments
//            (stochastic rounding: abi.h's key of the tensor's t, tensor,
//            index), nothing when the step globals say skip; with q8
//            moments each chunk must begin at a q8 block boundary, and the
//            absmax (PER_BLOCK) entries point at its block (abi.h "q8
//            moments": the CPU UPDATE's contract, so the twin's q8 kernel
//            runs a chunk as the GPU's runs it block by block)
//   FINISH   the twin's CONTROL on the step globals' sum and the scaler:
//            counts of the active tensors and groups, the scaler, 1/(S*D)
//   INIT     the master from the param (widening exactly; a remainder
//            master: 0)
//
// so that the runtime's CUDA backend (its tables, its program, its counts,
// masks and scaler on the "device") can be checked numerically against the
// CPU backend running the twin: the elementwise math is the same CPU kernel,
// so every stored bit agrees, and the norm differs only in the order of the
// chunk partials (the contract: clipped steps agree to the rounding of c).
//===----------------------------------------------------------------------===//
#include "zopt/abi.h"
#include "zopt/cpu.h"

#include <dlfcn.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace {

struct Twin {
  bool tried = false, ok = false;
  const zopt_step_descriptor *d = nullptr;
  zopt_prepare_fn prepare = nullptr;
  zopt_update_fn update = nullptr;
  zopt_sumsq_fn sumsq = nullptr;
  zopt_control_fn control = nullptr;
  size_t es[ZOPT_MAX_STATES] = {};
};

Twin &twin() {
  static Twin t;
  if (t.tried) return t;
  t.tried = true;
  const char *path = getenv("ZOPT_FAKE_CUDA_TWIN");
  if (!path || !*path) return t;
  void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (!h) {
    fprintf(stderr, "fake-cuda: ZOPT_FAKE_CUDA_TWIN=%s: %s\n", path, dlerror());
    abort();
  }
  t.d = (const zopt_step_descriptor *)dlsym(h, ZOPT_DESC_SYMBOL);
  if (!t.d || t.d->abi_version != ZOPT_ABI_VERSION) {
    fprintf(stderr, "fake-cuda: %s is not a step.so of ABI %u\n", path, ZOPT_ABI_VERSION);
    abort();
  }
  const uint32_t best = zopt_cpu_best_isa();
  int have[8] = {-1, -1, -1, -1, -1, -1, -1, -1};
  for (uint32_t i = 0; i < t.d->num_kernels; ++i) {
    const zopt_kernel_desc &k = t.d->kernels[i];
    if (k.device != ZOPT_PLACE_CPU || k.role > 7 || k.isa > best || (int)k.isa <= have[k.role]) continue;
    void *f = dlsym(h, k.symbol);
    if (!f) continue;
    have[k.role] = (int)k.isa;
    if (k.role == ZOPT_KERNEL_PREPARE) t.prepare = (zopt_prepare_fn)f;
    if (k.role == ZOPT_KERNEL_UPDATE) t.update = (zopt_update_fn)f;
    if (k.role == ZOPT_KERNEL_SUMSQ) t.sumsq = (zopt_sumsq_fn)f;
    if (k.role == ZOPT_KERNEL_CONTROL) t.control = (zopt_control_fn)f;
  }
  for (uint32_t s = 0; s < t.d->num_states; ++s) {
    const uint32_t dt = t.d->states[s].dtype;
    t.es[s] = dt == ZOPT_DTYPE_F32 ? 4 : dt == ZOPT_DTYPE_Q8 ? 1 : 2;
  }
  t.ok = t.prepare && t.update && t.control && (t.sumsq || !(t.d->flags & ZOPT_FLAG_SUMSQ));
  if (!t.ok) {
    fprintf(stderr, "fake-cuda: twin %s lacks a CPU kernel this CPU runs\n", path);
    abort();
  }
  return t;
}

bool ends_with(const char *s, const char *suf) {
  size_t n = strlen(s), m = strlen(suf);
  return n >= m && !strcmp(s + n - m, suf);
}

float widen(const void *p, uint32_t dt) {
  if (dt == ZOPT_DTYPE_F32) return *(const float *)p;
  uint16_t h;
  memcpy(&h, p, 2);
  if (dt == ZOPT_DTYPE_BF16) {
    uint32_t b = (uint32_t)h << 16;
    float f;
    memcpy(&f, &b, 4);
    return f;
  }
  // f16 -> f32, exact.
  const uint32_t sign = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 0x1f, m = h & 0x3ff;
  float f;
  if (e == 0x1f) {
    uint32_t b = sign | 0x7f800000u | (m << 13);
    memcpy(&f, &b, 4);
  } else if (e == 0) {
    f = std::ldexp((float)m, -24);
    if (sign) f = -f;
  } else {
    uint32_t b = sign | ((e + 112) << 23) | (m << 13);
    memcpy(&f, &b, 4);
  }
  return f;
}

struct Tables {
  void *const *states;
  const zopt_gpu_segment *segs;
  const zopt_gpu_chunk *chunks;
  int64_t nchunks;
};

// The pointer table of chunk c at its first element (a PER_BLOCK state, a
// q8 absmax: at that element's block, the chunk starting at a block
// boundary as abi.h "q8 moments" requires; a chunk that does not aborts).
void chunk_ptrs(const Twin &t, const Tables &tb, int64_t c, void **ptrs) {
  const zopt_gpu_chunk &ch = tb.chunks[c];
  for (uint32_t s = 0; s < ZOPT_MAX_STATES; ++s) ptrs[s] = nullptr;
  for (uint32_t s = 0; s < t.d->num_states; ++s) {
    char *p = (char *)tb.states[(size_t)ch.segment * t.d->num_states + s];
    int64_t at = ch.begin;
    if (t.d->states[s].flags & ZOPT_STATE_PER_BLOCK) {
      if (ch.begin % ZOPT_Q8_BLOCK) {
        fprintf(stderr, "fake-cuda: chunk %lld begins at element %lld, not a q8 block boundary\n", (long long)c,
                (long long)ch.begin);
        abort();
      }
      at = ch.begin / ZOPT_Q8_BLOCK;
    }
    ptrs[s] = p ? p + (size_t)at * t.es[s] : nullptr;
  }
}

void prepare_rows(const Twin &t, const double *hypers, const double *globals, const zopt_gpu_segment *segs,
                  const double *tensor_t, int64_t nrows, float *coeffs, const double *clip) {
  const uint32_t H = t.d->num_hypers, NC = t.d->num_coeffs;
  for (int64_t r = 0; r < nrows; ++r) {
    const uint32_t g = segs[r].group;
    double gl[ZOPT_NUM_GLOBALS] = {tensor_t[r], clip ? *clip : globals[g * ZOPT_NUM_GLOBALS + ZOPT_GLOBAL_CLIP_COEF],
                                   globals[g * ZOPT_NUM_GLOBALS + ZOPT_GLOBAL_GRAD_SCALE]};
    t.prepare(hypers + (size_t)g * H, gl, coeffs + (size_t)r * NC);
  }
}

// CONTROL as the kernels run it: max_norm from the step globals (what the
// runtime wrote; abi.h), the descriptor's without them.
zopt_control control_of(const Twin &t, const zopt_gpu_step_globals *sg, const zopt_gpu_scaler *sc) {
  zopt_control c;
  memset(&c, 0, sizeof c);
  c.sumsq = sg ? sg->sumsq : 0.0;
  c.max_norm = sg ? sg->max_norm : t.d->max_norm;
  c.scale = sc ? sc->scale : 1.0;
  if (sc) {
    c.growth_factor = sc->growth_factor;
    c.backoff_factor = sc->backoff_factor;
    c.min_scale = sc->min_scale;
    c.growth_interval = sc->growth_interval;
    c.good_steps = sc->good_steps;
    c.dynamic = sc->dynamic;
  }
  t.control(&c);
  return c;
}

}  // namespace

// Whether a twin is configured (the stand-in then emulates every launch).
bool fake_twin_enabled() { return getenv("ZOPT_FAKE_CUDA_TWIN") && *getenv("ZOPT_FAKE_CUDA_TWIN"); }

// Runs launch `name` with its parameters `a` on the twin; false when there
// is no twin (or the kernel is not a step's).
bool fake_twin_run(const char *name, const unsigned long long *a, int nargs) {
  if (!fake_twin_enabled()) return false;
  const Twin &t = twin();
  auto P = [&](int i) { return (void *)(uintptr_t)a[i]; };
  const uint32_t NC = t.d->num_coeffs;
  if (ends_with(name, "_prepare_gpu") && nargs == 6) {
    prepare_rows(t, (const double *)P(0), (const double *)P(1), (const zopt_gpu_segment *)P(2),
                 (const double *)P(3), (int64_t)a[4], (float *)P(5), nullptr);
    return true;
  }
  if (ends_with(name, "_sumsq") && nargs == 12) {
    Tables tb{(void *const *)P(0), (const zopt_gpu_segment *)P(1), (const zopt_gpu_chunk *)P(2), (int64_t)a[3]};
    float *coeffs = (float *)P(4);
    zopt_gpu_step_globals *sg = (zopt_gpu_step_globals *)P(6);
    const uint8_t *active = (const uint8_t *)P(11);
    double sum = 0;
    void *ptrs[ZOPT_MAX_STATES];
    for (int64_t c = 0; c < tb.nchunks; ++c) {
      const uint32_t s = tb.chunks[c].segment;
      if (!active[s]) continue;
      chunk_ptrs(t, tb, c, ptrs);
      sum += t.sumsq(ptrs, tb.chunks[c].n, coeffs + (size_t)s * NC);
    }
    sg->sumsq = sum;
    const zopt_control ctl = control_of(t, sg, nullptr);
    sg->norm = ctl.norm;
    sg->clip_coef = ctl.clip_coef;
    sg->nonfinite = sg->skip = ctl.skip;
    prepare_rows(t, (const double *)P(7), (const double *)P(8), tb.segs, (const double *)P(10), (int64_t)a[9], coeffs,
                 &ctl.clip_coef);
    return true;
  }
  if (ends_with(name, "_update") && (nargs == 7 || nargs == 9)) {
    Tables tb{(void *const *)P(0), (const zopt_gpu_segment *)P(1), (const zopt_gpu_chunk *)P(2), (int64_t)a[3]};
    const float *coeffs = (const float *)P(4);
    const zopt_gpu_step_globals *sg = (const zopt_gpu_step_globals *)P(5);
    const uint8_t *active = (const uint8_t *)P(6);
    if (sg && sg->skip) return true;
    void *ptrs[ZOPT_MAX_STATES];
    for (int64_t c = 0; c < tb.nchunks; ++c) {
      const zopt_gpu_chunk &ch = tb.chunks[c];
      if (!active[ch.segment]) continue;
      chunk_ptrs(t, tb, c, ptrs);
      const float *co = coeffs + (size_t)ch.segment * NC;
      if (nargs == 9) {  // stochastic rounding: abi.h's key
        const double *tensor_t = (const double *)P(7);
        const uint32_t key = zopt_sr_key((uint64_t)a[8], (uint64_t)tensor_t[ch.segment], tb.segs[ch.segment].tensor,
                                         (uint32_t)((uint64_t)ch.begin >> 32));
        ((zopt_update_sr_fn)(void *)t.update)(ptrs, ptrs, ch.n, co, key, (uint32_t)ch.begin);
      } else {
        t.update(ptrs, ptrs, ch.n, co);
      }
    }
    return true;
  }
  if (ends_with(name, "_finish") && nargs == 7) {
    double *globals = (double *)P(0);
    const int64_t ng = (int64_t)a[1], nrows = (int64_t)a[6];
    zopt_gpu_step_globals *sg = (zopt_gpu_step_globals *)P(2);
    zopt_gpu_scaler *sc = (zopt_gpu_scaler *)P(3);
    double *tensor_t = (double *)P(4);
    const uint8_t *active = (const uint8_t *)P(5);
    const zopt_control ctl = control_of(t, sg, sc);
    if (ctl.advance) {
      for (int64_t r = 0; r < nrows; ++r)
        if (active[r]) tensor_t[r] += 1;
      for (int64_t g = 0; g < ng; ++g)
        if (active[nrows + g]) globals[g * ZOPT_NUM_GLOBALS + ZOPT_GLOBAL_STEP] += 1;
      if (sg) ++sg->steps_applied;
    }
    if (sc && (t.d->flags & ZOPT_FLAG_LOSS_SCALE)) {
      sc->last_scale = sc->scale;
      sc->scale = ctl.new_scale;
      sc->good_steps = ctl.new_good_steps;
      const double inv = 1.0 / (sc->scale * sc->grad_divisor);
      for (int64_t g = 0; g < ng; ++g) {
        double &gs = globals[g * ZOPT_NUM_GLOBALS + ZOPT_GLOBAL_GRAD_SCALE];
        gs = gs < 0 ? -inv : inv;
      }
    }
    return true;
  }
  if (ends_with(name, "_init_gpu") && nargs == 4) {
    Tables tb{(void *const *)P(0), (const zopt_gpu_segment *)P(1), (const zopt_gpu_chunk *)P(2), (int64_t)a[3]};
    int param = -1;
    for (uint32_t s = 0; s < t.d->num_states; ++s)
      if (t.d->states[s].kind == ZOPT_STATE_PARAM) param = (int)s;
    void *ptrs[ZOPT_MAX_STATES];
    for (int64_t c = 0; c < tb.nchunks; ++c) {
      chunk_ptrs(t, tb, c, ptrs);
      for (uint32_t s = 0; s < t.d->num_states; ++s) {
        if (t.d->states[s].init != ZOPT_INIT_FROM_PARAM) continue;
        if (t.d->states[s].dtype == ZOPT_DTYPE_I16) {  // a remainder master of the param: 0 (abi.h)
          memset(ptrs[s], 0, (size_t)tb.chunks[c].n * 2);
          continue;
        }
        if (t.d->states[s].dtype != ZOPT_DTYPE_F32) {
          fprintf(stderr, "fake-cuda: twin INIT of a non-f32 master is not emulated\n");
          abort();
        }
        for (uint32_t i = 0; i < tb.chunks[c].n; ++i)
          ((float *)ptrs[s])[i] = widen((const char *)ptrs[param] + (size_t)i * t.es[param], t.d->states[param].dtype);
      }
    }
    return true;
  }
  return false;
}
