// self.cpp - the W = 1 communicator: every collective copies send to recv.
#include "comm_internal.h"

#include <cstring>

namespace {

int self_copy(void *, const void *send, void *recv, size_t bytes) {
  if (bytes && send != recv) memmove(recv, send, bytes);
  return ZOPT_COMM_OK;
}
int self_set_timeout(void *, double) { return ZOPT_COMM_OK; }
const char *self_last_error(void *) { return ""; }

const zopt_comm_ops kSelfOps = {
    ZOPT_COMM_OPS_VERSION, ZOPT_COMM_MEM_HOST, "self",
    self_copy,         // all_to_all: one piece, for rank 0
    self_copy,         // all_gather
    self_copy,         // exchange
    nullptr,           // synchronize
    self_set_timeout,  // nothing to wait for
    nullptr,           // abort
    self_last_error,
    nullptr,  // destroy: no ctx
};

}  // namespace

ZOPT_API zopt_status zopt_comm_create_self(zopt_comm **out) {
  return zopt::comm_create_internal(&kSelfOps, nullptr, 0, 1, nullptr, out);
}
