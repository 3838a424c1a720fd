// exec/stats.cpp - zopt_step_stats (zopt.h): where the last completed step's
// host time went, by kind of work, from the program's op times (exec.cpp
// times every op): the COPY ops to the host and back (an offloaded step's
// staging), the rest (the CPU's work), and the whole step.
#include "exec/exec_internal.h"

#include "backend/backend.h"

#include <chrono>

namespace zopt {
namespace exec {

double now_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

uint64_t copy_size(const zopt_optimizer *o, int si) {
  uint64_t n = 0;
  for (const Tensor &x : o->tensors) n += (uint64_t)x.numel;
  return n * dtype_size(o->d->states[si].dtype);
}

void record_stats(zopt_optimizer *o) {
  Program &P = *o->prog;
  zopt_step_stats s{};
  s.update_seconds = P.agree_seconds;
  for (size_t i = 0; i < P.ops.size() && i < P.op_seconds.size(); ++i) {
    const zopt_program_op &op = P.ops[i];
    if (op.code != ZOPT_OP_COPY)
      s.update_seconds += P.op_seconds[i];
    else
      (op.dst == ZOPT_PLACE_CPU ? s.d2h_seconds : s.h2d_seconds) += P.op_seconds[i];
  }
  s.d2h_bytes = P.copy_bytes[0];
  s.h2d_bytes = P.copy_bytes[1];
  s.offloaded = o->backend->stages() ? 1 : 0;
  s.steps = P.stats.steps + 1;
  // The clock read last: every part above ended before it.
  s.total_seconds = now_seconds() - P.step_start;
  P.stats = s;
}

}  // namespace exec
}  // namespace zopt
