// optimizer/groups.cpp - parameter groups and their hyperparameters and
// flags (zopt.h), the tensors added to them before finalize, their memory
// moved after it, and the active mask (which tensors a step updates).
#include "optimizer/api.h"

#include "backend/backend.h"
#include "exec/exec.h"
#include "exec/speculate.h"

#include <cmath>
#include <vector>

using namespace zopt;

namespace {

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

extern "C" {

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
  const ChecksScope checks{o};
  if (numel > 0)
    if (zopt_status st = o->backend->check_tensor(o, (int)o->tensors.size(), param, grad, fn)) return st;
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
  const ChecksScope checks{o};
  if (x.numel > 0)
    if (zopt_status st = o->backend->check_tensor(o, tensor, param, grad, fn)) return st;
  try {
    if (x.numel > 0) {
      o->params.erase(x.param);
      o->params.insert(param);
    }
  } catch (...) {
    return fail(ZOPT_ERR_OUT_OF_MEMORY, "out of memory");
  }
  void *old_param = x.param, *old_grad = x.grad;
  x.param = param;
  x.grad = grad;
  if (o->finalized) {
    const int32_t id = tensor;
    if (zopt_status st = o->backend->memory_moved(o, &id, 1)) {
      x.param = old_param;  // as it was (the backend rebuilds what it kept)
      x.grad = old_grad;
      if (x.numel > 0 && param != old_param) {
        o->params.erase(param);
        o->params.insert(old_param);  // (erased above: no allocation can fail)
      }
      return st;
    }
  }
  if (o->finalized && o->prog) {  // once, at the next step
    o->prog->rebind_pending = true;
    o->prog->rebind_grads_only = false;
  }
  return ZOPT_OK;
}

ZOPT_API zopt_status zopt_optimizer_set_grad_memory(zopt_optimizer *o, int64_t n, const int32_t *tensors,
                                                    void *const *grads) {
  const char *fn = "zopt_optimizer_set_grad_memory";
  CHECK_OPT_ANY(o, fn);
  // Between the marks of a pipelined offloaded step the gradients of
  // tensors no marked bucket holds may move (a binding registers each
  // bucket's fresh gradients just before marking it); the bucket jobs in
  // flight read only their own buckets' staging.
  const bool marking = exec::spec_marking(o);
  if (!marking)
    if (zopt_status st = check_idle(o, fn)) return st;
  if (n < 0 || (n > 0 && (!tensors || !grads)))
    return fail(ZOPT_ERR_INVALID_ARGUMENT, "%s: n = %lld with %s", fn, (long long)n,
                n < 0 ? "n < 0" : "a NULL array");
  if (zopt_status st = o->backend->supports(o, Feature::TensorMemory, fn)) return st;
  const ChecksScope checks{o};
  for (int64_t i = 0; i < n; ++i) {  // every entry checked before any is applied
    if (zopt_status st = check_tensor(o, tensors[i], fn)) return st;
    const Tensor &x = o->tensors[tensors[i]];
    if (x.numel > 0 && grads[i] == x.param)
      return fail(ZOPT_ERR_INVALID_ARGUMENT, "%s: entry %lld: tensor %d's grad is its param's memory", fn,
                  (long long)i, (int)tensors[i]);
    if (x.numel > 0 && grads[i] && grads[i] != x.grad)  // (its param registered already: not checked again)
      if (zopt_status st = o->backend->check_tensor(o, tensors[i], nullptr, grads[i], fn)) return st;
  }
  if (marking && n) {
    int b = -1;
    int64_t i = -1;
    try {
      i = exec::spec_first_marked(o, n, tensors, &b);
    } catch (...) {
      return fail(ZOPT_ERR_OUT_OF_MEMORY, "out of memory");
    }
    if (i >= 0)
      return fail(ZOPT_ERR_BAD_STATE,
                  "%s: entry %lld: tensor %d is in gradient bucket %d, already marked ready "
                  "(zopt_optimizer_grad_bucket_ready) for the step under way: its gradients were queued for the "
                  "copy from that memory; move a tensor's gradients before marking its buckets, or after the step",
                  fn, (long long)i, (int)tensors[i], b);
  }
  std::vector<void *> old;
  if (n && o->finalized) {
    try {
      old.resize((size_t)n);
    } catch (...) {
      return fail(ZOPT_ERR_OUT_OF_MEMORY, "out of memory");
    }
    for (int64_t i = 0; i < n; ++i) old[(size_t)i] = o->tensors[tensors[i]].grad;
  }
  for (int64_t i = 0; i < n; ++i) o->tensors[tensors[i]].grad = grads[i];
  if (n && o->finalized)
    if (zopt_status st = o->backend->memory_moved(o, tensors, n)) {
      for (int64_t i = n; i-- > 0;) o->tensors[tensors[i]].grad = old[(size_t)i];  // as it was
      return st;
    }
  if (n && o->finalized && o->prog) {  // once, at the next step: the grad pointers only
    if (!o->prog->rebind_pending) o->prog->rebind_grads_only = true;
    if (o->prog->rebind_grads_only) exec::note_grads_moved(o, tensors, n);
    o->prog->rebind_pending = true;
  }
  return ZOPT_OK;
}

ZOPT_API zopt_status zopt_optimizer_set_active(zopt_optimizer *o, const uint8_t *active, int64_t n) {
  const char *fn = "zopt_optimizer_set_active";
  CHECK_OPT_ANY(o, fn);
  // Between the marks of a pipelined offloaded step the mask may only drop
  // tensors (a binding that marked a bucket with zeros for a gradient this
  // rank lacks): the bucket jobs (which read the mask) are waited for
  // first; the step agrees every rank's mask again.
  const bool marking = exec::spec_marking(o);
  if (!marking)
    if (zopt_status st = check_idle(o, fn)) return st;
  // With streamed gradients the gradients handed to zopt_optimizer_reduce_bucket
  // (NULL: none) say which tensors have one; the mask is read for the
  // tensors without elements only (in no bucket; exec agree_step).
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
  if (marking) {
    if (o->begun) return check_idle(o, fn);
    for (int64_t i = 0; i < n; ++i)
      if (active[i] && !o->active.empty() && !o->active[(size_t)i])
        return fail(ZOPT_ERR_BAD_STATE,
                    "%s: tensor %lld made active while gradient buckets of the step under way are marked ready "
                    "(zopt_optimizer_grad_bucket_ready): between the marks the mask may only drop tensors; "
                    "finish the step (zopt_optimizer_step) first",
                    fn, (long long)i);
    // A failed job closes the pipelined step (the step then runs serially).
    if (zopt_status st = exec::wait_buckets(o)) return st;
  }
  std::vector<uint8_t> mask;
  try {
    if (!all) mask.assign(active, active + n);
  } catch (...) {
    return fail(ZOPT_ERR_OUT_OF_MEMORY, "out of memory");
  }
  return apply(std::move(mask));
}

}  // extern "C"
