// optimizer.cpp - the optimizer's C API: groups, tensors, hyperparameters,
// ranks, finalize, the step (exec/ drives the program on the optimizer's
// backend, backend/), loss scaling, state access and introspection.
#include "internal.h"

#include "agree.h"
#include "backend/backend.h"
#include "comm/comm_internal.h"
#include "exec/exec.h"
#include "pipeline/pipeline.h"

#include <cmath>
#include <sys/mman.h>
#include <cstdlib>
#include <memory>
#include <new>
#include <optional>

using namespace zopt;

namespace {

int default_threads() {
  if (const char *e = getenv("ZOPT_NUM_THREADS")) {
    int v = atoi(e);
    if (v >= 1 && v <= 4096) return v;
  }
  unsigned n = std::thread::hardware_concurrency();
  return n ? (int)n : 1;
}

// Every API call on an optimizer: not NULL, no other call running on it on
// another thread (internal.h CallGate: held until the call returns), and
// (but for the streaming calls and the steps, which use CHECK_OPT_ANY) no
// job of its pipeline in flight: the jobs use its scratch, pool and
// gradient shards. Statements at the top of the function (the hold lives
// to its end).
#define CHECK_OPT_ANY(o, fn) ZOPT_ENTER_CALL(o, fn)
#define CHECK_OPT(o, fn)                                                     \
  CHECK_OPT_ANY(o, fn);                                                      \
  if (zopt_status st_ = check_idle(o, fn)) return st_

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

double grad_divisor(const zopt_optimizer *o) { return o->grad_divisor > 0 ? o->grad_divisor : (double)o->world; }

double loss_scale(const zopt_optimizer *o) { return (o->d->flags & ZOPT_FLAG_LOSS_SCALE) ? o->scaler.scale : 1.0; }

double grad_scale(const zopt_optimizer *o, double S, uint32_t group_flags) {
  const double scale = 1.0 / (S * grad_divisor(o));
  return (group_flags & ZOPT_GROUP_MAXIMIZE) ? -scale : scale;
}

}  // namespace zopt

extern "C" {

ZOPT_API zopt_status zopt_optimizer_create(const zopt_step *step, zopt_optimizer **out) {
  if (!out) return fail(ZOPT_ERR_INVALID_ARGUMENT, "zopt_optimizer_create: out is NULL");
  *out = nullptr;
  if (!step) return fail(ZOPT_ERR_INVALID_ARGUMENT, "zopt_optimizer_create: step is NULL");
  const zopt_step_descriptor *d = &step->desc;
  zopt_optimizer *o = new (std::nothrow) zopt_optimizer;
  if (!o) return fail(ZOPT_ERR_OUT_OF_MEMORY, "out of memory");
  o->step = step;
  o->d = d;
  o->max_norm = (d->flags & ZOPT_FLAG_CLIP) ? d->max_norm : 0;
  const_cast<zopt_step *>(step)->refcount++;
  o->num_threads = default_threads();
  o->scaler.cfg = {65536.0, 2.0, 0.5, 2000, 1.0, 1};
  o->scaler.scale = 65536.0;
  o->scaler.good_steps = 0;
  if (zopt_status st = make_backend(o, &o->backend)) {
    zopt_optimizer_free(o);
    return st;
  }
  *out = o;
  return ZOPT_OK;
}

ZOPT_API void zopt_optimizer_free(zopt_optimizer *o) {
  if (!o) return;
  o->gate.close();  // waits for a call running on another thread
  delete o->pipe;  // skips queued jobs, waits for a running one, joins
  delete o->pool;
  delete o->begun;
  if (o->backend) o->backend->destroy(o);  // buffers, device state, staging
  delete o->backend;
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
    exec::repartition(o);
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
  return o->backend->set_hyper(o, group, hi, value);  // and where the backend keeps the table
}

ZOPT_API zopt_status zopt_optimizer_get_hyper(const zopt_optimizer *o, int group, const char *name, double *value) {
  CHECK_OPT(o, "zopt_optimizer_get_hyper");
  if (!value) return fail(ZOPT_ERR_INVALID_ARGUMENT, "zopt_optimizer_get_hyper: value is NULL");
  int hi = 0;
  if (zopt_status st = find_hyper(o, group, name, "zopt_optimizer_get_hyper", &hi)) return st;
  *value = o->groups[group].hypers[hi];
  return ZOPT_OK;
}

ZOPT_API zopt_status zopt_optimizer_set_group_flags(zopt_optimizer *o, int group, uint32_t flags) {
  const char *fn = "zopt_optimizer_set_group_flags";
  CHECK_OPT(o, "zopt_optimizer_set_group_flags");
  if (zopt_status st = check_group(o, group, fn)) return st;
  if (flags & ~ZOPT_GROUP_MAXIMIZE)
    return fail(ZOPT_ERR_INVALID_ARGUMENT, "%s: flags 0x%x has unknown bits (known: ZOPT_GROUP_MAXIMIZE = 0x%x)", fn,
                flags, ZOPT_GROUP_MAXIMIZE);
  if (o->groups[group].flags == flags) return ZOPT_OK;
  // A backend may keep the gradient scale per group where it runs (the
  // GPU's globals table: sign / (S * D)), and the step counts there too:
  // refresh them before pushing.
  if (zopt_status st = o->backend->pull(o)) return st;
  const uint32_t old = o->groups[group].flags;
  o->groups[group].flags = flags;
  if (o->finalized)
    if (zopt_status st = o->backend->push(o)) {
      o->groups[group].flags = old;
      return st;
    }
  return ZOPT_OK;
}

ZOPT_API zopt_status zopt_optimizer_get_group_flags(const zopt_optimizer *o, int group, uint32_t *flags) {
  CHECK_OPT(o, "zopt_optimizer_get_group_flags");
  if (!flags) return fail(ZOPT_ERR_INVALID_ARGUMENT, "zopt_optimizer_get_group_flags: flags is NULL");
  if (zopt_status st = check_group(o, group, "zopt_optimizer_get_group_flags")) return st;
  *flags = o->groups[group].flags;
  return ZOPT_OK;
}

ZOPT_API zopt_status zopt_optimizer_add_tensor(zopt_optimizer *o, int group, void *param, void *grad, int64_t numel,
                                               zopt_dtype dtype, int *tensor_id) {
  const char *fn = "zopt_optimizer_add_tensor";
  CHECK_OPT(o, "zopt_optimizer_add_tensor");
  if (!tensor_id) return fail(ZOPT_ERR_INVALID_ARGUMENT, "%s: tensor_id is NULL", fn);
  if (o->finalized)
    return fail(ZOPT_ERR_BAD_STATE, "%s: optimizer already finalized (zopt_optimizer_add_tensors adds tensors after it)",
                fn);
  if (zopt_status st = check_group(o, group, fn)) return st;
  if (numel < 0) return fail(ZOPT_ERR_INVALID_ARGUMENT, "%s: numel = %lld must be >= 0", fn, (long long)numel);
  // An empty tensor (numel 0, as torch allows) has no memory to check.
  if (numel > 0 && (!param || (!grad && !o->stream_grads)))
    return fail(ZOPT_ERR_INVALID_ARGUMENT, "%s: %s pointer is NULL%s", fn, !param ? "param" : "grad",
                !param ? "" : " (streamed gradients, zopt_optimizer_set_grad_streaming, need no grad memory)");
  if (numel > 0 && param == grad) return fail(ZOPT_ERR_INVALID_ARGUMENT, "%s: param and grad are the same memory", fn);
  if (numel > ((int64_t)1 << 48)) return fail(ZOPT_ERR_INVALID_ARGUMENT, "%s: numel = %lld too large", fn, (long long)numel);
  uint32_t pdt = o->d->states[o->step->param_index].dtype;
  const uint32_t dt = raw_enum(dtype);
  if (dt != pdt)
    return fail(ZOPT_ERR_INVALID_ARGUMENT, "%s: dtype %s (%u) does not match the step's param dtype %s", fn,
                dtype_name(dt), dt, dtype_name(pdt));
  if (numel > 0)
    if (zopt_status st = o->backend->check_tensor(o, (int)o->tensors.size(), param, grad)) return st;
  if (numel > 0 && o->params.count(param))
    return fail(ZOPT_ERR_INVALID_ARGUMENT, "%s: param pointer %p is already registered", fn, param);
  if (o->tensors.size() >= (size_t)0x7fffffff) return fail(ZOPT_ERR_INVALID_ARGUMENT, "%s: too many tensors", fn);
  try {
    if (numel > 0) o->params.insert(param);
    o->tensors.push_back(Tensor{group, param, grad, numel, 0, 0});
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
  // A refused finalize leaves the optimizer as it was: world size 1 (the
  // gradient divisor's default, memory_info) until a finalize succeeds.
  struct Undo {
    zopt_optimizer *o;
    ~Undo() {
      if (!o->finalized) o->world = 1, o->rank = 0;
    }
  } undo{o};
  o->world = o->comm ? zopt_comm_size(o->comm) : 1;
  o->rank = o->comm ? zopt_comm_rank(o->comm) : 0;
  if (zopt_status st = o->backend->finalize(o)) return st;
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
  // The backend may hold the step counts (the device): refresh before pushing.
  if (zopt_status st = o->backend->pull(o)) return st;
  o->scaler.cfg = *c;
  o->scaler.scale = c->init_scale;
  o->scaler.good_steps = 0;
  return o->backend->push(o);
}

ZOPT_API zopt_status zopt_optimizer_get_loss_scale(const zopt_optimizer *o, double *scale) {
  CHECK_OPT(o, "zopt_optimizer_get_loss_scale");
  if (!scale) return fail(ZOPT_ERR_INVALID_ARGUMENT, "zopt_optimizer_get_loss_scale: scale is NULL");
  // The scaler may run where the backend does (the device: waits for the stream).
  if (zopt_status st = o->backend->pull(const_cast<zopt_optimizer *>(o))) return st;
  *scale = loss_scale(o);
  return ZOPT_OK;
}

// The end of a step begun by zopt_optimizer_step_begin: the rest of its
// program with the norm it computed (or the linked parts' sum).
static zopt_status finish_begun(zopt_optimizer *o, zopt_step_result *result) {
  std::unique_ptr<exec::StepState> st(o->begun);
  o->begun = nullptr;
  const double sumsq = o->linked ? o->linked_sumsq : st->sumsq;
  o->linked = 0;
  return exec::run_end(o, st.get(), sumsq, result);
}

// What a begun step will report: the norm and skip the step's CONTROL
// decides for `sumsq`.
static void begun_result(const zopt_optimizer *o, const exec::StepState &st, double sumsq,
                         zopt_step_result *result) {
  if (!result) return;
  const zopt_control c = exec::decide(o, sumsq);
  result->grad_norm = st.has_norm ? c.norm : NAN;
  result->skipped = st.has_norm && c.skip;
  result->loss_scale = st.S;
}

ZOPT_API zopt_status zopt_optimizer_step(zopt_optimizer *o, zopt_step_result *result) {
  CHECK_OPT_ANY(o, "zopt_optimizer_step");
  if (!o->finalized) return fail(ZOPT_ERR_BAD_STATE, "zopt_optimizer_step: call zopt_optimizer_finalize first");
  if (o->begun) {
    if (o->linked)
      return fail(ZOPT_ERR_BAD_STATE,
                  "zopt_optimizer_step: this optimizer's step was begun as a part of a linked step "
                  "(zopt_optimizer_step_linked_begin): finish it with zopt_optimizer_step_linked");
    return finish_begun(o, result);
  }
  if (zopt_status st = exec::wait_buckets(o)) return st;  // the background reductions first
  return exec::run(o, result);
}

ZOPT_API zopt_status zopt_optimizer_step_begin(zopt_optimizer *o, zopt_step_result *result) {
  const char *fn = "zopt_optimizer_step_begin";
  CHECK_OPT_ANY(o, "zopt_optimizer_step_begin");
  if (!o->finalized) return fail(ZOPT_ERR_BAD_STATE, "%s: call zopt_optimizer_finalize first", fn);
  if (o->begun) return fail(ZOPT_ERR_BAD_STATE, "%s: a step was begun already: finish it with zopt_optimizer_step", fn);
  if (zopt_status st = o->backend->supports(o, Feature::SplitStep, fn)) return st;
  if (zopt_status st = exec::wait_buckets(o)) return st;
  std::unique_ptr<exec::StepState> st(new (std::nothrow) exec::StepState);
  if (!st) return fail(ZOPT_ERR_OUT_OF_MEMORY, "%s: out of memory", fn);
  if (zopt_status s = exec::run_begin(o, st.get())) return s;
  begun_result(o, *st, st->sumsq, result);
  o->begun = st.release();
  o->linked = 0;
  return ZOPT_OK;
}

ZOPT_API zopt_status zopt_optimizer_set_max_norm(zopt_optimizer *o, double max_norm) {
  CHECK_OPT(o, "zopt_optimizer_set_max_norm");
  if (!(o->d->flags & ZOPT_FLAG_CLIP))
    return fail(ZOPT_ERR_UNSUPPORTED,
                "zopt_optimizer_set_max_norm: step '%s' was compiled without global-norm clipping (no "
                "zopt.clip_by_global_norm): compile it with clipping (zopt.steps.<rule>(clip=...)) to set max_norm "
                "at run time",
                o->d->name);
  if (zopt_status st = o->backend->supports(o, Feature::RuntimeMaxNorm, "zopt_optimizer_set_max_norm")) return st;
  if (!(std::isfinite(max_norm) && max_norm > 0))
    return fail(ZOPT_ERR_INVALID_ARGUMENT, "zopt_optimizer_set_max_norm: max_norm %g must be finite and > 0",
                max_norm);
  o->max_norm = max_norm;
  return ZOPT_OK;
}

ZOPT_API zopt_status zopt_optimizer_get_max_norm(const zopt_optimizer *o, double *max_norm) {
  CHECK_OPT_ANY(o, "zopt_optimizer_get_max_norm");
  if (!max_norm) return fail(ZOPT_ERR_INVALID_ARGUMENT, "zopt_optimizer_get_max_norm: max_norm is NULL");
  *max_norm = o->max_norm;
  return ZOPT_OK;
}

// The checks of a linked step (and its begin) before anything runs.
static zopt_status check_linked(zopt_optimizer *const *parts, int n, const char *fn, bool begin) {
  if (!parts || n < 1 || n > 64)
    return fail(ZOPT_ERR_INVALID_ARGUMENT, "%s: %s", fn, !parts ? "parts is NULL" : "n must be in [1, 64]");
  std::optional<CallHold> holds[64];  // every part, for the whole linked step
  for (int i = 0; i < n; ++i) {
    const zopt_optimizer *o = parts[i];
    if (!o) return fail(ZOPT_ERR_INVALID_ARGUMENT, "%s: part %d is NULL", fn, i);
    if (!holds[i].emplace(o, fn).held()) return holds[i]->refuse();
    if (!o->finalized) return fail(ZOPT_ERR_BAD_STATE, "%s: part %d ('%s') is not finalized", fn, i, o->d->name);
    if (begin && o->begun)
      return fail(ZOPT_ERR_BAD_STATE, "%s: part %d ('%s') has a begun step: finish it first", fn, i, o->d->name);
    if (!begin && (o->begun != nullptr) != (parts[0]->begun != nullptr))
      return fail(ZOPT_ERR_BAD_STATE,
                  "%s: part %d's step was %sbegun but part 0's was %s: a linked step begun by "
                  "zopt_optimizer_step_linked_begin is finished with the same parts",
                  fn, i, o->begun ? "" : "not ", parts[0]->begun ? "" : "not");
    if (!begin && o->begun && n > 1 && o->linked != n)
      return fail(ZOPT_ERR_BAD_STATE,
                  "%s: part %d's step was begun %s: finish it the way it was begun", fn, i,
                  o->linked ? "as a part of another linked step" : "alone (zopt_optimizer_step_begin)");
    if (!o->begun)
      if (zopt_status st = exec::wait_buckets(parts[i])) return st;  // its background reductions
    if (zopt_status st = o->backend->supports(o, Feature::LinkedStep, fn)) return st;
    for (int j = 0; j < i; ++j)
      if (parts[j] == o) return fail(ZOPT_ERR_INVALID_ARGUMENT, "%s: parts %d and %d are the same optimizer", fn, j, i);
    if (i == 0) continue;
    const zopt_optimizer *a = parts[0];
    const uint32_t kNormFlags = ZOPT_FLAG_CLIP | ZOPT_FLAG_LOSS_SCALE;
    if (o->world != a->world || o->rank != a->rank)
      return fail(ZOPT_ERR_INVALID_ARGUMENT, "%s: part %d is rank %d of %d, part 0 rank %d of %d", fn, i, o->rank,
                  o->world, a->rank, a->world);
    if ((o->d->flags & kNormFlags) != (a->d->flags & kNormFlags) ||
        ((a->d->flags & ZOPT_FLAG_CLIP) && o->max_norm != a->max_norm))
      return fail(ZOPT_ERR_INVALID_ARGUMENT,
                  "%s: part %d ('%s') and part 0 ('%s') differ in clipping or loss scaling: linked parts share one "
                  "norm and one skip decision, so their steps must clip to the same max_norm and scale alike",
                  fn, i, o->d->name, a->d->name);
    if (a->d->flags & ZOPT_FLAG_LOSS_SCALE) {
      const LossScaler &x = o->scaler, &y = a->scaler;
      const bool same_cfg = x.cfg.growth_factor == y.cfg.growth_factor && x.cfg.backoff_factor == y.cfg.backoff_factor &&
                            x.cfg.growth_interval == y.cfg.growth_interval && x.cfg.min_scale == y.cfg.min_scale &&
                            x.cfg.dynamic == y.cfg.dynamic;
      if (!same_cfg || x.scale != y.scale || x.good_steps != y.good_steps)
        return fail(ZOPT_ERR_INVALID_ARGUMENT,
                    "%s: part %d's loss scaler (scale %g, %lld good steps) differs from part 0's (scale %g, %lld good "
                    "steps) or is configured differently: configure every part alike",
                    fn, i, x.scale, (long long)x.good_steps, y.scale, (long long)y.good_steps);
    }
  }
  return ZOPT_OK;
}

ZOPT_API zopt_status zopt_optimizer_step_linked(zopt_optimizer *const *parts, int n, zopt_step_result *result) {
  if (zopt_status st = check_linked(parts, n, "zopt_optimizer_step_linked", false)) return st;
  if (n == 1) return zopt_optimizer_step(parts[0], result);
  if (parts[0]->begun) {  // begun by zopt_optimizer_step_linked_begin
    for (int i = 0; i < n; ++i)
      if (zopt_status s = finish_begun(parts[i], i == 0 ? result : nullptr)) {
        for (int j = i + 1; j < n; ++j) {  // the rest cannot finish: drop them
          delete parts[j]->begun;
          parts[j]->begun = nullptr;
          parts[j]->linked = 0;
        }
        return s;
      }
    return ZOPT_OK;
  }
  std::vector<exec::StepState> st(n);
  double sumsq = 0;
  for (int i = 0; i < n; ++i) {
    if (zopt_status s = exec::run_begin(parts[i], &st[i], i == 0)) return s;
    if (st[i].has_norm) sumsq += st[i].sumsq;
  }
  for (int i = 0; i < n; ++i)
    if (zopt_status s = exec::run_end(parts[i], &st[i], sumsq, i == 0 ? result : nullptr)) return s;
  return ZOPT_OK;
}

ZOPT_API zopt_status zopt_optimizer_step_linked_begin(zopt_optimizer *const *parts, int n, zopt_step_result *result) {
  if (zopt_status st = check_linked(parts, n, "zopt_optimizer_step_linked_begin", true)) return st;
  if (n == 1) return zopt_optimizer_step_begin(parts[0], result);
  std::vector<std::unique_ptr<exec::StepState>> st(n);
  double sumsq = 0;
  for (int i = 0; i < n; ++i) {
    st[i].reset(new (std::nothrow) exec::StepState);
    if (!st[i]) return fail(ZOPT_ERR_OUT_OF_MEMORY, "zopt_optimizer_step_linked_begin: out of memory");
    if (zopt_status s = exec::run_begin(parts[i], st[i].get(), i == 0)) return s;
    if (st[i]->has_norm) sumsq += st[i]->sumsq;
  }
  begun_result(parts[0], *st[0], sumsq, result);
  for (int i = 0; i < n; ++i) {
    parts[i]->begun = st[i].release();
    parts[i]->linked = n;
    parts[i]->linked_sumsq = sumsq;
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
  // The step counts may advance where the backend runs (the device: waits
  // for the stream).
  if (zopt_status st = o->backend->pull(const_cast<zopt_optimizer *>(o))) return st;
  *count = o->groups[group].step_count;
  return ZOPT_OK;
}

// The checks every state access shares: the buffer, the state, and its
// size (`size` elements for f32 access, `size` bytes of storage for raw).
static zopt_status check_state_access(const zopt_optimizer *o, int tensor, uint32_t kind,
                                      const void *buf, bool raw, uint64_t size, const char *fn,
                                      int *si) {
  if (zopt_status st = resolve_state(o, tensor, kind, fn, si)) return st;
  uint64_t numel = (uint64_t)o->tensors[tensor].numel;
  if (!buf && numel) return fail(ZOPT_ERR_INVALID_ARGUMENT, "%s: %s is NULL", fn, raw ? "buffer" : "array");
  if (!raw && size != numel)
    return fail(ZOPT_ERR_INVALID_ARGUMENT, "%s: numel %lld != tensor's %lld", fn, (long long)size,
                (long long)numel);
  uint64_t want = numel * dtype_size(o->d->states[*si].dtype);
  if (raw && size != want)
    return fail(ZOPT_ERR_INVALID_ARGUMENT, "%s: bytes %llu != %llu", fn, (unsigned long long)size,
                (unsigned long long)want);
  return ZOPT_OK;
}

// State si of tensor t in its storage dtype, whole: device copies for GPU
// memory, a copy of host memory, or (a state sharded across ranks) a
// collective gather: every rank reads.
static zopt_status read_storage(const zopt_optimizer *o, int t, int si, void *out, size_t bytes) {
  return o->backend->read_state(o, t, si, out, bytes);
}

// Writes state si of tensor t from its storage dtype: each rank keeps the
// elements it holds (no communication).
static zopt_status write_storage(zopt_optimizer *o, int t, int si, const void *in, size_t bytes) {
  return o->backend->write_state(o, t, si, in, bytes);
}

static zopt_status with_staging(int64_t n, uint32_t dt, std::vector<unsigned char> *tmp) {
  try {
    tmp->resize((size_t)n * dtype_size(dt));
  } catch (...) {
    return fail(ZOPT_ERR_OUT_OF_MEMORY, "out of host memory for a staging copy of %lld elements", (long long)n);
  }
  return ZOPT_OK;
}

ZOPT_API zopt_status zopt_optimizer_read_state_f32(const zopt_optimizer *o, int tensor, zopt_state_kind kind,
                                                   float *out, int64_t numel) {
  const char *fn = "zopt_optimizer_read_state_f32";
  CHECK_OPT(o, "zopt_optimizer_read_state_f32");
  int si;
  if (zopt_status st = check_state_access(o, tensor, raw_enum(kind), out, false, (uint64_t)numel, fn, &si))
    return st;
  const uint32_t dt = o->d->states[si].dtype;
  if (dt == ZOPT_DTYPE_F32) return read_storage(o, tensor, si, out, (size_t)numel * 4);
  std::vector<unsigned char> tmp;
  if (zopt_status st = with_staging(numel, dt, &tmp)) return st;
  if (zopt_status st = read_storage(o, tensor, si, tmp.data(), tmp.size())) return st;
  convert(tmp.data(), dt, out, ZOPT_DTYPE_F32, numel);
  return ZOPT_OK;
}

ZOPT_API zopt_status zopt_optimizer_write_state_f32(zopt_optimizer *o, int tensor, zopt_state_kind kind,
                                                    const float *in, int64_t numel) {
  const char *fn = "zopt_optimizer_write_state_f32";
  CHECK_OPT(o, "zopt_optimizer_write_state_f32");
  int si;
  if (zopt_status st = check_state_access(o, tensor, raw_enum(kind), in, false, (uint64_t)numel, fn, &si))
    return st;
  const uint32_t dt = o->d->states[si].dtype;
  if (dt == ZOPT_DTYPE_F32) return write_storage(o, tensor, si, in, (size_t)numel * 4);
  std::vector<unsigned char> tmp;
  if (zopt_status st = with_staging(numel, dt, &tmp)) return st;
  convert(in, ZOPT_DTYPE_F32, tmp.data(), dt, numel);
  return write_storage(o, tensor, si, tmp.data(), tmp.size());
}

ZOPT_API zopt_status zopt_optimizer_read_state_raw(const zopt_optimizer *o, int tensor, zopt_state_kind kind,
                                                   void *out, size_t bytes) {
  const char *fn = "zopt_optimizer_read_state_raw";
  CHECK_OPT(o, "zopt_optimizer_read_state_raw");
  int si;
  if (zopt_status st = check_state_access(o, tensor, raw_enum(kind), out, true, bytes, fn, &si))
    return st;
  return read_storage(o, tensor, si, out, bytes);
}

ZOPT_API zopt_status zopt_optimizer_write_state_raw(zopt_optimizer *o, int tensor, zopt_state_kind kind,
                                                    const void *in, size_t bytes) {
  const char *fn = "zopt_optimizer_write_state_raw";
  CHECK_OPT(o, "zopt_optimizer_write_state_raw");
  int si;
  if (zopt_status st = check_state_access(o, tensor, raw_enum(kind), in, true, bytes, fn, &si))
    return st;
  return write_storage(o, tensor, si, in, bytes);
}

ZOPT_API zopt_status zopt_optimizer_memory_info(const zopt_optimizer *o, zopt_memory_info *info) {
  CHECK_OPT(o, "zopt_optimizer_memory_info");
  if (!info) return fail(ZOPT_ERR_INVALID_ARGUMENT, "zopt_optimizer_memory_info: info is NULL");
  const zopt_step_descriptor *d = o->d;
  memset(info, 0, sizeof *info);
  uint64_t n = 0;
  for (const Tensor &t : o->tensors) n += (uint64_t)t.numel;
  info->num_params = n;
  // Before finalize: the communicator's ranks, as zopt_optimizer_get_world
  // (the optimizer's own world is set at finalize).
  info->world_size = o->finalized ? o->world : o->comm ? zopt_comm_size(o->comm) : 1;
  info->rank = o->finalized ? o->rank : o->comm ? zopt_comm_rank(o->comm) : 0;
  // The user's params and grads where they live (streamed gradients have
  // no registered memory: the runtime holds this rank's shards, grad_bytes).
  for (uint32_t s = 0; s < d->num_states; ++s) {
    const zopt_state_desc &sd = d->states[s];
    if (is_owned_kind(sd.kind) || (sd.kind == ZOPT_STATE_GRAD && o->stream_grads)) continue;
    (sd.placement == ZOPT_PLACE_GPU ? info->bytes_gpu : info->bytes_cpu) += n * dtype_size(sd.dtype);
  }
  if (!o->finalized) return ZOPT_OK;
  o->backend->memory_info(o, info);
  return ZOPT_OK;
}

// ---- ranks (zopt/comm.h) ---------------------------------------------------

ZOPT_API zopt_status zopt_optimizer_set_comm(zopt_optimizer *o, zopt_comm *comm) {
  CHECK_OPT(o, "zopt_optimizer_set_comm");
  if (o->finalized) return fail(ZOPT_ERR_BAD_STATE, "zopt_optimizer_set_comm: the optimizer is already finalized");
  if (comm) {
    int r = zopt_comm_rank(comm), w = zopt_comm_size(comm);
    if (w < 1 || r < 0 || r >= w)
      return fail(ZOPT_ERR_INVALID_ARGUMENT, "zopt_optimizer_set_comm: rank %d / world size %d out of range", r, w);
    if (zopt_status st = o->backend->check_comm(o, comm)) return st;
  }
  o->comm = comm;
  return ZOPT_OK;
}

ZOPT_API zopt_status zopt_optimizer_get_world(const zopt_optimizer *o, int *rank, int *world) {
  CHECK_OPT(o, "zopt_optimizer_get_world");
  if (!rank || !world) return fail(ZOPT_ERR_INVALID_ARGUMENT, "zopt_optimizer_get_world: NULL argument");
  *world = o->comm ? zopt_comm_size(o->comm) : 1;
  *rank = o->comm ? zopt_comm_rank(o->comm) : 0;
  return ZOPT_OK;
}

ZOPT_API zopt_status zopt_optimizer_set_bucket_elems(zopt_optimizer *o, int64_t elems) {
  CHECK_OPT(o, "zopt_optimizer_set_bucket_elems");
  if (o->finalized) return fail(ZOPT_ERR_BAD_STATE, "zopt_optimizer_set_bucket_elems: already finalized");
  if (elems < 1 || elems > ((int64_t)1 << 40))
    return fail(ZOPT_ERR_INVALID_ARGUMENT, "zopt_optimizer_set_bucket_elems: %lld not in [1, 2^40]", (long long)elems);
  o->bucket_elems = elems;
  return ZOPT_OK;
}

ZOPT_API zopt_status zopt_optimizer_set_grad_divisor(zopt_optimizer *o, double divisor) {
  CHECK_OPT(o, "zopt_optimizer_set_grad_divisor");
  if (!(std::isfinite(divisor) && divisor >= 0))
    return fail(ZOPT_ERR_INVALID_ARGUMENT, "zopt_optimizer_set_grad_divisor: %g must be finite and > 0 (0: the world size)",
                divisor);
  if (zopt_status st = o->backend->pull(o)) return st;  // counts where the backend keeps them
  o->grad_divisor = divisor;
  return o->backend->push(o);
}

ZOPT_API zopt_status zopt_optimizer_get_grad_divisor(const zopt_optimizer *o, double *divisor) {
  CHECK_OPT(o, "zopt_optimizer_get_grad_divisor");
  if (!divisor) return fail(ZOPT_ERR_INVALID_ARGUMENT, "zopt_optimizer_get_grad_divisor: divisor is NULL");
  *divisor = grad_divisor(o);
  return ZOPT_OK;
}

ZOPT_API zopt_status zopt_optimizer_set_grad_streaming(zopt_optimizer *o, int on) {
  const char *fn = "zopt_optimizer_set_grad_streaming";
  CHECK_OPT(o, "zopt_optimizer_set_grad_streaming");
  if (o->finalized) return fail(ZOPT_ERR_BAD_STATE, "%s: the optimizer is already finalized", fn);
  if (on != 0 && on != 1) return fail(ZOPT_ERR_INVALID_ARGUMENT, "%s: on = %d (0 or 1)", fn, on);
  if (on)
    if (zopt_status st = o->backend->supports(o, Feature::GradStreaming, fn)) return st;
  if (!on)
    for (const Tensor &x : o->tensors)
      if (x.numel && !x.grad)
        return fail(ZOPT_ERR_BAD_STATE, "%s: tensors were added without gradient memory for streaming", fn);
  o->stream_grads = on != 0;
  return ZOPT_OK;
}

static zopt_status check_streaming(const zopt_optimizer *o, const char *fn) {
  if (!o->finalized) return fail(ZOPT_ERR_BAD_STATE, "%s: call zopt_optimizer_finalize first", fn);
  if (!o->stream_grads || !o->prog)
    return fail(ZOPT_ERR_BAD_STATE, "%s: gradient streaming is off (zopt_optimizer_set_grad_streaming before finalize)",
                fn);
  return ZOPT_OK;
}

static zopt_status check_bucket(const zopt_optimizer *o, int bucket, const char *fn) {
  if (bucket < 0 || bucket >= (int)o->prog->L.buckets.size())
    return fail(ZOPT_ERR_INVALID_ARGUMENT, "%s: bucket %d out of range (have %zu)", fn, bucket,
                o->prog->L.buckets.size());
  return ZOPT_OK;
}

ZOPT_API zopt_status zopt_optimizer_num_buckets(const zopt_optimizer *o, int *n) {
  CHECK_OPT_ANY(o, "zopt_optimizer_num_buckets");
  if (!n) return fail(ZOPT_ERR_INVALID_ARGUMENT, "zopt_optimizer_num_buckets: n is NULL");
  if (zopt_status st = check_streaming(o, "zopt_optimizer_num_buckets")) return st;
  *n = (int)o->prog->L.buckets.size();
  return ZOPT_OK;
}

ZOPT_API zopt_status zopt_optimizer_bucket_tensors(const zopt_optimizer *o, int bucket, int *tensors, int capacity,
                                                   int *count) {
  const char *fn = "zopt_optimizer_bucket_tensors";
  CHECK_OPT_ANY(o, "zopt_optimizer_bucket_tensors");
  if (!count) return fail(ZOPT_ERR_INVALID_ARGUMENT, "%s: count is NULL", fn);
  if (zopt_status st = check_streaming(o, fn)) return st;
  if (zopt_status st = check_bucket(o, bucket, fn)) return st;
  std::vector<int> ts;
  exec::bucket_tensors(o, bucket, &ts);
  *count = (int)ts.size();
  if (tensors) {
    if (capacity < (int)ts.size())
      return fail(ZOPT_ERR_INVALID_ARGUMENT, "%s: capacity %d < %zu tensors", fn, capacity, ts.size());
    std::copy(ts.begin(), ts.end(), tensors);
  }
  return ZOPT_OK;
}

ZOPT_API zopt_status zopt_optimizer_reduce_bucket(zopt_optimizer *o, int bucket, const void *const *grads, int count) {
  CHECK_OPT(o, "zopt_optimizer_reduce_bucket");
  if (zopt_status st = check_streaming(o, "zopt_optimizer_reduce_bucket")) return st;
  return exec::reduce_bucket(o, bucket, grads, count);
}

ZOPT_API zopt_status zopt_optimizer_reduce_bucket_async(zopt_optimizer *o, int bucket, const void *const *grads,
                                                        int count) {
  CHECK_OPT_ANY(o, "zopt_optimizer_reduce_bucket_async");
  if (zopt_status st = check_streaming(o, "zopt_optimizer_reduce_bucket_async")) return st;
  return exec::reduce_bucket_async(o, bucket, grads, count);
}

ZOPT_API zopt_status zopt_optimizer_bucket_done(const zopt_optimizer *o, int bucket, int *done) {
  const char *fn = "zopt_optimizer_bucket_done";
  CHECK_OPT_ANY(o, "zopt_optimizer_bucket_done");
  if (!done) return fail(ZOPT_ERR_INVALID_ARGUMENT, "%s: done is NULL", fn);
  if (zopt_status st = check_streaming(o, fn)) return st;
  if (zopt_status st = check_bucket(o, bucket, fn)) return st;
  *done = exec::bucket_finished(o, bucket) ? 1 : 0;
  return ZOPT_OK;
}

ZOPT_API zopt_status zopt_optimizer_wait_buckets(zopt_optimizer *o) {
  CHECK_OPT_ANY(o, "zopt_optimizer_wait_buckets");
  if (zopt_status st = check_streaming(o, "zopt_optimizer_wait_buckets")) return st;
  return exec::wait_buckets(o);
}

ZOPT_API zopt_status zopt_optimizer_set_active(zopt_optimizer *o, const uint8_t *active, int64_t n) {
  CHECK_OPT(o, "zopt_optimizer_set_active");
  if (o->stream_grads)
    return fail(ZOPT_ERR_BAD_STATE,
                "zopt_optimizer_set_active: with streamed gradients the gradients handed to "
                "zopt_optimizer_reduce_bucket (NULL: none) say which tensors have one");
  // The mask may live where the backend runs (the device): the counts are
  // refreshed first, the new mask pushed with them; a failed push puts the
  // old mask back.
  auto apply = [&](std::vector<uint8_t> &&mask) -> zopt_status {
    if (zopt_status st = o->backend->pull(o)) return st;
    o->active.swap(mask);
    if (zopt_status st = o->backend->push(o)) {
      o->active.swap(mask);
      return st;
    }
    return ZOPT_OK;
  };
  if (!active) return apply({});
  if (n != (int64_t)o->tensors.size())
    return fail(ZOPT_ERR_INVALID_ARGUMENT, "zopt_optimizer_set_active: %lld entries for %zu tensors", (long long)n,
                o->tensors.size());
  bool all = true;
  for (int64_t i = 0; i < n; ++i) {
    if (active[i] > 1)
      return fail(ZOPT_ERR_INVALID_ARGUMENT, "zopt_optimizer_set_active: entry %lld is %u (0 or 1)", (long long)i,
                  active[i]);
    all = all && active[i];
  }
  std::vector<uint8_t> mask;
  try {
    if (!all) mask.assign(active, active + n);
  } catch (...) {
    return fail(ZOPT_ERR_OUT_OF_MEMORY, "out of memory");
  }
  return apply(std::move(mask));
}

ZOPT_API zopt_status zopt_optimizer_get_tensor_step(const zopt_optimizer *o, int tensor, int64_t *count) {
  CHECK_OPT(o, "zopt_optimizer_get_tensor_step");
  if (!count) return fail(ZOPT_ERR_INVALID_ARGUMENT, "zopt_optimizer_get_tensor_step: count is NULL");
  if (zopt_status st = check_tensor(o, tensor, "zopt_optimizer_get_tensor_step")) return st;
  if (zopt_status st = o->backend->pull(const_cast<zopt_optimizer *>(o))) return st;  // counts where they advance
  *count = o->tensors[tensor].steps;
  return ZOPT_OK;
}

ZOPT_API zopt_status zopt_optimizer_set_tensor_memory(zopt_optimizer *o, int tensor, void *param, void *grad) {
  const char *fn = "zopt_optimizer_set_tensor_memory";
  CHECK_OPT(o, "zopt_optimizer_set_tensor_memory");
  if (zopt_status st = check_tensor(o, tensor, fn)) return st;
  if (zopt_status st = o->backend->supports(o, Feature::TensorMemory, fn)) return st;
  Tensor &x = o->tensors[tensor];
  if (x.numel > 0 && !param) return fail(ZOPT_ERR_INVALID_ARGUMENT, "%s: param pointer is NULL", fn);
  if (x.numel > 0 && param == grad)
    return fail(ZOPT_ERR_INVALID_ARGUMENT, "%s: param and grad are the same memory", fn);
  if (x.numel > 0 && param != x.param && o->params.count(param))
    return fail(ZOPT_ERR_INVALID_ARGUMENT, "%s: param pointer %p is already registered", fn, param);
  if (x.numel > 0)
    if (zopt_status st = o->backend->check_tensor(o, tensor, param, grad)) return st;
  try {
    if (x.numel > 0) {
      o->params.erase(x.param);
      o->params.insert(param);
    }
  } catch (...) {
    return fail(ZOPT_ERR_OUT_OF_MEMORY, "out of memory");
  }
  x.param = param;
  x.grad = grad;
  if (o->finalized && o->prog) o->prog->rebind_pending = true;  // once, at the next step
  return ZOPT_OK;
}

ZOPT_API zopt_status zopt_optimizer_set_grad_memory(zopt_optimizer *o, int64_t n, const int32_t *tensors,
                                                    void *const *grads) {
  const char *fn = "zopt_optimizer_set_grad_memory";
  CHECK_OPT(o, "zopt_optimizer_set_grad_memory");
  if (n < 0 || (n > 0 && (!tensors || !grads)))
    return fail(ZOPT_ERR_INVALID_ARGUMENT, "%s: n = %lld with %s", fn, (long long)n,
                n < 0 ? "n < 0" : "a NULL array");
  if (zopt_status st = o->backend->supports(o, Feature::TensorMemory, fn)) return st;
  for (int64_t i = 0; i < n; ++i) {  // every entry checked before any is applied
    if (zopt_status st = check_tensor(o, tensors[i], fn)) return st;
    const Tensor &x = o->tensors[tensors[i]];
    if (x.numel > 0 && grads[i] == x.param)
      return fail(ZOPT_ERR_INVALID_ARGUMENT, "%s: entry %lld: tensor %d's grad is its param's memory", fn,
                  (long long)i, (int)tensors[i]);
    if (x.numel > 0 && grads[i])
      if (zopt_status st = o->backend->check_tensor(o, tensors[i], x.param, grads[i])) return st;
  }
  for (int64_t i = 0; i < n; ++i) o->tensors[tensors[i]].grad = grads[i];
  if (n && o->finalized && o->prog) o->prog->rebind_pending = true;  // once, at the next step
  return ZOPT_OK;
}

ZOPT_API zopt_status zopt_optimizer_set_tensor_step(zopt_optimizer *o, int tensor, int64_t count) {
  CHECK_OPT(o, "zopt_optimizer_set_tensor_step");
  if (zopt_status st = check_tensor(o, tensor, "zopt_optimizer_set_tensor_step")) return st;
  if (count < 0) return fail(ZOPT_ERR_INVALID_ARGUMENT, "zopt_optimizer_set_tensor_step: count %lld < 0", (long long)count);
  // The counts may live where the backend runs (the device): refresh, change, push.
  if (zopt_status st = o->backend->pull(o)) return st;
  const int64_t old = o->tensors[tensor].steps;
  o->tensors[tensor].steps = count;
  if (zopt_status st = o->backend->push(o)) {
    o->tensors[tensor].steps = old;
    return st;
  }
  return ZOPT_OK;
}

ZOPT_API zopt_status zopt_optimizer_set_step_count(zopt_optimizer *o, int group, int64_t count) {
  CHECK_OPT(o, "zopt_optimizer_set_step_count");
  if (zopt_status st = check_group(o, group, "zopt_optimizer_set_step_count")) return st;
  if (count < 0) return fail(ZOPT_ERR_INVALID_ARGUMENT, "zopt_optimizer_set_step_count: count %lld < 0", (long long)count);
  if (zopt_status st = o->backend->pull(o)) return st;  // refresh, change, push
  o->groups[group].step_count = count;
  return o->backend->push(o);
}

ZOPT_API zopt_status zopt_optimizer_get_loss_scaler_state(const zopt_optimizer *o, double *scale, int64_t *good_steps) {
  CHECK_OPT(o, "zopt_optimizer_get_loss_scaler_state");
  if (!scale || !good_steps) return fail(ZOPT_ERR_INVALID_ARGUMENT, "zopt_optimizer_get_loss_scaler_state: NULL argument");
  if (zopt_status st = o->backend->pull(const_cast<zopt_optimizer *>(o))) return st;
  *scale = o->scaler.scale;
  *good_steps = o->scaler.good_steps;
  return ZOPT_OK;
}

ZOPT_API zopt_status zopt_optimizer_set_loss_scaler_state(zopt_optimizer *o, double scale, int64_t good_steps) {
  CHECK_OPT(o, "zopt_optimizer_set_loss_scaler_state");
  if (!(std::isfinite(scale) && scale > 0) || good_steps < 0)
    return fail(ZOPT_ERR_INVALID_ARGUMENT, "zopt_optimizer_set_loss_scaler_state: scale %g must be finite and > 0, "
                "good_steps %lld >= 0", scale, (long long)good_steps);
  if (zopt_status st = o->backend->pull(o)) return st;
  o->scaler.scale = scale;
  o->scaler.good_steps = good_steps;
  return o->backend->push(o);
}

ZOPT_API zopt_status zopt_optimizer_get_loss_scaler_config(const zopt_optimizer *o, zopt_loss_scaler_config *config) {
  CHECK_OPT(o, "zopt_optimizer_get_loss_scaler_config");
  if (!config) return fail(ZOPT_ERR_INVALID_ARGUMENT, "zopt_optimizer_get_loss_scaler_config: config is NULL");
  *config = o->scaler.cfg;  // the host's copy: configure and load write it, the device never changes it
  return ZOPT_OK;
}

ZOPT_API zopt_status zopt_optimizer_get_tensor_steps(const zopt_optimizer *o, int first, int count, int64_t *counts) {
  const char *fn = "zopt_optimizer_get_tensor_steps";
  CHECK_OPT(o, "zopt_optimizer_get_tensor_steps");
  if (first < 0 || count < 0 || (size_t)first + (size_t)count > o->tensors.size() || (count && !counts))
    return fail(ZOPT_ERR_INVALID_ARGUMENT, "%s: tensors [%d, %d + %d) out of range (have %zu) or counts NULL", fn,
                first, first, count, o->tensors.size());
  // The counts may advance where the backend runs (the device: waits for the stream).
  if (zopt_status st = o->backend->pull(const_cast<zopt_optimizer *>(o))) return st;
  for (int i = 0; i < count; ++i) counts[i] = o->tensors[(size_t)(first + i)].steps;
  return ZOPT_OK;
}

ZOPT_API zopt_status zopt_optimizer_get_op_times(const zopt_optimizer *o, double *seconds, int n) {
  const char *fn = "zopt_optimizer_get_op_times";
  CHECK_OPT(o, "zopt_optimizer_get_op_times");
  if (!seconds) return fail(ZOPT_ERR_INVALID_ARGUMENT, "%s: seconds is NULL", fn);
  if (zopt_status st = o->backend->supports(o, Feature::OpTimes, fn)) return st;
  if (!o->finalized) return fail(ZOPT_ERR_BAD_STATE, "%s: call zopt_optimizer_finalize first", fn);
  const exec::Program &P = *o->prog;
  if (n < (int)P.ops.size() + 1)
    return fail(ZOPT_ERR_INVALID_ARGUMENT, "%s: n = %d, need %zu", fn, n, P.ops.size() + 1);
  for (size_t i = 0; i < P.ops.size(); ++i) seconds[i] = i < P.op_seconds.size() ? P.op_seconds[i] : 0.0;
  seconds[P.ops.size()] = P.agree_seconds;
  return ZOPT_OK;
}

ZOPT_API zopt_status zopt_optimizer_refresh_master(zopt_optimizer *o, int first, int count) {
  const char *fn = "zopt_optimizer_refresh_master";
  CHECK_OPT(o, "zopt_optimizer_refresh_master");
  if (!o->finalized) return fail(ZOPT_ERR_BAD_STATE, "%s: call zopt_optimizer_finalize first", fn);
  if (first < 0 || count < 0 || (size_t)first + (size_t)count > o->tensors.size())
    return fail(ZOPT_ERR_INVALID_ARGUMENT, "%s: tensors [%d, %d + %d) out of range (have %zu)", fn, first, first,
                count, o->tensors.size());
  return o->backend->refresh_master(o, first, count);
}

ZOPT_API zopt_status zopt_optimizer_gather_params(zopt_optimizer *o, int first, int count, void *const *dst) {
  const char *fn = "zopt_optimizer_gather_params";
  CHECK_OPT(o, "zopt_optimizer_gather_params");
  if (!o->finalized) return fail(ZOPT_ERR_BAD_STATE, "%s: call zopt_optimizer_finalize first", fn);
  if (first < 0 || count < 0 || (size_t)first + (size_t)count > o->tensors.size())
    return fail(ZOPT_ERR_INVALID_ARGUMENT, "%s: tensors [%d, %d + %d) out of range (have %zu)", fn, first, first,
                count, o->tensors.size());
  if (zopt_status st = o->backend->supports(o, Feature::GatherParams, fn)) return st;
  return exec::gather_state(o, o->step->param_index, first, count, dst);
}

}  // extern "C"
