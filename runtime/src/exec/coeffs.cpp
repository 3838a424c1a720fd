// exec/coeffs.cpp - the coefficient table: the step's PREPARE (abi.h) run
// once per (group, step count t) among the tensors a step updates, with
// the step's globals (t, the clip coefficient, the gradient scale).
#include "exec/exec_internal.h"

#include <algorithm>

namespace zopt {
namespace exec {

void prepare_rows(zopt_optimizer *o, bool rebuild, double clip, double S) {
  Program &P = *o->prog;
  const zopt_step_descriptor *d = o->d;
  if (rebuild) {
    P.rows.clear();
    // A changed row_of_tensor (a mask, diverging counts) makes UPDATE's
    // joined calls stale (coalesce.cpp): a new generation.
    bool changed = P.row_of_tensor.size() != o->tensors.size();
    if (changed) P.row_of_tensor.assign(o->tensors.size(), -1);
    for (size_t t = 0; t < o->tensors.size(); ++t) {
      int row = -1;
      if (active(P, (int)t)) {
        std::pair<int, int64_t> key{o->tensors[t].group, o->tensors[t].steps + 1};
        for (size_t i = P.rows.size(); i-- > 0;)  // usually one row per group
          if (P.rows[i] == key) {
            row = (int)i;
            break;
          }
        if (row < 0) {
          row = (int)P.rows.size();
          P.rows.push_back(key);
        }
      }
      if (P.row_of_tensor[t] != row) {
        P.row_of_tensor[t] = row;
        changed = true;
      }
    }
    if (changed) ++P.rows_gen;
    P.coeffs.assign(std::max<size_t>(P.rows.size(), 1) * ZOPT_MAX_COEFFS, 0.0f);
  }
  double hyp[ZOPT_MAX_HYPERS + 1];
  for (size_t i = 0; i < P.rows.size(); ++i) {
    const Group &g = o->groups[P.rows[i].first];
    double globals[ZOPT_NUM_GLOBALS];
    globals[ZOPT_GLOBAL_STEP] = (double)P.rows[i].second;
    globals[ZOPT_GLOBAL_CLIP_COEF] = clip;
    globals[ZOPT_GLOBAL_GRAD_SCALE] = grad_scale(o, S, g.flags);
    for (uint32_t h = 0; h < d->num_hypers; ++h) hyp[h] = g.hypers[h];
    o->step->prepare(hyp, globals, P.coeffs.data() + i * ZOPT_MAX_COEFFS);
  }
}

}  // namespace exec
}  // namespace zopt
