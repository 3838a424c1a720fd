// backend/cpu/cpu.h - the CPU backend: every state in host memory.
//
// runtime/src/backend/cpu/ owns the backend of steps whose states and
// update are on the CPU. Its work is the host executor of exec/ (the
// program instantiated with the world size: layout, runtime-held buffers,
// work lists; its ops on the thread pool and the communicator); this class
// is that executor behind the backend interface, plus the host side of
// state access (copies, or gathers of states sharded across ranks). The
// offload backend (backend/offload/) extends it.
#ifndef ZOPT_RUNTIME_BACKEND_CPU_H
#define ZOPT_RUNTIME_BACKEND_CPU_H

#include "backend/backend.h"

namespace zopt {

class CpuBackend : public Backend {
 public:
  const char *name() const override { return "cpu"; }
  zopt_status check_comm(const zopt_optimizer *o, zopt_comm *comm) const override;
  zopt_status finalize(zopt_optimizer *o) override;
  void destroy(zopt_optimizer *o) override;
  zopt_status begin_step(zopt_optimizer *o, exec::StepState *st, bool first) override;
  zopt_status run_op(zopt_optimizer *o, exec::StepState *st, size_t i) override;
  void decide(zopt_optimizer *o, exec::StepState *st, double sumsq) override;
  void end_step(zopt_optimizer *o, exec::StepState *st, zopt_step_result *result) override;
  void *state_ptr(const zopt_optimizer *o, int t, int si) const override;
  zopt_status read_state(const zopt_optimizer *o, int t, int si, void *out, size_t bytes) const override;
  zopt_status write_state(zopt_optimizer *o, int t, int si, const void *in, size_t bytes) override;
  zopt_status refresh_master(zopt_optimizer *o, int first, int count) override;
  void memory_info(const zopt_optimizer *o, zopt_memory_info *info) const override;
};

}  // namespace zopt

#endif
