// fake_nccl.cpp - a stand-in libnccl.so.2 for tests without a GPU.
//
// runtime/test/fake_nccl/ owns this stand-in: it implements the NCCL calls
// zopt's `nccl` communicator uses (runtime/src/comm/nccl.cpp), functionally,
// across processes, over POSIX shared memory. "Device" buffers are the host
// memory of the stand-in CUDA driver (test/Integration/GPUHost/fake-cuda.cpp,
// loaded through ZOPT_CUDA_DRIVER), so they are plain memcpy targets.
//
// Like NCCL:
//  - ncclGetUniqueId names a rendezvous (a shared-memory segment);
//    ncclCommInitRank blocks until all ranks joined (FAKE_NCCL_INIT_TIMEOUT_S,
//    default 10 s, then ncclSystemError naming the missing ranks);
//  - calls enqueue on the stream and return: each operation runs on the
//    stand-in driver's stream worker (fake_cuda_stream_enqueue), so
//    cuStreamQuery / cuStreamSynchronize see it pending until the peers
//    have posted theirs; a peer that never does leaves it pending (only
//    ncclCommAbort ends it); ncclCommGetAsyncError reports failures found
//    while running (mismatched peers: ncclInvalidUsage; a peer that aborted:
//    ncclRemoteError);
//  - its rules are enforced at the call: buffers must be device memory of
//    the stand-in driver; an all-gather whose buffers overlap must be in
//    place (sendbuff == recvbuff + rank * sendcount * typesize); ncclSend /
//    ncclRecv only inside ncclGroupStart/End, which must balance; every
//    send is matched by the peer's receive of the same count and type.
//    Violations return ncclInvalidArgument / ncclInvalidUsage.
// Stricter than NCCL (documented in docs/COMM.md): every rank issues every
// operation (a group, possibly empty of traffic for some pair, or a
// collective) in the same order; collectives inside a group are refused.
//
// Every call is appended to the file named by $FAKE_NCCL_LOG (read at each
// call), one line each, so that a test can check the exact sequence zopt
// issues; ncclCommGetAsyncError and ncclGetErrorString are not logged
// (callers poll them).
#include <dlfcn.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

typedef int ncclResult_t;
typedef struct ncclComm *ncclComm_t;
typedef struct {
  char internal[128];
} ncclUniqueId;

#define API extern "C" __attribute__((visibility("default")))

namespace {

constexpr ncclResult_t ncclSuccess = 0, ncclUnhandledCudaError = 1, ncclSystemError = 2, ncclInternalError = 3,
                       ncclInvalidArgument = 4, ncclInvalidUsage = 5, ncclRemoteError = 6;
constexpr int kMaxRanks = 64, kMaxP2P = 256;
constexpr char kIdMagic[8] = {'F', 'A', 'K', 'E', 'N', 'C', 'C', 'L'};

enum Kind : uint32_t { K_NONE = 0, K_ALLGATHER = 1, K_GROUP = 2 };

struct P2P {
  int32_t peer;
  int32_t dtype;
  uint64_t count;
  uint64_t offset;  // sends: where the payload sits in the sender's mailbox
};

struct Mailbox {
  std::atomic<uint64_t> posted;    // the operation whose post is complete
  std::atomic<uint64_t> consumed;  // the operation this rank finished reading
  uint32_t kind;
  int32_t dtype;
  uint64_t count;  // all-gather
  uint32_t nsend, nrecv;
  P2P sends[kMaxP2P], recvs[kMaxP2P];
};

struct Shared {
  std::atomic<int> nranks;
  std::atomic<int> joined;
  std::atomic<int> taken[kMaxRanks];
  std::atomic<int> aborted[kMaxRanks];
  Mailbox box[kMaxRanks];
};
static_assert(std::atomic<uint64_t>::is_always_lock_free && std::atomic<int>::is_always_lock_free,
              "process-shared atomics must be lock-free");

size_t type_size(int t) {
  switch (t) {
    case 0: case 1: case 10: case 11: return 1;  // int8, uint8, fp8 e4m3/e5m2
    case 6: case 9: return 2;                    // float16, bfloat16
    case 2: case 3: case 7: return 4;            // int32, uint32, float32
    case 4: case 5: case 8: return 8;            // int64, uint64, float64
  }
  return 0;
}

const char *result_name(ncclResult_t r) {
  switch (r) {
    case ncclSuccess: return "ncclSuccess";
    case ncclUnhandledCudaError: return "ncclUnhandledCudaError";
    case ncclSystemError: return "ncclSystemError";
    case ncclInternalError: return "ncclInternalError";
    case ncclInvalidArgument: return "ncclInvalidArgument";
    case ncclInvalidUsage: return "ncclInvalidUsage";
    case ncclRemoteError: return "ncclRemoteError";
  }
  return "ncclResult?";
}

// ---- the log -----------------------------------------------------------------
std::mutex g_log_mu;
void log_line(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
void log_line(const char *fmt, ...) {
  const char *path = getenv("FAKE_NCCL_LOG");
  if (!path || !*path) return;
  char buf[512];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  std::lock_guard<std::mutex> lk(g_log_mu);
  if (FILE *f = fopen(path, "a")) {
    fprintf(f, "%s\n", buf);
    fclose(f);
  }
}

std::mutex g_err_mu;
std::string g_last_error;
ncclResult_t error(ncclResult_t r, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
ncclResult_t error(ncclResult_t r, const char *fmt, ...) {
  char buf[512];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  std::lock_guard<std::mutex> lk(g_err_mu);
  g_last_error = std::string("fake NCCL: ") + buf;
  return r;
}

// ---- the stand-in CUDA driver --------------------------------------------------
struct Driver {
  int (*enqueue)(void *, void (*)(void *), void *) = nullptr;
  int (*pointer_attr)(void *, int, unsigned long long) = nullptr;
};
const Driver &driver() {
  static Driver d = [] {
    Driver d;
    const char *path = getenv("ZOPT_CUDA_DRIVER");
    void *h = path && *path ? dlopen(path, RTLD_NOW | RTLD_NOLOAD) : nullptr;
    if (h) {
      d.enqueue = reinterpret_cast<int (*)(void *, void (*)(void *), void *)>(dlsym(h, "fake_cuda_stream_enqueue"));
      d.pointer_attr = reinterpret_cast<int (*)(void *, int, unsigned long long)>(dlsym(h, "cuPointerGetAttribute"));
    }
    return d;
  }();
  return d;
}

bool is_device(const void *p) {
  if (!driver().pointer_attr) return true;  // no stand-in driver loaded: cannot tell
  unsigned type = 0;
  return driver().pointer_attr(&type, 2, (unsigned long long)(uintptr_t)p) == 0 && type == 2;
}

double env_seconds(const char *name, double dflt) {
  const char *v = getenv(name);
  return v && *v ? atof(v) : dflt;
}

}  // namespace

// ---- communicators -----------------------------------------------------------------
struct ncclComm {
  Shared *sh = nullptr;
  size_t map_bytes = 0;
  char *data = nullptr;  // the mailboxes' payload areas, box_bytes each
  size_t box_bytes = 0;
  int rank = 0, nranks = 1;
  uint64_t issued = 0;  // operations enqueued
  std::atomic<int> inflight{0};
  std::atomic<int> async_error{ncclSuccess};
  std::atomic<bool> abort_flag{false};
};

namespace {

struct Call {  // a send or receive of a group
  bool send;
  ncclComm *comm;
  void *buf;
  size_t count;
  int dtype, peer;
  void *stream;
};

struct Op {
  ncclComm *comm;
  uint64_t k;
  Kind kind;
  const void *send = nullptr;  // all-gather
  void *recv = nullptr;
  size_t count = 0;
  int dtype = 0;
  std::vector<Call> calls;  // group
  void *stream = nullptr;
};

thread_local int t_depth = 0;
thread_local std::vector<Call> t_calls;
thread_local ncclResult_t t_group_error = ncclSuccess;

void set_async(ncclComm *c, ncclResult_t r) {
  int expected = ncclSuccess;
  c->async_error.compare_exchange_strong(expected, r);
}

// Polls cond() until true; false when this communicator was aborted, a peer
// aborted (async error), or the safety net expired (async error).
template <class F>
bool wait_for(ncclComm *c, F cond, const char *what) {
  auto start = std::chrono::steady_clock::now();
  double limit = env_seconds("FAKE_NCCL_HANG_S", 120);
  for (unsigned spins = 0;; ++spins) {
    if (cond()) return true;
    if (c->abort_flag.load()) return false;
    for (int q = 0; q < c->nranks; ++q)
      if (q != c->rank && c->sh->aborted[q].load()) {
        set_async(c, error(ncclRemoteError, "rank %d aborted its communicator while rank %d waited for %s", q,
                           c->rank, what));
        return false;
      }
    if (std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() > limit) {
      set_async(c, error(ncclSystemError, "rank %d waited %g s for %s (FAKE_NCCL_HANG_S)", c->rank, limit, what));
      return false;
    }
    if (spins > 64) std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
}

std::string describe(const Mailbox &b) {
  char s[160];
  if (b.kind == K_ALLGATHER)
    snprintf(s, sizeof s, "ncclAllGather(sendcount=%llu, type=%d)", (unsigned long long)b.count, b.dtype);
  else
    snprintf(s, sizeof s, "a group of %u sends and %u receives", b.nsend, b.nrecv);
  return s;
}

// Runs operation k of this rank (on the stream's worker thread).
void execute(Op *op) {
  ncclComm *c = op->comm;
  Shared *sh = c->sh;
  const int r = c->rank, W = c->nranks;
  const uint64_t k = op->k;
  Mailbox &me = sh->box[r];
  char *mine = c->data + (size_t)r * c->box_bytes;
  char what[64];
  snprintf(what, sizeof what, "operation #%llu", (unsigned long long)k);
  if (c->async_error.load() != ncclSuccess) return;  // the communicator is in error: nothing runs
  // 1. Every peer finished reading this rank's previous post.
  if (!wait_for(c, [&] {
        for (int q = 0; q < W; ++q)
          if (sh->box[q].consumed.load(std::memory_order_acquire) + 1 < k) return false;
        return true;
      }, what))
    return;
  // 2. Post.
  me.kind = op->kind;
  if (op->kind == K_ALLGATHER) {
    size_t bytes = op->count * type_size(op->dtype);
    if (bytes > c->box_bytes) {
      set_async(c, error(ncclInternalError, "%zu bytes exceed the mailbox (FAKE_NCCL_MAILBOX_BYTES)", bytes));
      bytes = 0;
    }
    me.count = op->count;
    me.dtype = op->dtype;
    memcpy(mine, op->send, bytes);
  } else {
    uint32_t ns = 0, nr = 0;
    size_t off = 0;
    for (const Call &x : op->calls) {
      size_t bytes = x.count * type_size(x.dtype);
      if ((x.send ? ns : nr) >= (uint32_t)kMaxP2P || (x.send && off + bytes > c->box_bytes)) {
        set_async(c, error(ncclInternalError, "a group too large for the stand-in's mailbox"));
        break;
      }
      P2P p{x.peer, x.dtype, (uint64_t)x.count, off};
      if (x.send) {
        memcpy(mine + off, x.buf, bytes);
        off += bytes;
        me.sends[ns++] = p;
      } else {
        me.recvs[nr++] = p;
      }
    }
    me.nsend = ns;
    me.nrecv = nr;
  }
  me.posted.store(k, std::memory_order_release);
  // 3. Every peer posted operation k.
  if (!wait_for(c, [&] {
        for (int q = 0; q < W; ++q)
          if (sh->box[q].posted.load(std::memory_order_acquire) < k) return false;
        return true;
      }, what))
    return;
  // 4. Check and copy.
  ncclResult_t bad = ncclSuccess;
  std::string msg;
  for (int q = 0; q < W && bad == ncclSuccess; ++q) {
    const Mailbox &b = sh->box[q];
    if (b.kind != me.kind ||
        (me.kind == K_ALLGATHER && (b.count != me.count || b.dtype != me.dtype))) {
      bad = ncclInvalidUsage;
      msg = "rank " + std::to_string(q) + " issued " + describe(b) + " as operation #" + std::to_string(k) +
            " where rank " + std::to_string(r) + " issued " + describe(me);
    }
  }
  if (bad == ncclSuccess && me.kind == K_ALLGATHER) {
    size_t bytes = me.count * type_size(me.dtype);
    for (int q = 0; q < W; ++q)
      memcpy((char *)op->recv + (size_t)q * bytes, c->data + (size_t)q * c->box_bytes, bytes);
  } else if (bad == ncclSuccess) {
    std::vector<uint32_t> next((size_t)W, 0);  // next unmatched send of each peer to this rank
    auto next_send_to_me = [&](int p) -> const P2P * {
      const Mailbox &b = sh->box[p];
      for (uint32_t i = next[(size_t)p]; i < b.nsend; ++i)
        if (b.sends[i].peer == r) {
          next[(size_t)p] = i + 1;
          return &b.sends[i];
        }
      next[(size_t)p] = b.nsend;
      return nullptr;
    };
    for (const Call &x : op->calls) {
      if (x.send) continue;
      const P2P *s = next_send_to_me(x.peer);
      char b[256];
      if (!s) {
        snprintf(b, sizeof b, "rank %d's ncclRecv(count=%zu, type=%d) from rank %d in operation #%llu has no "
                 "matching ncclSend", r, x.count, x.dtype, x.peer, (unsigned long long)k);
        bad = ncclInvalidUsage, msg = b;
        break;
      }
      if (s->count != x.count || s->dtype != x.dtype) {
        snprintf(b, sizeof b, "rank %d's ncclSend(count=%llu, type=%d) to rank %d does not match its "
                 "ncclRecv(count=%zu, type=%d) in operation #%llu", x.peer, (unsigned long long)s->count,
                 s->dtype, r, x.count, x.dtype, (unsigned long long)k);
        bad = ncclInvalidUsage, msg = b;
        break;
      }
      memcpy(x.buf, c->data + (size_t)x.peer * c->box_bytes + s->offset, x.count * type_size(x.dtype));
    }
    for (int p = 0; p < W && bad == ncclSuccess; ++p)
      if (const P2P *s = next_send_to_me(p)) {
        char b[256];
        snprintf(b, sizeof b, "rank %d's ncclSend(count=%llu, type=%d) to rank %d in operation #%llu has no "
                 "matching ncclRecv", p, (unsigned long long)s->count, s->dtype, r, (unsigned long long)k);
        bad = ncclInvalidUsage, msg = b;
      }
  }
  if (bad != ncclSuccess) set_async(c, error(bad, "%s", msg.c_str()));
  me.consumed.store(k, std::memory_order_release);
}

void run_op(void *arg) {
  Op *op = static_cast<Op *>(arg);
  ncclComm *c = op->comm;
  if (!c->abort_flag.load()) execute(op);
  delete op;
  c->inflight.fetch_sub(1);
}

void submit(Op *op) {
  ncclComm *c = op->comm;
  op->k = ++c->issued;
  c->inflight.fetch_add(1);
  if (driver().enqueue)
    driver().enqueue(op->stream, run_op, op);
  else
    run_op(op);  // no stand-in driver: run at once (blocks until the peers arrive)
}

void release(ncclComm *c) {
  while (c->inflight.load()) std::this_thread::sleep_for(std::chrono::microseconds(100));
  munmap(c->sh, c->map_bytes);
  delete c;
}

}  // namespace

// ---- the API -------------------------------------------------------------------------
API const char *ncclGetErrorString(ncclResult_t r) {
  switch (r) {
    case ncclSuccess: return "no error";
    case ncclUnhandledCudaError: return "unhandled cuda error";
    case ncclSystemError: return "unhandled system error";
    case ncclInternalError: return "internal error";
    case ncclInvalidArgument: return "invalid argument";
    case ncclInvalidUsage: return "invalid usage";
    case ncclRemoteError: return "remote process exited or there was a network error";
  }
  return "unknown result code";
}

API const char *ncclGetLastError(ncclComm_t) {
  static thread_local std::string copy;
  std::lock_guard<std::mutex> lk(g_err_mu);
  copy = g_last_error;
  return copy.c_str();
}

// NCCL_VERSION_CODE of a 2.0.0 that does not exist: zopt never needs the
// version, tools print it (zopt-nccl-check).
API ncclResult_t ncclGetVersion(int *version) {
  if (!version) return ncclInvalidArgument;
  *version = 20000;
  return ncclSuccess;
}

API ncclResult_t ncclGetUniqueId(ncclUniqueId *id) {
  log_line("ncclGetUniqueId");
  if (!id) return error(ncclInvalidArgument, "ncclGetUniqueId: id is NULL");
  static std::atomic<unsigned> counter{0};
  memset(id, 0, sizeof *id);
  memcpy(id->internal, kIdMagic, 8);
  unsigned long long salt =
      (unsigned long long)std::chrono::steady_clock::now().time_since_epoch().count() ^ ((unsigned long long)rand() << 20);
  snprintf(id->internal + 8, sizeof id->internal - 8, "/zopt-fake-nccl-%d-%u-%llx", (int)getpid(), counter++, salt);
  return ncclSuccess;
}

API ncclResult_t ncclCommInitRank(ncclComm_t *out, int nranks, ncclUniqueId id, int rank) {
  log_line("ncclCommInitRank nranks=%d rank=%d", nranks, rank);
  if (!out) return error(ncclInvalidArgument, "ncclCommInitRank: comm is NULL");
  *out = nullptr;
  if (nranks < 1 || nranks > kMaxRanks || rank < 0 || rank >= nranks)
    return error(ncclInvalidArgument, "ncclCommInitRank: rank %d of %d (the stand-in allows up to %d ranks)", rank,
                 nranks, kMaxRanks);
  if (memcmp(id.internal, kIdMagic, 8) != 0)
    return error(ncclInvalidArgument, "ncclCommInitRank: not a unique id from ncclGetUniqueId");
  char name[120];
  memcpy(name, id.internal + 8, sizeof name - 1);
  name[sizeof name - 1] = 0;
  size_t box = 1u << 20;
  if (const char *v = getenv("FAKE_NCCL_MAILBOX_BYTES")) box = (size_t)strtoull(v, nullptr, 10);
  size_t head = (sizeof(Shared) + 4095) / 4096 * 4096;
  size_t bytes = head + (size_t)nranks * box;
  int fd = shm_open(name, O_CREAT | O_RDWR, 0600);
  if (fd < 0) return error(ncclSystemError, "shm_open(%s): %s", name, strerror(errno));
  struct stat sb;
  if (fstat(fd, &sb) == 0 && (size_t)sb.st_size < bytes && ftruncate(fd, (off_t)bytes) != 0) {
    close(fd);
    return error(ncclSystemError, "ftruncate(%s): %s", name, strerror(errno));
  }
  void *m = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (m == MAP_FAILED) return error(ncclSystemError, "mmap(%s): %s", name, strerror(errno));
  ncclComm *c = new ncclComm;
  c->sh = static_cast<Shared *>(m);
  c->map_bytes = bytes;
  c->data = static_cast<char *>(m) + head;
  c->box_bytes = box;
  c->rank = rank;
  c->nranks = nranks;
  Shared *sh = c->sh;
  int n0 = 0;
  if (!sh->nranks.compare_exchange_strong(n0, nranks) && n0 != nranks) {
    release(c);
    return error(ncclInvalidUsage, "ncclCommInitRank: rank %d says nranks=%d, another rank said %d", rank, nranks, n0);
  }
  int t0 = 0;
  if (!sh->taken[rank].compare_exchange_strong(t0, 1)) {
    release(c);
    return error(ncclInvalidUsage, "ncclCommInitRank: rank %d joined twice", rank);
  }
  sh->joined.fetch_add(1);
  double limit = env_seconds("FAKE_NCCL_INIT_TIMEOUT_S", 10);
  auto start = std::chrono::steady_clock::now();
  while (sh->joined.load() < nranks) {
    if (std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() > limit) {
      std::string missing;
      for (int q = 0; q < nranks; ++q)
        if (!sh->taken[q].load()) missing += (missing.empty() ? "" : ", ") + std::to_string(q);
      shm_unlink(name);
      sh->aborted[rank].store(1);
      release(c);
      return error(ncclSystemError, "ncclCommInitRank: rank(s) %s did not join within %g s", missing.c_str(), limit);
    }
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  shm_unlink(name);  // everyone has it mapped
  *out = c;
  return ncclSuccess;
}

API ncclResult_t ncclCommDestroy(ncclComm_t c) {
  log_line("ncclCommDestroy");
  if (!c) return error(ncclInvalidArgument, "ncclCommDestroy: comm is NULL");
  release(c);  // waits for the enqueued operations, like NCCL
  return ncclSuccess;
}

API ncclResult_t ncclCommAbort(ncclComm_t c) {
  log_line("ncclCommAbort");
  if (!c) return error(ncclInvalidArgument, "ncclCommAbort: comm is NULL");
  c->abort_flag.store(true);
  c->sh->aborted[c->rank].store(1);
  release(c);  // the pending operations give up
  return ncclSuccess;
}

API ncclResult_t ncclCommGetAsyncError(ncclComm_t c, ncclResult_t *e) {
  if (!c || !e) return error(ncclInvalidArgument, "ncclCommGetAsyncError: NULL argument");
  *e = c->async_error.load();
  return ncclSuccess;
}

API ncclResult_t ncclGroupStart() {
  log_line("ncclGroupStart");
  if (t_depth++ == 0) {
    t_calls.clear();
    t_group_error = ncclSuccess;
  }
  return ncclSuccess;
}

API ncclResult_t ncclGroupEnd() {
  if (t_depth == 0) {
    log_line("ncclGroupEnd -> ncclInvalidUsage");
    return error(ncclInvalidUsage, "ncclGroupEnd without ncclGroupStart");
  }
  if (--t_depth > 0) {
    log_line("ncclGroupEnd");
    return ncclSuccess;
  }
  std::vector<Call> calls;
  calls.swap(t_calls);
  ncclResult_t r = t_group_error;
  // One operation per communicator, on one stream.
  std::vector<ncclComm *> comms;
  for (const Call &x : calls)
    if (std::find(comms.begin(), comms.end(), x.comm) == comms.end()) comms.push_back(x.comm);
  for (ncclComm *c : comms) {
    Op *op = new Op;
    op->comm = c;
    op->kind = K_GROUP;
    for (const Call &x : calls)
      if (x.comm == c) {
        if (!op->calls.empty() && x.stream != op->calls[0].stream && r == ncclSuccess)
          r = error(ncclInvalidUsage, "a group uses two streams on one communicator (the stand-in needs one)");
        op->calls.push_back(x);
      }
    op->stream = op->calls[0].stream;
    if (r == ncclSuccess)
      submit(op);
    else
      delete op;
  }
  log_line("ncclGroupEnd%s%s", r ? " -> " : "", r ? result_name(r) : "");
  return r;
}

static ncclResult_t p2p(bool send, void *buf, size_t count, int dtype, int peer, ncclComm_t c, void *stream) {
  const char *fn = send ? "ncclSend" : "ncclRecv";
  ncclResult_t r = ncclSuccess;
  if (!c)
    r = error(ncclInvalidArgument, "%s: comm is NULL", fn);
  else if (peer < 0 || peer >= c->nranks)
    r = error(ncclInvalidArgument, "%s: peer %d out of range [0, %d)", fn, peer, c->nranks);
  else if (!type_size(dtype))
    r = error(ncclInvalidArgument, "%s: unknown datatype %d", fn, dtype);
  else if (count && (!buf || !is_device(buf)))
    r = error(ncclInvalidArgument, "%s: buffer %p is not device memory", fn, buf);
  else if (t_depth == 0)
    r = error(ncclInvalidUsage, "%s outside ncclGroupStart/ncclGroupEnd (the stand-in requires a group)", fn);
  log_line("%s count=%zu type=%d peer=%d stream=%p%s%s", fn, count, dtype, peer, stream, r ? " -> " : "",
           r ? result_name(r) : "");
  if (r != ncclSuccess) {
    if (t_depth && t_group_error == ncclSuccess) t_group_error = r;
    return r;
  }
  t_calls.push_back(Call{send, c, buf, count, dtype, peer, stream});
  return ncclSuccess;
}

API ncclResult_t ncclSend(const void *buf, size_t count, int dtype, int peer, ncclComm_t c, void *stream) {
  return p2p(true, const_cast<void *>(buf), count, dtype, peer, c, stream);
}

API ncclResult_t ncclRecv(void *buf, size_t count, int dtype, int peer, ncclComm_t c, void *stream) {
  return p2p(false, buf, count, dtype, peer, c, stream);
}

API ncclResult_t ncclAllGather(const void *send, void *recv, size_t count, int dtype, ncclComm_t c, void *stream) {
  ncclResult_t r = ncclSuccess;
  size_t ts = type_size(dtype);
  bool in_place = c && send == (const char *)recv + (size_t)c->rank * count * ts;
  if (!c) {
    r = error(ncclInvalidArgument, "ncclAllGather: comm is NULL");
  } else if (!ts) {
    r = error(ncclInvalidArgument, "ncclAllGather: unknown datatype %d", dtype);
  } else if (count && (!send || !recv || !is_device(send) || !is_device(recv))) {
    r = error(ncclInvalidArgument, "ncclAllGather: sendbuff %p / recvbuff %p not device memory", send, recv);
  } else if (count && !in_place) {
    uintptr_t s = (uintptr_t)send, d = (uintptr_t)recv;
    size_t sn = count * ts, dn = sn * (size_t)c->nranks;
    if (s < d + dn && d < s + sn)
      r = error(ncclInvalidArgument,
                "ncclAllGather: overlapping buffers must be in place (sendbuff == recvbuff + rank * sendcount * "
                "typesize)");
  }
  if (r == ncclSuccess && t_depth)
    r = error(ncclInvalidUsage, "ncclAllGather inside a group (the stand-in does not aggregate collectives)");
  log_line("ncclAllGather sendcount=%zu type=%d in_place=%d stream=%p%s%s", count, dtype, in_place ? 1 : 0, stream,
           r ? " -> " : "", r ? result_name(r) : "");
  if (r != ncclSuccess) return r;
  Op *op = new Op;
  op->comm = c;
  op->kind = K_ALLGATHER;
  op->send = send;
  op->recv = recv;
  op->count = count;
  op->dtype = dtype;
  op->stream = stream;
  submit(op);
  return ncclSuccess;
}
