// nccl.cpp - the `nccl` engine: libnccl.so.2 (or $ZOPT_NCCL_LIB) loaded with
// dlopen, the few types and functions declared here (ABI of NCCL 2.x).
//
// Device memory; collectives are enqueued on the communicator's stream and
// return. all_to_all is a group of ncclSend/ncclRecv with every peer (this
// rank included); all_gather is ncclAllGather (in place when send == recv +
// rank * bytes). synchronize polls cuStreamQuery and ncclCommGetAsyncError
// until the deadline and aborts the NCCL communicator on a timeout.
// The signature exchange (checks on) is an in-place ncclAllGather of the
// 96-byte signatures through a small device buffer, copied back to pinned
// host memory and awaited with the same deadline: it makes every checked
// collective wait for the stream's earlier work. NCCL cannot tell which
// rank is missing, so timeouts name none.
#include "backend/cuda/cuda_driver.h"
#include "comm_internal.h"

#include <dlfcn.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <new>
#include <string>
#include <thread>

using namespace zopt;
using namespace zopt::cu;

namespace {

// ---- nccl.h, the parts used here ---------------------------------------------
typedef int ncclResult_t;
typedef struct ncclComm *ncclComm_t;
struct ncclUniqueId {
  char internal[ZOPT_NCCL_UNIQUE_ID_BYTES];
};
constexpr ncclResult_t ncclSuccess = 0, ncclInProgress = 7;
constexpr int ncclInt8 = 0;

#define ZOPT_NCCL_FUNCS(X)                                                                         \
  X(GetUniqueId, "ncclGetUniqueId", ncclResult_t (*)(ncclUniqueId *))                              \
  X(CommInitRank, "ncclCommInitRank", ncclResult_t (*)(ncclComm_t *, int, ncclUniqueId, int))      \
  X(CommDestroy, "ncclCommDestroy", ncclResult_t (*)(ncclComm_t))                                  \
  X(CommAbort, "ncclCommAbort", ncclResult_t (*)(ncclComm_t))                                      \
  X(CommGetAsyncError, "ncclCommGetAsyncError", ncclResult_t (*)(ncclComm_t, ncclResult_t *))      \
  X(GetErrorString, "ncclGetErrorString", const char *(*)(ncclResult_t))                           \
  X(AllGather, "ncclAllGather",                                                                    \
    ncclResult_t (*)(const void *, void *, size_t, int, ncclComm_t, CUstream))                     \
  X(Send, "ncclSend", ncclResult_t (*)(const void *, size_t, int, int, ncclComm_t, CUstream))      \
  X(Recv, "ncclRecv", ncclResult_t (*)(void *, size_t, int, int, ncclComm_t, CUstream))            \
  X(GroupStart, "ncclGroupStart", ncclResult_t (*)())                                              \
  X(GroupEnd, "ncclGroupEnd", ncclResult_t (*)())

struct Lib {
#define ZOPT_NCCL_MEMBER(name, sym, type) \
  using name##_fn = type;                 \
  name##_fn name = nullptr;
  ZOPT_NCCL_FUNCS(ZOPT_NCCL_MEMBER)
#undef ZOPT_NCCL_MEMBER
  const char *(*GetLastError)(ncclComm_t) = nullptr;  // NCCL >= 2.13; optional
  bool ok = false;
  std::string why;
};

Lib *g_lib = nullptr;

void load_lib() {
  Lib *L = new Lib;
  g_lib = L;
  const char *name = getenv("ZOPT_NCCL_LIB");
  if (!name || !*name) name = "libnccl.so.2";
  void *h = dlopen(name, RTLD_NOW | RTLD_LOCAL);
  if (!h) {
    const char *e = dlerror();
    L->why = std::string("NCCL (") + name + ") cannot be loaded: " + (e ? e : "dlopen failed") +
             " (install NCCL, e.g. the nvidia-nccl-cu12 wheel that torch uses, or set ZOPT_NCCL_LIB)";
    return;
  }
#define ZOPT_NCCL_RESOLVE(member, sym, type)                                  \
  L->member = reinterpret_cast<Lib::member##_fn>(dlsym(h, sym));              \
  if (!L->member) {                                                           \
    L->why = std::string("NCCL library ") + name + " lacks " + sym + " (NCCL >= 2.7 needed)"; \
    return;                                                                   \
  }
  ZOPT_NCCL_FUNCS(ZOPT_NCCL_RESOLVE)
#undef ZOPT_NCCL_RESOLVE
  L->GetLastError = reinterpret_cast<const char *(*)(ncclComm_t)>(dlsym(h, "ncclGetLastError"));
  L->ok = true;  // stays loaded for the life of the process
}

const Lib *lib(const char **why) {
  static std::once_flag once;
  std::call_once(once, load_lib);
  if (g_lib->ok) return g_lib;
  *why = g_lib->why.c_str();
  return nullptr;
}

constexpr size_t kExchangeMax = 256;  // zopt_comm_ops.exchange: bytes <= 256

struct Nccl {
  const Lib *L = nullptr;
  const Driver *cu = nullptr;
  ncclComm_t comm = nullptr;
  CUstream stream = nullptr;
  int rank = 0, size = 1;
  double timeout = 300;
  bool failed = false;  // aborted or in error: ncclCommAbort at destroy
  CUdeviceptr xdev = 0;     // size * kExchangeMax bytes
  char *xhost = nullptr;    // pinned: kExchangeMax staging + size * kExchangeMax
  std::string err;
};

std::string nccl_text(const Nccl *n, ncclResult_t r) {
  std::string s = n->L->GetErrorString ? n->L->GetErrorString(r) : "";
  s += " (ncclResult " + std::to_string(r) + ")";
  if (n->L->GetLastError) {  // NCCL ignores the argument (may be NULL, e.g. after a failed init)
    const char *last = n->L->GetLastError(n->comm);
    if (last && *last) s += std::string(": ") + last;
  }
  return s;
}

int set_err(Nccl *n, int code, std::string msg) {
  n->err = std::move(msg);
  return code;
}

void abort_comm(Nccl *n) {
  if (n->comm) n->L->CommAbort(n->comm);
  n->comm = nullptr;
  n->failed = true;
}

// Checks the communicator's asynchronous error (before enqueueing, and while
// waiting).
int check_async(Nccl *n, const char *what) {
  if (!n->comm) return set_err(n, ZOPT_COMM_ERR_FAILED, std::string(what) + ": the NCCL communicator was aborted");
  ncclResult_t ae = ncclSuccess;
  ncclResult_t r = n->L->CommGetAsyncError(n->comm, &ae);
  if (r != ncclSuccess) ae = r;
  if (ae == ncclSuccess || ae == ncclInProgress) return ZOPT_COMM_OK;
  std::string msg = std::string(what) + ": NCCL reported an asynchronous error: " + nccl_text(n, ae);
  abort_comm(n);
  return set_err(n, ZOPT_COMM_ERR_FAILED, msg);
}

// Waits for the stream until the deadline.
int wait_stream(Nccl *n, const char *what) {
  using clock = std::chrono::steady_clock;
  auto deadline = clock::now() + std::chrono::duration_cast<clock::duration>(std::chrono::duration<double>(n->timeout));
  unsigned spins = 0;
  for (;;) {
    CUresult r = n->cu->StreamQuery(n->stream);
    if (r == CUDA_SUCCESS) return check_async(n, what);
    if (r != CUDA_ERROR_NOT_READY) {
      abort_comm(n);
      return set_err(n, ZOPT_COMM_ERR_FAILED, std::string(what) + ": cuStreamQuery: " + error_string(r));
    }
    if (int rc = check_async(n, what)) return rc;
    if (clock::now() > deadline) {
      abort_comm(n);
      char b[64];
      snprintf(b, sizeof b, "%g s", n->timeout);
      return set_err(n, ZOPT_COMM_ERR_TIMEOUT,
                     std::string(what) + ": not finished within " + b +
                         " (a rank did not call the matching collective, or died; NCCL cannot tell which); the "
                         "NCCL communicator was aborted");
    }
    if (++spins > 64) std::this_thread::sleep_for(std::chrono::microseconds(spins > 1024 ? 200 : 20));
  }
}

int enqueue_result(Nccl *n, ncclResult_t r, const char *what) {
  if (r == ncclSuccess) return ZOPT_COMM_OK;
  std::string msg = std::string(what) + ": " + nccl_text(n, r);
  abort_comm(n);
  return set_err(n, ZOPT_COMM_ERR_FAILED, msg);
}

int nccl_all_to_all(void *ctx, const void *send, void *recv, size_t bytes) {
  Nccl *n = static_cast<Nccl *>(ctx);
  if (int rc = check_async(n, "all_to_all")) return rc;
  ncclResult_t r = n->L->GroupStart();
  if (r != ncclSuccess) return enqueue_result(n, r, "ncclGroupStart");
  ncclResult_t first = ncclSuccess;
  const char *first_what = "";
  for (int q = 0; q < n->size && first == ncclSuccess; ++q) {
    r = n->L->Send((const char *)send + (size_t)q * bytes, bytes, ncclInt8, q, n->comm, n->stream);
    if (r != ncclSuccess) first = r, first_what = "ncclSend";
    if (r == ncclSuccess) r = n->L->Recv((char *)recv + (size_t)q * bytes, bytes, ncclInt8, q, n->comm, n->stream);
    if (r != ncclSuccess && first == ncclSuccess) first = r, first_what = "ncclRecv";
  }
  r = n->L->GroupEnd();  // always: keeps the group calls balanced
  if (first != ncclSuccess) return enqueue_result(n, first, first_what);
  return enqueue_result(n, r, "ncclGroupEnd (all_to_all)");
}

int nccl_all_gather(void *ctx, const void *send, void *recv, size_t bytes) {
  Nccl *n = static_cast<Nccl *>(ctx);
  if (int rc = check_async(n, "all_gather")) return rc;
  return enqueue_result(n, n->L->AllGather(send, recv, bytes, ncclInt8, n->comm, n->stream), "ncclAllGather");
}

int nccl_exchange(void *ctx, const void *send, void *recv, size_t bytes) {
  Nccl *n = static_cast<Nccl *>(ctx);
  if (bytes > kExchangeMax) return set_err(n, ZOPT_COMM_ERR_FAILED, "exchange of more than 256 bytes");
  if (int rc = check_async(n, "before the exchange")) return rc;
  CUdeviceptr mine = n->xdev + (CUdeviceptr)((size_t)n->rank * bytes);
  memcpy(n->xhost, send, bytes);
  CUresult cr = n->cu->MemcpyHtoDAsync(mine, n->xhost, bytes, n->stream);
  if (cr != CUDA_SUCCESS)
    return set_err(n, ZOPT_COMM_ERR_FAILED, std::string("cuMemcpyHtoDAsync: ") + error_string(cr));
  void *dev = (void *)(uintptr_t)n->xdev;
  ncclResult_t r = n->L->AllGather((const void *)(uintptr_t)mine, dev, bytes, ncclInt8, n->comm, n->stream);
  if (int rc = enqueue_result(n, r, "ncclAllGather")) return rc;
  char *back = n->xhost + kExchangeMax;
  cr = n->cu->MemcpyDtoHAsync(back, n->xdev, (size_t)n->size * bytes, n->stream);
  if (cr != CUDA_SUCCESS)
    return set_err(n, ZOPT_COMM_ERR_FAILED, std::string("cuMemcpyDtoHAsync: ") + error_string(cr));
  if (int rc = wait_stream(n, "waiting for the stream")) return rc;
  memcpy(recv, back, (size_t)n->size * bytes);
  return ZOPT_COMM_OK;
}

int nccl_synchronize(void *ctx) { return wait_stream(static_cast<Nccl *>(ctx), "waiting for the stream"); }

int nccl_set_timeout(void *ctx, double s) {
  static_cast<Nccl *>(ctx)->timeout = s;
  return ZOPT_COMM_OK;
}

void nccl_abort(void *ctx) { abort_comm(static_cast<Nccl *>(ctx)); }

const char *nccl_last_error(void *ctx) { return static_cast<Nccl *>(ctx)->err.c_str(); }

void release(Nccl *n) {
  if (n->comm) {
    if (n->failed)
      n->L->CommAbort(n->comm);
    else
      n->L->CommDestroy(n->comm);
    n->comm = nullptr;
  }
  // The stream may still reference the exchange buffers after an abort.
  if (n->xdev) {
    if (!n->failed || n->cu->StreamQuery(n->stream) == CUDA_SUCCESS) n->cu->MemFree(n->xdev);
  }
  if (n->xhost) {
    if (!n->failed || n->cu->StreamQuery(n->stream) == CUDA_SUCCESS) n->cu->MemFreeHost(n->xhost);
  }
  delete n;
}

void nccl_destroy(void *ctx) { release(static_cast<Nccl *>(ctx)); }

const zopt_comm_ops kNcclOps = {
    ZOPT_COMM_OPS_VERSION, ZOPT_COMM_MEM_DEVICE, "nccl",
    nccl_all_to_all, nccl_all_gather, nccl_exchange, nccl_synchronize,
    nccl_set_timeout, nccl_abort, nccl_last_error, nccl_destroy,
};

}  // namespace

ZOPT_API zopt_status zopt_comm_nccl_unique_id(void *id) {
  if (!id) return fail(ZOPT_ERR_INVALID_ARGUMENT, "zopt_comm_nccl_unique_id: id is NULL");
  const char *why = "";
  const Lib *L = lib(&why);
  if (!L) return fail(ZOPT_ERR_UNSUPPORTED, "zopt_comm_nccl_unique_id: %s", why);
  ncclUniqueId u;
  memset(&u, 0, sizeof u);
  ncclResult_t r = L->GetUniqueId(&u);
  if (r != ncclSuccess)
    return fail(kCommError, "zopt_comm_nccl_unique_id: ncclGetUniqueId: %s (ncclResult %d)",
                L->GetErrorString ? L->GetErrorString(r) : "?", r);
  memcpy(id, &u, sizeof u);
  return ZOPT_OK;
}

ZOPT_API zopt_status zopt_comm_create_nccl(const void *id, int rank, int size, void *cu_stream, zopt_comm **out) {
  if (!out) return fail(ZOPT_ERR_INVALID_ARGUMENT, "zopt_comm_create_nccl: out is NULL");
  *out = nullptr;
  if (!id) return fail(ZOPT_ERR_INVALID_ARGUMENT, "zopt_comm_create_nccl: id is NULL");
  if (size < 1) return fail(ZOPT_ERR_INVALID_ARGUMENT, "zopt_comm_create_nccl: size %d (must be >= 1)", size);
  if (rank < 0 || rank >= size)
    return fail(ZOPT_ERR_INVALID_ARGUMENT, "zopt_comm_create_nccl: rank %d out of range [0, %d)", rank, size);
  const char *why = "";
  const Lib *L = lib(&why);
  if (!L) return fail(ZOPT_ERR_UNSUPPORTED, "zopt_comm_create_nccl: %s", why);
  const Driver *cu = driver(&why);
  if (!cu) return fail(ZOPT_ERR_UNSUPPORTED, "zopt_comm_create_nccl: %s", why);
  if (!cu->StreamQuery)
    return fail(ZOPT_ERR_UNSUPPORTED, "zopt_comm_create_nccl: the CUDA driver lacks cuStreamQuery");
  CUcontext cur = nullptr;
  if (cu->CtxGetCurrent(&cur) != CUDA_SUCCESS || !cur)
    return fail(ZOPT_ERR_BAD_STATE,
                "zopt_comm_create_nccl: no current CUDA context on this thread: make this rank's device current "
                "first (cuCtxSetCurrent, cudaSetDevice, torch.cuda.set_device)");
  Nccl *n = new (std::nothrow) Nccl;
  if (!n) return fail(ZOPT_ERR_OUT_OF_MEMORY, "zopt_comm_create_nccl: out of memory");
  n->L = L;
  n->cu = cu;
  n->stream = static_cast<CUstream>(cu_stream);
  n->rank = rank;
  n->size = size;
  CUresult cr = cu->MemAlloc(&n->xdev, (size_t)size * kExchangeMax);
  if (cr == CUDA_SUCCESS) cr = cu->MemHostAlloc(reinterpret_cast<void **>(&n->xhost), (size_t)(size + 1) * kExchangeMax, 0);
  if (cr != CUDA_SUCCESS) {
    release(n);
    return fail(ZOPT_ERR_OUT_OF_MEMORY, "zopt_comm_create_nccl: %zu bytes for the signature exchange: %s",
                (size_t)size * kExchangeMax, error_string(cr));
  }
  ncclUniqueId u;
  memcpy(&u, id, sizeof u);
  ncclResult_t r = L->CommInitRank(&n->comm, size, u, rank);
  if (r != ncclSuccess) {
    std::string msg = nccl_text(n, r);
    n->comm = nullptr;
    release(n);
    return fail(kCommError, "zopt_comm_create_nccl: ncclCommInitRank (rank %d of %d): %s", rank, size, msg.c_str());
  }
  zopt_status st = comm_create_internal(&kNcclOps, n, rank, size, nullptr, out);
  if (st) release(n);
  return st;
}
