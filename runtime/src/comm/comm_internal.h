// comm/comm_internal.h - TEMPORARY until the comm subsystem lands: the
// entry points the optimizer calls (the comm branch provides the real ones).
#ifndef ZOPT_RUNTIME_COMM_INTERNAL_H
#define ZOPT_RUNTIME_COMM_INTERNAL_H
#include "../internal.h"
namespace zopt {
zopt_status comm_all_to_all(zopt_comm *c, const void *send, void *recv, size_t bytes_per_rank, const char *what);
zopt_status comm_all_gather(zopt_comm *c, const void *send, void *recv, size_t bytes, const char *what);
zopt_status comm_barrier(zopt_comm *c, const char *what);
}  // namespace zopt
#endif
