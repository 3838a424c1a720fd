// comm/tmp_self.cpp - TEMPORARY self and loopback communicators until the
// comm subsystem lands (deleted at the merge).
#include "comm/comm_internal.h"

#include <chrono>

namespace {
struct Hub {
  int size;
  std::mutex mu;
  std::condition_variable cv;
  uint64_t gen = 0;
  int arrived = 0;
  std::vector<const void *> send;
  std::vector<int> op;
  std::vector<size_t> bytes;
  int refs;
};
}  // namespace
struct zopt_comm {
  int rank = 0, size = 1;
  Hub *hub = nullptr;
};
namespace {
bool barrier(Hub *h) {
  std::unique_lock<std::mutex> lk(h->mu);
  uint64_t g = h->gen;
  if (++h->arrived == h->size) {
    h->arrived = 0;
    h->gen++;
    h->cv.notify_all();
    return true;
  }
  return h->cv.wait_for(lk, std::chrono::seconds(30), [&] { return h->gen != g; });
}
zopt_status coll(zopt_comm *c, int op, const void *send, void *recv, size_t bytes, const char *what) {
  if (c->size == 1) {
    memmove(recv, send, bytes);
    return ZOPT_OK;
  }
  Hub *h = c->hub;
  h->send[c->rank] = send;
  h->op[c->rank] = op;
  h->bytes[c->rank] = bytes;
  if (!barrier(h)) return zopt::fail(ZOPT_ERR_INTERNAL, "loopback: timeout in %s", what);
  for (int q = 0; q < c->size; ++q)
    if (h->op[q] != op || h->bytes[q] != bytes)
      return zopt::fail(ZOPT_ERR_INTERNAL, "loopback: rank %d called another collective than %s", q, what);
  for (int q = 0; q < c->size; ++q) {
    if (op == 1)
      memcpy((char *)recv + q * bytes, (const char *)h->send[q] + c->rank * bytes, bytes);
    else
      memcpy((char *)recv + q * bytes, h->send[q], bytes);
  }
  if (!barrier(h)) return zopt::fail(ZOPT_ERR_INTERNAL, "loopback: timeout after %s", what);
  return ZOPT_OK;
}
}  // namespace
namespace zopt {
zopt_status comm_all_to_all(zopt_comm *c, const void *send, void *recv, size_t bytes, const char *w) {
  return coll(c, 1, send, recv, bytes, w);
}
zopt_status comm_all_gather(zopt_comm *c, const void *send, void *recv, size_t bytes, const char *w) {
  return coll(c, 2, send, recv, bytes, w);
}
zopt_status comm_barrier(zopt_comm *c, const char *w) {
  char x = 0, y[4096];
  return coll(c, 2, &x, y, 1, w);
}
}  // namespace zopt
extern "C" {
ZOPT_API zopt_status zopt_comm_create_self(zopt_comm **out) {
  *out = new zopt_comm;
  return ZOPT_OK;
}
ZOPT_API zopt_status zopt_comm_create_loopback(int size, const zopt_loopback_options *, zopt_comm **comms) {
  Hub *h = new Hub;
  h->size = size;
  h->refs = size;
  h->send.resize(size);
  h->op.resize(size);
  h->bytes.resize(size);
  for (int r = 0; r < size; ++r) {
    comms[r] = new zopt_comm;
    comms[r]->rank = r;
    comms[r]->size = size;
    comms[r]->hub = h;
  }
  return ZOPT_OK;
}
ZOPT_API void zopt_comm_free(zopt_comm *c) {
  if (!c) return;
  if (c->hub && --c->hub->refs == 0) delete c->hub;
  delete c;
}
ZOPT_API int zopt_comm_rank(const zopt_comm *c) { return c ? c->rank : -1; }
ZOPT_API int zopt_comm_size(const zopt_comm *c) { return c ? c->size : -1; }
ZOPT_API uint32_t zopt_comm_memory(const zopt_comm *c) { return c ? ZOPT_COMM_MEM_HOST : 0; }
ZOPT_API const char *zopt_comm_name(const zopt_comm *) { return "tmp"; }
}
extern "C" {
ZOPT_API zopt_status zopt_comm_create_mpi(const void *, zopt_comm **) {
  return zopt::fail(ZOPT_ERR_UNSUPPORTED, "tmp: no MPI");
}
ZOPT_API zopt_status zopt_comm_set_timeout(zopt_comm *, double) { return ZOPT_OK; }
}
