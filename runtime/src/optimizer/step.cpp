// optimizer/step.cpp - the step (zopt.h): alone, begun and ended, or linked
// with other optimizers over one norm (exec/ drives the program on the
// optimizer's backend, backend/); max_norm; the loss scaler; the step
// counts of groups and tensors; the gradient scale every backend applies.
#include "optimizer/api.h"

#include "backend/backend.h"
#include "exec/exec.h"

#include <cmath>
#include <memory>
#include <new>
#include <optional>

using namespace zopt;

namespace zopt {

double grad_divisor(const zopt_optimizer *o) { return o->grad_divisor > 0 ? o->grad_divisor : (double)o->world; }

double loss_scale(const zopt_optimizer *o) { return (o->d->flags & ZOPT_FLAG_LOSS_SCALE) ? o->scaler.scale : 1.0; }

double grad_scale(const zopt_optimizer *o, double S, uint32_t group_flags) {
  const double scale = 1.0 / (S * grad_divisor(o));
  return (group_flags & ZOPT_GROUP_MAXIMIZE) ? -scale : scale;
}

}  // namespace zopt

extern "C" {

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
  if (!(std::isfinite(max_norm) && max_norm > 0))
    return fail(ZOPT_ERR_INVALID_ARGUMENT, "zopt_optimizer_set_max_norm: max_norm %g must be finite and > 0",
                max_norm);
  return o->backend->set_max_norm(o, max_norm);
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
    // A part of several (a GPU step: not inside a capture; its counts and
    // scaler read from the device before they are compared below).
    if (n > 1)
      if (zopt_status st = parts[i]->backend->begin_linked(parts[i], fn)) return st;
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
    st[i].linked = true;
    if (zopt_status s = exec::run_begin(parts[i], &st[i], i == 0)) return s;
    if (st[i].has_norm) sumsq += st[i].sumsq;
  }
  // The loss scaler changes when some part has a gradient (the parts'
  // scalers stay alike): every part's any_active is the parts' OR.
  bool any = false;
  for (int i = 0; i < n; ++i) any = any || st[i].any_active;
  for (int i = 0; i < n; ++i) st[i].any_active = any;
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
    st[i]->linked = true;
    if (zopt_status s = exec::run_begin(parts[i], st[i].get(), i == 0)) return s;
    if (st[i]->has_norm) sumsq += st[i]->sumsq;
  }
  bool any = false;  // (as zopt_optimizer_step_linked)
  for (int i = 0; i < n; ++i) any = any || st[i]->any_active;
  for (int i = 0; i < n; ++i) st[i]->any_active = any;
  begun_result(parts[0], *st[0], sumsq, result);
  for (int i = 0; i < n; ++i) {
    parts[i]->begun = st[i].release();
    parts[i]->linked = n;
    parts[i]->linked_sumsq = sumsq;
  }
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

ZOPT_API zopt_status zopt_optimizer_set_step_count(zopt_optimizer *o, int group, int64_t count) {
  CHECK_OPT(o, "zopt_optimizer_set_step_count");
  if (zopt_status st = check_group(o, group, "zopt_optimizer_set_step_count")) return st;
  if (count < 0) return fail(ZOPT_ERR_INVALID_ARGUMENT, "zopt_optimizer_set_step_count: count %lld < 0", (long long)count);
  if (zopt_status st = o->backend->pull(o)) return st;  // refresh, change, push
  o->groups[group].step_count = count;
  return o->backend->push(o);
}

ZOPT_API zopt_status zopt_optimizer_get_tensor_step(const zopt_optimizer *o, int tensor, int64_t *count) {
  CHECK_OPT(o, "zopt_optimizer_get_tensor_step");
  if (!count) return fail(ZOPT_ERR_INVALID_ARGUMENT, "zopt_optimizer_get_tensor_step: count is NULL");
  if (zopt_status st = check_tensor(o, tensor, "zopt_optimizer_get_tensor_step")) return st;
  if (zopt_status st = o->backend->pull(const_cast<zopt_optimizer *>(o))) return st;  // counts where they advance
  *count = o->tensors[tensor].steps;
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

}  // extern "C"
