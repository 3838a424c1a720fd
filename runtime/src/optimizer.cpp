// optimizer.cpp - groups, tensors, flat state buffers, the threaded step,
// loss scaling, state access and introspection.
#include "internal.h"

#include <cmath>
#include <sys/mman.h>
#include <cstdlib>
#include <new>

using namespace zopt;

namespace {

constexpr int64_t kChunk = 65536;         // elements per work unit (multiple of 64)
constexpr int64_t kChunkOverhead = 256;   // per-call cost in element-equivalents

int default_threads() {
  if (const char *e = getenv("ZOPT_NUM_THREADS")) {
    int v = atoi(e);
    if (v >= 1 && v <= 4096) return v;
  }
  unsigned n = std::thread::hardware_concurrency();
  return n ? (int)n : 1;
}

void free_buffers(zopt_optimizer *o) {
  for (auto &g : o->groups) {
    for (size_t s = 0; s < g.buffers.size(); ++s) {
      // An offloaded step's param/grad staging is pinned memory, released
      // by offload_free.
      if (!(o->offload && !is_owned_kind(o->d->states[s].kind))) free(g.buffers[s]);
      g.buffers[s] = nullptr;
    }
  }
}

// Splits the chunk list into contiguous per-thread ranges of ~equal cost.
void partition(zopt_optimizer *o) {
  int T = o->num_threads;
  size_t n = o->chunks.size();
  double total = 0;
  for (auto &c : o->chunks) total += (double)(c.len + kChunkOverhead);
  o->thread_begin.assign(T + 1, n);
  o->thread_begin[0] = 0;
  double cum = 0;
  size_t i = 0;
  for (int t = 1; t < T; ++t) {
    double target = total * t / T;
    while (i < n && cum + 0.5 * (o->chunks[i].len + kChunkOverhead) < target) {
      cum += (double)(o->chunks[i].len + kChunkOverhead);
      ++i;
    }
    o->thread_begin[t] = i;
  }
  o->thread_begin[T] = n;
}

struct Job {
  zopt_optimizer *o;
  int mode;  // 0 init, 1 sumsq, 2 update
};

void run_job(void *ctx, int tid) {
  Job *j = (Job *)ctx;
  zopt_optimizer *o = j->o;
  const zopt_step_descriptor *d = o->d;
  size_t b = o->thread_begin[tid], e = o->thread_begin[tid + 1];
  const float *coeffs = o->coeffs.data();
  switch (j->mode) {
    case 0:  // first-touch init of the owned states of every chunk
      for (size_t i = b; i < e; ++i) {
        const Chunk &c = o->chunks[i];
        for (uint32_t s = 0; s < d->num_states; ++s) {
          const zopt_state_desc &sd = d->states[s];
          if (!is_owned_kind(sd.kind)) continue;
          if (sd.init == ZOPT_INIT_FROM_PARAM)
            convert(c.ptrs[o->step->param_index], d->states[o->step->param_index].dtype, c.ptrs[s], sd.dtype,
                    c.len);
          else
            memset(c.ptrs[s], 0, (size_t)c.len * dtype_size(sd.dtype));
        }
      }
      break;
    case 1: {
      zopt_sumsq_fn f = o->step->sumsq;
      for (size_t i = b; i < e; ++i) {
        const Chunk &c = o->chunks[i];
        o->partials[i] = f(c.ptrs, c.len, coeffs + (size_t)c.group * ZOPT_MAX_COEFFS);
      }
      break;
    }
    case 2: {
      if (d->flags & ZOPT_FLAG_STOCHASTIC) {
        // abi.h "Stochastic rounding": the key of (seed, the group's step
        // being taken, tensor, high half of the chunk's first index).
        // Chunks start at multiples of kChunk, so none straddles 2^32.
        zopt_update_sr_fn f = (zopt_update_sr_fn)(void *)o->step->update;
        for (size_t i = b; i < e; ++i) {
          const Chunk &c = o->chunks[i];
          uint64_t t = (uint64_t)o->groups[c.group].step_count + 1;
          uint32_t key = zopt_sr_key(o->seed, t, (uint32_t)c.tensor, (uint32_t)((uint64_t)c.start >> 32));
          f(c.ptrs, c.len, coeffs + (size_t)c.group * ZOPT_MAX_COEFFS, key, (uint32_t)c.start);
        }
        break;
      }
      zopt_update_fn f = o->step->update;
      for (size_t i = b; i < e; ++i) {
        const Chunk &c = o->chunks[i];
        f(c.ptrs, c.len, coeffs + (size_t)c.group * ZOPT_MAX_COEFFS);
      }
      break;
    }
  }
}

// Where state si lives in device memory: every state of a GPU step; the
// user's params/grads of an offloaded step.
bool on_device(const zopt_optimizer *o, int si) {
  return o->gpu || (o->offload && !is_owned_kind(o->d->states[si].kind));
}

// Synchronous copy between host memory and a device-resident state.
zopt_status device_copy(const zopt_optimizer *o, int t, int si, void *host, size_t bytes, bool to_device) {
  return o->gpu ? gpu_copy(o, t, si, host, bytes, to_device) : offload_copy(o, t, si, host, bytes, to_device);
}

// f32 access to a device state: a storage-dtype staging copy, converted here.
zopt_status gpu_convert_copy(const zopt_optimizer *o, int t, int si, float *f32, int64_t n, bool to_device) {
  const uint32_t dt = o->d->states[si].dtype;
  std::vector<unsigned char> tmp;
  try {
    tmp.resize((size_t)n * dtype_size(dt));
  } catch (...) {
    return fail(ZOPT_ERR_OUT_OF_MEMORY, "out of host memory for a staging copy");
  }
  if (to_device) convert(f32, ZOPT_DTYPE_F32, tmp.data(), dt, n);
  if (zopt_status st = device_copy(o, t, si, tmp.data(), tmp.size(), to_device)) return st;
  if (!to_device) convert(tmp.data(), dt, f32, ZOPT_DTYPE_F32, n);
  return ZOPT_OK;
}

#define CHECK_OPT(o, fn)                                                     \
  do {                                                                       \
    if (!(o)) return fail(ZOPT_ERR_INVALID_ARGUMENT, fn ": optimizer is NULL"); \
  } while (0)

zopt_status check_group(const zopt_optimizer *o, int g, const char *fn) {
  if (g < 0 || (size_t)g >= o->groups.size())
    return fail(ZOPT_ERR_INVALID_ARGUMENT, "%s: group id %d out of range (have %zu groups)", fn, g,
                o->groups.size());
  return ZOPT_OK;
}

zopt_status check_tensor(const zopt_optimizer *o, int t, const char *fn) {
  if (t < 0 || (size_t)t >= o->tensors.size())
    return fail(ZOPT_ERR_INVALID_ARGUMENT, "%s: tensor id %d out of range (have %zu tensors)", fn, t,
                o->tensors.size());
  return ZOPT_OK;
}

// Resolves (tensor, kind) to a state index, checking finalize for owned states.
zopt_status resolve_state(const zopt_optimizer *o, int t, uint32_t kind, const char *fn, int *si) {
  if (zopt_status st = check_tensor(o, t, fn)) return st;
  int i = state_index(o->d, kind);
  if (i < 0)
    return fail(ZOPT_ERR_INVALID_ARGUMENT, "%s: the step has no %s state (kind %u)", fn,
                (kind >= 1 && kind <= 7) ? state_kind_name(kind) : "such", kind);
  if (is_owned_kind(kind) && !o->finalized)
    return fail(ZOPT_ERR_BAD_STATE, "%s: optimizer states exist only after zopt_optimizer_finalize", fn);
  *si = i;
  return ZOPT_OK;
}

zopt_status check_hyper_value(const zopt_hyper_desc &h, double v) {
  // Hyperparameters are finite: an infinite lr or weight decay is never
  // meant and would turn every parameter into inf/NaN.
  bool ok = std::isfinite(v) && v >= h.min_value && (h.max_exclusive ? v < h.max_value : v <= h.max_value);
  if (!ok)
    return fail(ZOPT_ERR_INVALID_ARGUMENT, "%s = %g out of range [%g, %g%c", hyper_name(h.kind), v, h.min_value,
                h.max_value, h.max_exclusive ? ')' : ']');
  return ZOPT_OK;
}

}  // namespace

namespace zopt {

int64_t layout_segments(zopt_optimizer *o, int64_t align) {
  int64_t max_n = 0;
  for (auto &g : o->groups) {
    int64_t off = 0;
    for (int t : g.tensors) {
      o->tensors[t].offset = off;
      off += o->tensors[t].numel;
      off = (off + align - 1) / align * align;
      max_n = std::max(max_n, o->tensors[t].numel);
    }
    g.padded_total = off;
  }
  return max_n;
}

void update_loss_scaler(zopt_optimizer *o, bool overflow) {
  auto &sc = o->scaler;
  if (!sc.cfg.dynamic) return;
  if (overflow) {
    sc.scale = std::max(sc.scale * sc.cfg.backoff_factor, sc.cfg.min_scale);
    sc.good_steps = 0;
  } else if (++sc.good_steps >= sc.cfg.growth_interval) {
    double ns = sc.scale * sc.cfg.growth_factor;
    if (std::isfinite(ns)) sc.scale = ns;
    sc.good_steps = 0;
  }
}

int state_index(const zopt_step_descriptor *d, uint32_t kind) {
  for (uint32_t i = 0; i < d->num_states; ++i)
    if (d->states[i].kind == kind) return (int)i;
  return -1;
}

int hyper_index(const zopt_step_descriptor *d, uint32_t kind) {
  for (uint32_t i = 0; i < d->num_hypers; ++i)
    if (d->hypers[i].kind == kind) return (int)i;
  return -1;
}

bool is_owned_kind(uint32_t kind) { return kind != ZOPT_STATE_PARAM && kind != ZOPT_STATE_GRAD; }

void *state_ptr(const zopt_optimizer *o, int t, int si) {
  const Tensor &x = o->tensors[t];
  uint32_t kind = o->d->states[si].kind;
  if (!o->offload) {  // offloaded steps stage params and grads in host buffers
    if (kind == ZOPT_STATE_PARAM) return x.param;
    if (kind == ZOPT_STATE_GRAD) return x.grad;
  }
  char *b = (char *)o->groups[x.group].buffers[si];
  return b + (size_t)x.offset * dtype_size(o->d->states[si].dtype);
}

}  // namespace zopt

extern "C" {

ZOPT_API zopt_status zopt_optimizer_create(const zopt_step *step, zopt_optimizer **out) {
  if (!out) return fail(ZOPT_ERR_INVALID_ARGUMENT, "zopt_optimizer_create: out is NULL");
  *out = nullptr;
  if (!step) return fail(ZOPT_ERR_INVALID_ARGUMENT, "zopt_optimizer_create: step is NULL");
  const zopt_step_descriptor *d = &step->desc;
  const bool offload = is_offload_step(step);
  if (!step->has_gpu_code && !offload)
    for (uint32_t i = 0; i < d->num_states; ++i)
      if (d->states[i].placement == ZOPT_PLACE_GPU)
        return fail(ZOPT_ERR_UNSUPPORTED, "%s state '%s': GPU-placed state needs the CUDA backend and the step has no GPU code", d->name,
                    state_kind_name(d->states[i].kind));
  if (!step->has_gpu_code && !step->has_cpu_kernels)
    return fail(ZOPT_ERR_UNSUPPORTED, "step '%s' has no CPU kernels (needs the CUDA backend)", d->name);
  zopt_optimizer *o = new (std::nothrow) zopt_optimizer;
  if (!o) return fail(ZOPT_ERR_OUT_OF_MEMORY, "out of memory");
  o->step = step;
  o->d = d;
  const_cast<zopt_step *>(step)->refcount++;
  o->num_threads = default_threads();
  o->scaler.cfg = {65536.0, 2.0, 0.5, 2000, 1.0, 1};
  o->scaler.scale = 65536.0;
  o->scaler.good_steps = 0;
  if (step->has_gpu_code || offload) {
    if (zopt_status st = step->has_gpu_code ? gpu_create(o) : offload_create(o)) {
      zopt_optimizer_free(o);
      return st;
    }
  }
  *out = o;
  return ZOPT_OK;
}

ZOPT_API void zopt_optimizer_free(zopt_optimizer *o) {
  if (!o) return;
  delete o->pool;
  gpu_free(o);      // device buffers first (nulls them)
  offload_free(o);  // pinned staging (nulls it)
  free_buffers(o);
  const zopt_step *s = o->step;
  delete o;
  release_step(s);
}

ZOPT_API zopt_status zopt_optimizer_set_num_threads(zopt_optimizer *o, int n) {
  CHECK_OPT(o, "zopt_optimizer_set_num_threads");
  if (n < 1 || n > 4096) return fail(ZOPT_ERR_INVALID_ARGUMENT, "zopt_optimizer_set_num_threads: n = %d not in [1, 4096]", n);
  if (n == o->num_threads) return ZOPT_OK;
  if (o->finalized) {
    ThreadPool *p = nullptr;
    try {
      p = new ThreadPool(n);
    } catch (...) {
      return fail(ZOPT_ERR_OUT_OF_MEMORY, "zopt_optimizer_set_num_threads: cannot start %d threads", n);
    }
    delete o->pool;
    o->pool = p;
    o->num_threads = n;
    partition(o);
  } else {
    o->num_threads = n;
  }
  return ZOPT_OK;
}

ZOPT_API zopt_status zopt_optimizer_add_group(zopt_optimizer *o, int *group_id) {
  CHECK_OPT(o, "zopt_optimizer_add_group");
  if (!group_id) return fail(ZOPT_ERR_INVALID_ARGUMENT, "zopt_optimizer_add_group: group_id is NULL");
  if (o->finalized) return fail(ZOPT_ERR_BAD_STATE, "zopt_optimizer_add_group: optimizer already finalized");
  if (o->groups.size() >= (1u << 20)) return fail(ZOPT_ERR_INVALID_ARGUMENT, "too many groups");
  try {
    Group g;
    for (uint32_t i = 0; i < o->d->num_hypers; ++i) g.hypers.push_back(o->d->hypers[i].default_value);
    g.buffers.assign(o->d->num_states, nullptr);
    o->groups.push_back(std::move(g));
  } catch (...) {
    return fail(ZOPT_ERR_OUT_OF_MEMORY, "out of memory");
  }
  *group_id = (int)o->groups.size() - 1;
  return ZOPT_OK;
}

static zopt_status find_hyper(const zopt_optimizer *o, int group, const char *name, const char *fn, int *hi) {
  if (zopt_status st = check_group(o, group, fn)) return st;
  if (!name) return fail(ZOPT_ERR_INVALID_ARGUMENT, "%s: name is NULL", fn);
  int kind = hyper_kind_from_name(name);
  if (!kind)
    return fail(ZOPT_ERR_INVALID_ARGUMENT,
                "%s: unknown hyperparameter '%s' (known: lr beta1 beta2 eps weight_decay momentum dampening "
                "bias_correction)",
                fn, name);
  int i = hyper_index(o->d, raw_enum(kind));
  if (i < 0) return fail(ZOPT_ERR_INVALID_ARGUMENT, "%s: step '%s' has no '%s' hyperparameter", fn, o->d->name, name);
  *hi = i;
  return ZOPT_OK;
}

ZOPT_API zopt_status zopt_optimizer_set_hyper(zopt_optimizer *o, int group, const char *name, double value) {
  CHECK_OPT(o, "zopt_optimizer_set_hyper");
  int hi = 0;
  if (zopt_status st = find_hyper(o, group, name, "zopt_optimizer_set_hyper", &hi)) return st;
  if (zopt_status st = check_hyper_value(o->d->hypers[hi], value)) return st;
  if (o->gpu && o->groups[group].hypers[hi] != value) gpu_hypers_changed(o);
  o->groups[group].hypers[hi] = value;
  return ZOPT_OK;
}

ZOPT_API zopt_status zopt_optimizer_get_hyper(const zopt_optimizer *o, int group, const char *name, double *value) {
  CHECK_OPT(o, "zopt_optimizer_get_hyper");
  if (!value) return fail(ZOPT_ERR_INVALID_ARGUMENT, "zopt_optimizer_get_hyper: value is NULL");
  int hi = 0;
  if (zopt_status st = find_hyper(o, group, name, "zopt_optimizer_get_hyper", &hi)) return st;
  *value = o->groups[group].hypers[hi];
  return ZOPT_OK;
}

ZOPT_API zopt_status zopt_optimizer_add_tensor(zopt_optimizer *o, int group, void *param, void *grad, int64_t numel,
                                               zopt_dtype dtype, int *tensor_id) {
  const char *fn = "zopt_optimizer_add_tensor";
  CHECK_OPT(o, "zopt_optimizer_add_tensor");
  if (!tensor_id) return fail(ZOPT_ERR_INVALID_ARGUMENT, "%s: tensor_id is NULL", fn);
  if (o->finalized) return fail(ZOPT_ERR_BAD_STATE, "%s: optimizer already finalized", fn);
  if (zopt_status st = check_group(o, group, fn)) return st;
  if (!param || !grad) return fail(ZOPT_ERR_INVALID_ARGUMENT, "%s: %s pointer is NULL", fn, !param ? "param" : "grad");
  if (param == grad) return fail(ZOPT_ERR_INVALID_ARGUMENT, "%s: param and grad are the same memory", fn);
  if (numel <= 0) return fail(ZOPT_ERR_INVALID_ARGUMENT, "%s: numel = %lld must be > 0", fn, (long long)numel);
  if (numel > ((int64_t)1 << 48)) return fail(ZOPT_ERR_INVALID_ARGUMENT, "%s: numel = %lld too large", fn, (long long)numel);
  uint32_t pdt = o->d->states[o->step->param_index].dtype;
  const uint32_t dt = raw_enum(dtype);
  if (dt != pdt)
    return fail(ZOPT_ERR_INVALID_ARGUMENT, "%s: dtype %s (%u) does not match the step's param dtype %s", fn,
                dtype_name(dt), dt, dtype_name(pdt));
  if (o->gpu)
    if (zopt_status st = gpu_check_tensor(o, param, grad)) return st;
  if (o->offload)
    if (zopt_status st = offload_check_tensor(o, param, grad)) return st;
  if (o->params.count(param))
    return fail(ZOPT_ERR_INVALID_ARGUMENT, "%s: param pointer %p is already registered", fn, param);
  if (o->tensors.size() >= (size_t)0x7fffffff) return fail(ZOPT_ERR_INVALID_ARGUMENT, "%s: too many tensors", fn);
  try {
    o->params.insert(param);
    o->tensors.push_back(Tensor{group, param, grad, numel, 0});
    o->groups[group].tensors.push_back((int)o->tensors.size() - 1);
  } catch (...) {
    return fail(ZOPT_ERR_OUT_OF_MEMORY, "out of memory");
  }
  *tensor_id = (int)o->tensors.size() - 1;
  return ZOPT_OK;
}

ZOPT_API zopt_status zopt_optimizer_finalize(zopt_optimizer *o) {
  CHECK_OPT(o, "zopt_optimizer_finalize");
  if (o->finalized) return fail(ZOPT_ERR_BAD_STATE, "zopt_optimizer_finalize: already finalized");
  if (o->tensors.empty()) return fail(ZOPT_ERR_BAD_STATE, "zopt_optimizer_finalize: no tensors were added");
  const zopt_step_descriptor *d = o->d;
  if (o->gpu) {
    if (zopt_status st = gpu_finalize(o)) return st;
    o->finalized = true;
    return ZOPT_OK;
  }
  const int64_t align = d->align;
  try {
    layout_segments(o, align);
    for (auto &g : o->groups) {
      if (!g.padded_total) continue;
      for (uint32_t s = 0; s < d->num_states; ++s) {
        size_t bytes = (size_t)g.padded_total * dtype_size(d->states[s].dtype);
        bytes = (bytes + 63) & ~(size_t)63;
        if (!is_owned_kind(d->states[s].kind)) {
          if (!o->offload) continue;
          void *p = nullptr;  // pinned staging of an offloaded param/grad
          if (zopt_status st = offload_alloc_staging(o, bytes, &p)) {
            free_buffers(o);
            return st;
          }
          g.buffers[s] = p;
          continue;
        }
        void *p = nullptr;
        // Large buffers on 2 MiB boundaries, advised as transparent huge
        // pages: the step streams several of them at once, and with 4 KiB
        // pages the TLB misses cost bandwidth (where THP is "madvise", the
        // common default, nothing else gets huge pages).
        const size_t huge = size_t(2) << 20;
        const bool big = bytes >= 2 * huge;
        if (posix_memalign(&p, big ? huge : 64, bytes) != 0 || !p) {
          free_buffers(o);
          return fail(ZOPT_ERR_OUT_OF_MEMORY, "zopt_optimizer_finalize: cannot allocate %zu bytes for %s", bytes,
                      state_kind_name(d->states[s].kind));
        }
        if (big) madvise(p, bytes, MADV_HUGEPAGE);  // advice only: failure is harmless
        g.buffers[s] = p;
      }
    }
    // Work units.
    o->chunks.clear();
    for (size_t gi = 0; gi < o->groups.size(); ++gi) {
      for (int t : o->groups[gi].tensors) {
        const Tensor &x = o->tensors[t];
        for (int64_t st = 0; st < x.numel; st += kChunk) {
          Chunk c;
          c.group = (int)gi;
          c.tensor = t;
          c.start = st;
          c.len = std::min(kChunk, x.numel - st);
          memset(c.ptrs, 0, sizeof c.ptrs);
          for (uint32_t s = 0; s < d->num_states; ++s) {
            char *base = (char *)state_ptr(o, t, (int)s);
            c.ptrs[s] = base + (size_t)st * dtype_size(d->states[s].dtype);
          }
          o->chunks.push_back(c);
        }
      }
    }
    o->partials.assign(o->chunks.size(), 0.0);
    o->coeffs.assign(o->groups.size() * ZOPT_MAX_COEFFS, 0.0f);
    o->pool = new ThreadPool(o->num_threads);
    partition(o);
  } catch (...) {
    free_buffers(o);
    o->chunks.clear();
    return fail(ZOPT_ERR_OUT_OF_MEMORY, "zopt_optimizer_finalize: out of memory");
  }
  // Offload: the params from the GPU first (the master is made from them).
  if (o->offload)
    if (zopt_status st = offload_before_step(o, true)) {
      delete o->pool;
      o->pool = nullptr;
      free_buffers(o);
      o->chunks.clear();
      return st;
    }
  // Initialize (first touch by the thread that will update the chunk).
  Job job{o, 0};
  o->pool->run(run_job, &job);
  // Zero the alignment padding between segments.
  for (auto &g : o->groups) {
    for (uint32_t s = 0; s < d->num_states; ++s) {
      if (!is_owned_kind(d->states[s].kind) || !g.buffers[s]) continue;
      size_t es = dtype_size(d->states[s].dtype);
      int64_t pos = 0;
      for (int t : g.tensors) {
        const Tensor &x = o->tensors[t];
        if (x.offset > pos) memset((char *)g.buffers[s] + pos * es, 0, (size_t)(x.offset - pos) * es);
        pos = x.offset + x.numel;
      }
      if (g.padded_total > pos) memset((char *)g.buffers[s] + pos * es, 0, (size_t)(g.padded_total - pos) * es);
    }
  }
  o->finalized = true;
  return ZOPT_OK;
}

ZOPT_API zopt_status zopt_optimizer_configure_loss_scaler(zopt_optimizer *o, const zopt_loss_scaler_config *c) {
  CHECK_OPT(o, "zopt_optimizer_configure_loss_scaler");
  if (!c) return fail(ZOPT_ERR_INVALID_ARGUMENT, "zopt_optimizer_configure_loss_scaler: config is NULL");
  if (!(std::isfinite(c->init_scale) && c->init_scale > 0))
    return fail(ZOPT_ERR_INVALID_ARGUMENT, "loss scaler: init_scale = %g must be finite and > 0", c->init_scale);
  if (c->dynamic != 0 && c->dynamic != 1)
    return fail(ZOPT_ERR_INVALID_ARGUMENT, "loss scaler: dynamic = %d must be 0 or 1", c->dynamic);
  if (c->dynamic) {
    if (!(std::isfinite(c->growth_factor) && c->growth_factor >= 1))
      return fail(ZOPT_ERR_INVALID_ARGUMENT, "loss scaler: growth_factor = %g must be finite and >= 1", c->growth_factor);
    if (!(c->backoff_factor > 0 && c->backoff_factor < 1))
      return fail(ZOPT_ERR_INVALID_ARGUMENT, "loss scaler: backoff_factor = %g out of range (0, 1)", c->backoff_factor);
    if (c->growth_interval < 1)
      return fail(ZOPT_ERR_INVALID_ARGUMENT, "loss scaler: growth_interval = %lld must be >= 1", (long long)c->growth_interval);
    if (!(std::isfinite(c->min_scale) && c->min_scale > 0 && c->min_scale <= c->init_scale))
      return fail(ZOPT_ERR_INVALID_ARGUMENT, "loss scaler: min_scale = %g out of range (0, init_scale]", c->min_scale);
  }
  if (o->gpu)  // the device holds the step counts: refresh before pushing
    if (zopt_status st = gpu_pull(o)) return st;
  o->scaler.cfg = *c;
  o->scaler.scale = c->init_scale;
  o->scaler.good_steps = 0;
  if (o->gpu) return gpu_push(o);
  return ZOPT_OK;
}

ZOPT_API zopt_status zopt_optimizer_get_loss_scale(const zopt_optimizer *o, double *scale) {
  CHECK_OPT(o, "zopt_optimizer_get_loss_scale");
  if (!scale) return fail(ZOPT_ERR_INVALID_ARGUMENT, "zopt_optimizer_get_loss_scale: scale is NULL");
  if (o->gpu)  // the scaler runs on the device (waits for the stream)
    if (zopt_status st = gpu_pull(const_cast<zopt_optimizer *>(o))) return st;
  *scale = (o->d->flags & ZOPT_FLAG_LOSS_SCALE) ? o->scaler.scale : 1.0;
  return ZOPT_OK;
}

ZOPT_API zopt_status zopt_optimizer_step(zopt_optimizer *o, zopt_step_result *result) {
  CHECK_OPT(o, "zopt_optimizer_step");
  if (!o->finalized) return fail(ZOPT_ERR_BAD_STATE, "zopt_optimizer_step: call zopt_optimizer_finalize first");
  if (o->gpu) return gpu_step(o, result);
  if (o->offload)
    if (zopt_status st = offload_before_step(o, false)) return st;
  const zopt_step_descriptor *d = o->d;
  const zopt_step *s = o->step;
  const bool ls = d->flags & ZOPT_FLAG_LOSS_SCALE;
  const double S = ls ? o->scaler.scale : 1.0;
  const double inv_s = 1.0 / S;
  double hyp[ZOPT_MAX_HYPERS + 1];
  auto prepare = [&](size_t gi, double clip) {
    const Group &g = o->groups[gi];
    double globals[ZOPT_NUM_GLOBALS];
    globals[ZOPT_GLOBAL_STEP] = (double)(g.step_count + 1);
    globals[ZOPT_GLOBAL_CLIP_COEF] = clip;
    globals[ZOPT_GLOBAL_INV_LOSS_SCALE] = inv_s;
    for (uint32_t h = 0; h < d->num_hypers; ++h) hyp[h] = g.hypers[h];
    s->prepare(hyp, globals, o->coeffs.data() + gi * ZOPT_MAX_COEFFS);
  };
  double norm = NAN, clip = 1.0;
  if (d->flags & ZOPT_FLAG_SUMSQ) {
    for (size_t gi = 0; gi < o->groups.size(); ++gi) prepare(gi, 1.0);
    Job job{o, 1};
    o->pool->run(run_job, &job);
    double sum = 0;
    for (double p : o->partials) sum += p;  // fixed order: independent of threads
    norm = std::sqrt(sum);
    if (!std::isfinite(sum)) {
      if (ls) update_loss_scaler(o, true);
      if (result) {
        result->grad_norm = norm;
        result->skipped = 1;
        result->loss_scale = S;
      }
      return ZOPT_OK;
    }
    if (d->flags & ZOPT_FLAG_CLIP) clip = std::min(1.0, d->max_norm / (norm + 1e-6));
  }
  for (size_t gi = 0; gi < o->groups.size(); ++gi) prepare(gi, clip);
  Job job{o, 2};
  o->pool->run(run_job, &job);
  if (o->offload)  // the new params back to the GPU (asynchronous)
    if (zopt_status st = offload_after_step(o)) return st;
  for (auto &g : o->groups) g.step_count++;
  if (ls) update_loss_scaler(o, false);
  if (result) {
    result->grad_norm = norm;
    result->skipped = 0;
    result->loss_scale = S;
  }
  return ZOPT_OK;
}

ZOPT_API zopt_status zopt_optimizer_set_seed(zopt_optimizer *o, uint64_t seed) {
  CHECK_OPT(o, "zopt_optimizer_set_seed");
  o->seed = seed;
  return ZOPT_OK;
}

ZOPT_API zopt_status zopt_optimizer_get_seed(const zopt_optimizer *o, uint64_t *seed) {
  CHECK_OPT(o, "zopt_optimizer_get_seed");
  if (!seed) return fail(ZOPT_ERR_INVALID_ARGUMENT, "zopt_optimizer_get_seed: seed is NULL");
  *seed = o->seed;
  return ZOPT_OK;
}

ZOPT_API zopt_status zopt_optimizer_get_step_count(const zopt_optimizer *o, int group, int64_t *count) {
  CHECK_OPT(o, "zopt_optimizer_get_step_count");
  if (!count) return fail(ZOPT_ERR_INVALID_ARGUMENT, "zopt_optimizer_get_step_count: count is NULL");
  if (zopt_status st = check_group(o, group, "zopt_optimizer_get_step_count")) return st;
  if (o->gpu)  // the step counts advance on the device (waits for the stream)
    if (zopt_status st = gpu_pull(const_cast<zopt_optimizer *>(o))) return st;
  *count = o->groups[group].step_count;
  return ZOPT_OK;
}

// The checks every state access shares: the buffer, the state, and its
// size (`size` elements for f32 access, `size` bytes of storage for raw).
static zopt_status check_state_access(const zopt_optimizer *o, int tensor, zopt_state_kind kind,
                                      const void *buf, bool raw, uint64_t size, const char *fn,
                                      int *si) {
  if (!buf) return fail(ZOPT_ERR_INVALID_ARGUMENT, "%s: %s is NULL", fn, raw ? "buffer" : "array");
  if (zopt_status st = resolve_state(o, tensor, raw_enum(kind), fn, si)) return st;
  uint64_t numel = (uint64_t)o->tensors[tensor].numel;
  if (!raw && size != numel)
    return fail(ZOPT_ERR_INVALID_ARGUMENT, "%s: numel %lld != tensor's %lld", fn, (long long)size,
                (long long)numel);
  uint64_t want = numel * dtype_size(o->d->states[*si].dtype);
  if (raw && size != want)
    return fail(ZOPT_ERR_INVALID_ARGUMENT, "%s: bytes %llu != %llu", fn, (unsigned long long)size,
                (unsigned long long)want);
  return ZOPT_OK;
}

ZOPT_API zopt_status zopt_optimizer_read_state_f32(const zopt_optimizer *o, int tensor, zopt_state_kind kind,
                                                   float *out, int64_t numel) {
  const char *fn = "zopt_optimizer_read_state_f32";
  CHECK_OPT(o, "zopt_optimizer_read_state_f32");
  int si;
  if (zopt_status st = check_state_access(o, tensor, kind, out, false, (uint64_t)numel, fn, &si))
    return st;
  if (on_device(o, si)) return gpu_convert_copy(o, tensor, si, out, numel, false);
  convert(state_ptr(o, tensor, si), o->d->states[si].dtype, out, ZOPT_DTYPE_F32, numel);
  return ZOPT_OK;
}

ZOPT_API zopt_status zopt_optimizer_write_state_f32(zopt_optimizer *o, int tensor, zopt_state_kind kind,
                                                    const float *in, int64_t numel) {
  const char *fn = "zopt_optimizer_write_state_f32";
  CHECK_OPT(o, "zopt_optimizer_write_state_f32");
  int si;
  if (zopt_status st = check_state_access(o, tensor, kind, in, false, (uint64_t)numel, fn, &si))
    return st;
  if (on_device(o, si)) return gpu_convert_copy(o, tensor, si, const_cast<float *>(in), numel, true);
  convert(in, ZOPT_DTYPE_F32, state_ptr(o, tensor, si), o->d->states[si].dtype, numel);
  return ZOPT_OK;
}

ZOPT_API zopt_status zopt_optimizer_read_state_raw(const zopt_optimizer *o, int tensor, zopt_state_kind kind,
                                                   void *out, size_t bytes) {
  const char *fn = "zopt_optimizer_read_state_raw";
  CHECK_OPT(o, "zopt_optimizer_read_state_raw");
  int si;
  if (zopt_status st = check_state_access(o, tensor, kind, out, true, bytes, fn, &si))
    return st;
  if (on_device(o, si)) return device_copy(o, tensor, si, out, bytes, false);
  memcpy(out, state_ptr(o, tensor, si), bytes);
  return ZOPT_OK;
}

ZOPT_API zopt_status zopt_optimizer_write_state_raw(zopt_optimizer *o, int tensor, zopt_state_kind kind,
                                                    const void *in, size_t bytes) {
  const char *fn = "zopt_optimizer_write_state_raw";
  CHECK_OPT(o, "zopt_optimizer_write_state_raw");
  int si;
  if (zopt_status st = check_state_access(o, tensor, kind, in, true, bytes, fn, &si))
    return st;
  if (on_device(o, si)) return device_copy(o, tensor, si, const_cast<void *>(in), bytes, true);
  memmove(state_ptr(o, tensor, si), in, bytes);
  return ZOPT_OK;
}

ZOPT_API zopt_status zopt_optimizer_memory_info(const zopt_optimizer *o, zopt_memory_info *info) {
  CHECK_OPT(o, "zopt_optimizer_memory_info");
  if (!info) return fail(ZOPT_ERR_INVALID_ARGUMENT, "zopt_optimizer_memory_info: info is NULL");
  const zopt_step_descriptor *d = o->d;
  uint64_t by[3] = {0, 0, 0};
  uint64_t n = 0;
  for (const Tensor &t : o->tensors) n += (uint64_t)t.numel;
  for (uint32_t s = 0; s < d->num_states; ++s) {
    const zopt_state_desc &sd = d->states[s];
    uint64_t bytes = 0;
    if (!is_owned_kind(sd.kind)) {
      bytes = n * dtype_size(sd.dtype);
      if (o->offload && o->finalized)  // plus its pinned host staging
        for (const Group &g : o->groups)
          if (g.buffers[s]) by[1] += ((uint64_t)g.padded_total * dtype_size(sd.dtype) + 63) & ~(uint64_t)63;
    } else if (o->finalized) {
      for (const Group &g : o->groups)
        if (g.buffers[s]) bytes += ((uint64_t)g.padded_total * dtype_size(sd.dtype) + 63) & ~(uint64_t)63;
    }
    by[sd.placement == ZOPT_PLACE_GPU ? 2 : 1] += bytes;
  }
  info->bytes_cpu = by[1];
  info->bytes_gpu = by[2];
  info->num_params = n;
  return ZOPT_OK;
}

}  // extern "C"
