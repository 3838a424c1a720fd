// optimizer/api.h - the optimizer's C API (zopt.h), one file per topic:
//
//   lifecycle.cpp  create, threads, finalize, seed, free; memory and op
//                  times; descriptor lookups
//   groups.cpp     groups, hyperparameters, group flags, tensors (add,
//                  moved memory, the active mask)
//   step.cpp       the step (alone, begun, linked), max_norm, the loss
//                  scaler, step counts; the gradient scale
//   state.cpp      a state read and written (f32 or raw), masters
//                  refreshed, ZeRO-3 params gathered
//   ranks.cpp      the communicator, buckets, the gradient divisor,
//                  gradient streaming
//
// and the checks every call of them makes. Each call asks the backend
// (backend/backend.h), never which backend it is. Checkpoints and the state
// in memory are checkpoint/'s, tensors added after finalize state/'s.
#ifndef ZOPT_RUNTIME_OPTIMIZER_API_H
#define ZOPT_RUNTIME_OPTIMIZER_API_H

#include "internal.h"

namespace zopt {

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

inline zopt_status check_group(const zopt_optimizer *o, int g, const char *fn) {
  if (g < 0 || (size_t)g >= o->groups.size())
    return fail(ZOPT_ERR_INVALID_ARGUMENT, "%s: group id %d out of range (have %zu groups)", fn, g,
                o->groups.size());
  return ZOPT_OK;
}

inline zopt_status check_tensor(const zopt_optimizer *o, int t, const char *fn) {
  if (t < 0 || (size_t)t >= o->tensors.size())
    return fail(ZOPT_ERR_INVALID_ARGUMENT, "%s: tensor id %d out of range (have %zu tensors)", fn, t,
                o->tensors.size());
  return ZOPT_OK;
}

// Resolves (tensor, kind) to a state index, checking finalize for owned states.
inline zopt_status resolve_state(const zopt_optimizer *o, int t, uint32_t kind, const char *fn, int *si) {
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

}  // namespace zopt

#endif
