// test_comm_nccl.cpp - the `nccl` communicator against stand-ins: the
// stand-in NCCL (fake_nccl/, soname libnccl.so.2, through ZOPT_NCCL_LIB) and
// the stand-in CUDA driver (test/Integration/GPUHost/fake-cuda.cpp, through
// ZOPT_CUDA_DRIVER), with W = 2 and 3 forked processes:
//
//  - collectives on random data of several sizes (all_to_all, all_gather,
//    in-place all_gather), after zopt_comm_synchronize;
//  - the exact sequence of NCCL calls each rank issued (the stand-in's log):
//    the signature exchange (an in-place ncclAllGather of 96 bytes) before
//    each checked collective, a group of ncclSend/ncclRecv with every peer
//    per all_to_all, ncclAllGather per all_gather, none for 0 bytes,
//    ncclCommAbort after a failure;
//  - a mismatch (rank 1 calls all_gather): every rank names rank 1;
//  - a rank that never calls: the others time out (1 s) and abort;
//  - with checks off, mismatched sizes: the stand-in's asynchronous
//    ncclInvalidUsage surfaces at zopt_comm_synchronize;
//  - the stand-in's own rules (send outside a group, unbalanced group,
//    overlapping all-gather, host pointers, unmatched send/recv);
//  - no current CUDA context, no NCCL library, a rank that never joins.
//
// Usage: zopt_test_comm_nccl <libzopt-fake-cuda.so> <stand-in libnccl.so.2>
#include "comm_test_util.h"

#include <dlfcn.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <functional>
#include <thread>

using namespace ct;

namespace {

constexpr zopt_status kCommErr = ZOPT_ERR_COMM;
std::string g_cuda, g_nccl, g_logdir;

// The stand-in driver, opened by path (the same instance the runtime loads).
struct Cuda {
  int (*MemAlloc)(unsigned long long *, size_t);
  int (*PrimaryCtxRetain)(void **, int);
  int (*CtxSetCurrent)(void *);
  int (*StreamSynchronize)(void *);
};
Cuda cuda() {
  void *h = dlopen(g_cuda.c_str(), RTLD_NOW);
  if (!h) {
    fprintf(stderr, "cannot load %s: %s\n", g_cuda.c_str(), dlerror());
    _exit(3);
  }
  Cuda c;
  c.MemAlloc = reinterpret_cast<int (*)(unsigned long long *, size_t)>(dlsym(h, "cuMemAlloc_v2"));
  c.PrimaryCtxRetain = reinterpret_cast<int (*)(void **, int)>(dlsym(h, "cuDevicePrimaryCtxRetain"));
  c.CtxSetCurrent = reinterpret_cast<int (*)(void *)>(dlsym(h, "cuCtxSetCurrent"));
  c.StreamSynchronize = reinterpret_cast<int (*)(void *)>(dlsym(h, "cuStreamSynchronize"));
  return c;
}
uint8_t *dalloc(const Cuda &c, size_t n) {
  unsigned long long p = 0;
  CT_CHECK(c.MemAlloc(&p, n ? n : 1) == 0, "cuMemAlloc");
  return reinterpret_cast<uint8_t *>(p);
}
void make_context_current(const Cuda &c) {
  void *ctx = nullptr;
  c.PrimaryCtxRetain(&ctx, 0);
  c.CtxSetCurrent(ctx);
}

// Forks W processes running fn(rank); true when all exit 0 within `limit`
// seconds (else they are killed).
bool run_ranks(int W, double limit, const std::function<void(int)> &fn) {
  fflush(stdout);
  fflush(stderr);
  std::vector<pid_t> pids;
  for (int r = 0; r < W; ++r) {
    pid_t p = fork();
    if (p == 0) {
      failures() = 0;  // the parent's count is not this rank's
      prefix() = "W=" + std::to_string(W) + " rank " + std::to_string(r) + ": ";
      fn(r);
      fflush(stdout);
      fflush(stderr);
      _exit(failures() ? 1 : 0);
    }
    if (p < 0) {
      perror("fork");
      break;
    }
    pids.push_back(p);
  }
  bool ok = (int)pids.size() == W;
  double t0 = now_s();
  size_t left = pids.size();
  std::vector<bool> done(pids.size(), false);
  while (left) {
    for (size_t i = 0; i < pids.size(); ++i) {
      if (done[i]) continue;
      int status = 0;
      pid_t p = waitpid(pids[i], &status, WNOHANG);
      if (p == pids[i]) {
        done[i] = true;
        --left;
        if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
          fprintf(stderr, "FAIL W=%d rank %zu exited with status 0x%x\n", W, i, status);
          ok = false;
        }
      }
    }
    if (left && now_s() - t0 > limit) {
      fprintf(stderr, "FAIL W=%d: ranks still running after %g s, killed\n", W, limit);
      for (size_t i = 0; i < pids.size(); ++i)
        if (!done[i]) kill(pids[i], SIGKILL), waitpid(pids[i], nullptr, 0);
      return false;
    }
    if (left) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return ok;
}

std::vector<std::string> read_lines(const std::string &path) {
  std::vector<std::string> out;
  std::ifstream f(path);
  for (std::string l; std::getline(f, l);) out.push_back(l);
  return out;
}

// Compares a rank's NCCL log with the expected calls.
void check_log(const std::string &path, const std::vector<std::string> &want) {
  std::vector<std::string> got = read_lines(path);
  size_t n = std::max(got.size(), want.size());
  for (size_t i = 0; i < n; ++i) {
    const std::string g = i < got.size() ? got[i] : "(end)", w = i < want.size() ? want[i] : "(end)";
    if (g != w) {
      CT_CHECK(false, "NCCL call %zu of %s is \"%s\", want \"%s\" (%zu calls, want %zu)", i, path.c_str(),
               g.c_str(), w.c_str(), got.size(), want.size());
      return;
    }
  }
}

std::string stream_text(void *s) {
  char b[32];
  snprintf(b, sizeof b, "%p", s);
  return b;
}

// ---- the main scenario: data, log, mismatch ---------------------------------------
void ranks_data(int W, int r, const uint8_t *id) {
  Cuda cu = cuda();
  std::string log = g_logdir + "/data." + std::to_string(W) + "." + std::to_string(r) + ".log";
  setenv("FAKE_NCCL_LOG", log.c_str(), 1);
  void *stream = reinterpret_cast<void *>(0x5000);
  const std::string S = " stream=" + stream_text(stream);
  zopt_comm *c = nullptr;
  CT_ERR(zopt_comm_create_nccl(id, r, W, stream, &c), ZOPT_ERR_BAD_STATE, "no current CUDA context");
  make_context_current(cu);
  CT_OK(zopt_comm_create_nccl(id, r, W, stream, &c));
  if (!c) return;
  CT_CHECK(zopt_comm_rank(c) == r && zopt_comm_size(c) == W && !strcmp(zopt_comm_name(c), "nccl") &&
               zopt_comm_memory(c) == ZOPT_COMM_MEM_DEVICE,
           "rank/size/name/memory");
  CT_OK(zopt_comm_set_timeout(c, 30));
  std::vector<std::string> want = {"ncclCommInitRank nranks=" + std::to_string(W) + " rank=" + std::to_string(r)};
  const std::string sig = "ncclAllGather sendcount=96 type=0 in_place=1" + S;
  uint64_t round = 0;
  for (size_t B : {(size_t)0, (size_t)1, (size_t)7, (size_t)4101}) {
    uint8_t *send = dalloc(cu, (size_t)W * B), *recv = dalloc(cu, (size_t)W * B);
    fill_all_to_all(send, ++round, r, W, B);
    CT_OK(zopt_comm_all_to_all(c, send, recv, B));
    CT_OK(zopt_comm_synchronize(c));
    std::string e = check_all_to_all(recv, round, r, W, B);
    CT_CHECK(e.empty(), "B=%zu: %s", B, e.c_str());
    want.push_back(sig);
    if (B) {
      want.push_back("ncclGroupStart");
      for (int q = 0; q < W; ++q) {
        std::string tail = " count=" + std::to_string(B) + " type=0 peer=" + std::to_string(q) + S;
        want.push_back("ncclSend" + tail);
        want.push_back("ncclRecv" + tail);
      }
      want.push_back("ncclGroupEnd");
    }
    fill_all_gather(send, ++round, r, B);
    CT_OK(zopt_comm_all_gather(c, send, recv, B));
    CT_OK(zopt_comm_synchronize(c));
    e = check_all_gather(recv, round, W, B);
    CT_CHECK(e.empty(), "B=%zu: %s", B, e.c_str());
    want.push_back(sig);
    if (B) want.push_back("ncclAllGather sendcount=" + std::to_string(B) + " type=0 in_place=0" + S);
    fill_all_gather(recv + (size_t)r * B, ++round, r, B);
    CT_OK(zopt_comm_all_gather(c, recv + (size_t)r * B, recv, B));
    CT_OK(zopt_comm_synchronize(c));
    e = check_all_gather(recv, round, W, B);
    CT_CHECK(e.empty(), "B=%zu in place: %s", B, e.c_str());
    want.push_back(sig);
    if (B) want.push_back("ncclAllGather sendcount=" + std::to_string(B) + " type=0 in_place=1" + S);
  }
  // Checks off: no signature exchange. Several collectives before one synchronize.
  CT_OK(zopt_comm_set_checks(c, 0));
  // (Each collective has its own send buffer: a buffer enqueued for sending
  // must not change before the stream has run the collective.)
  uint8_t *send = dalloc(cu, (size_t)W * 64), *recv = dalloc(cu, (size_t)W * 64), *gat = dalloc(cu, (size_t)W * 64);
  uint8_t *send2 = dalloc(cu, 64);
  fill_all_to_all(send, ++round, r, W, 64);
  CT_OK(zopt_comm_all_to_all(c, send, recv, 64));
  fill_all_gather(send2, round + 1, r, 64);
  CT_OK(zopt_comm_all_gather(c, send2, gat, 64));
  CT_OK(zopt_comm_synchronize(c));
  std::string e = check_all_to_all(recv, round, r, W, 64);
  CT_CHECK(e.empty(), "checks off: %s", e.c_str());
  e = check_all_gather(gat, ++round, W, 64);
  CT_CHECK(e.empty(), "checks off: %s", e.c_str());
  want.push_back("ncclGroupStart");
  for (int q = 0; q < W; ++q) {
    std::string tail = " count=64 type=0 peer=" + std::to_string(q) + S;
    want.push_back("ncclSend" + tail);
    want.push_back("ncclRecv" + tail);
  }
  want.push_back("ncclGroupEnd");
  want.push_back("ncclAllGather sendcount=64 type=0 in_place=0" + S);
  CT_OK(zopt_comm_barrier(c));  // always exchanges
  want.push_back(sig);
  CT_OK(zopt_comm_set_checks(c, 1));
  // The mismatch: rank 1 calls all_gather.
  zopt_status st = r == 1 ? zopt_comm_all_gather(c, send, recv, 8) : zopt_comm_all_to_all(c, send, recv, 64);
  std::string m = zopt_last_error();
  CT_CHECK(st == kCommErr && m.find(r == 1 ? "rank 1 (this rank) differs" : "rank 1 called #") != std::string::npos,
           "mismatch -> %d: %s", (int)st, m.c_str());
  if (r == 0) printf("    mismatch: %s\n", m.c_str());
  want.push_back(sig);
  want.push_back("ncclCommAbort");
  CT_ERR(zopt_comm_synchronize(c), kCommErr, "failed earlier");
  zopt_comm_free(c);
  check_log(log, want);
}

// ---- a rank that never calls -----------------------------------------------------------
void ranks_missing(int W, int r, const uint8_t *id) {
  Cuda cu = cuda();
  make_context_current(cu);
  zopt_comm *c = nullptr;
  CT_OK(zopt_comm_create_nccl(id, r, W, nullptr, &c));  // the legacy default stream
  if (!c) return;
  CT_OK(zopt_comm_set_timeout(c, 1.0));
  uint8_t *send = dalloc(cu, (size_t)W * 16), *recv = dalloc(cu, (size_t)W * 16);
  if (r == W - 1) {  // leaves without calling
    zopt_comm_free(c);
    return;
  }
  // Each waiting rank either times out itself, or, when a peer timed out
  // and aborted first, gets NCCL's remote error.
  double t0 = now_s();
  std::string m = CT_ERR(zopt_comm_all_to_all(c, send, recv, 16), kCommErr, "signature exchange");
  double dt = now_s() - t0;
  bool timed_out = m.find("not finished within 1 s") != std::string::npos &&
                   m.find("NCCL communicator was aborted") != std::string::npos;
  bool remote = m.find("remote process exited") != std::string::npos &&
                m.find("aborted its communicator") != std::string::npos;
  CT_CHECK(timed_out || remote, "neither a timeout nor a peer's abort: %s", m.c_str());
  CT_CHECK((!timed_out || dt > 0.9) && dt < 5, "failed after %.2f s (timeout 1 s)", dt);
  if (r == 0) printf("    missing rank: %s\n", m.c_str());
  zopt_comm_free(c);
}

// ---- checks off, mismatched sizes: NCCL's asynchronous error ---------------------------------
void ranks_async(int W, int r, const uint8_t *id) {
  Cuda cu = cuda();
  make_context_current(cu);
  zopt_comm *c = nullptr;
  CT_OK(zopt_comm_create_nccl(id, r, W, reinterpret_cast<void *>(0x6000), &c));
  if (!c) return;
  CT_OK(zopt_comm_set_timeout(c, 10));
  CT_OK(zopt_comm_set_checks(c, 0));
  uint8_t *send = dalloc(cu, (size_t)W * 33), *recv = dalloc(cu, (size_t)W * 33);
  CT_OK(zopt_comm_all_to_all(c, send, recv, r == 1 ? 33 : 32));  // enqueued: no error yet
  std::string m = CT_ERR(zopt_comm_synchronize(c), kCommErr, "invalid usage", "does not match");
  if (r == 0) printf("    checks off, sizes differ: %s\n", m.c_str());
  zopt_comm_free(c);
}

// ---- the stand-in's own rules --------------------------------------------------------------
void stand_in_rules() {
  Cuda cu = cuda();
  void *h = dlopen(g_nccl.c_str(), RTLD_NOW);
  CT_CHECK(h != nullptr, "dlopen %s", g_nccl.c_str());
  if (!h) return;
  struct Id128 {
    char b[128];
  } id;
  auto get_id = reinterpret_cast<int (*)(Id128 *)>(dlsym(h, "ncclGetUniqueId"));
  auto init = reinterpret_cast<int (*)(void **, int, Id128, int)>(dlsym(h, "ncclCommInitRank"));
  auto send = reinterpret_cast<int (*)(const void *, size_t, int, int, void *, void *)>(dlsym(h, "ncclSend"));
  auto recv = reinterpret_cast<int (*)(void *, size_t, int, int, void *, void *)>(dlsym(h, "ncclRecv"));
  auto gather = reinterpret_cast<int (*)(const void *, void *, size_t, int, void *, void *)>(dlsym(h, "ncclAllGather"));
  auto gstart = reinterpret_cast<int (*)()>(dlsym(h, "ncclGroupStart"));
  auto gend = reinterpret_cast<int (*)()>(dlsym(h, "ncclGroupEnd"));
  auto async = reinterpret_cast<int (*)(void *, int *)>(dlsym(h, "ncclCommGetAsyncError"));
  auto abort_ = reinterpret_cast<int (*)(void *)>(dlsym(h, "ncclCommAbort"));
  CT_CHECK(get_id(&id) == 0, "ncclGetUniqueId");
  void *comm = nullptr;
  CT_CHECK(init(&comm, 1, id, 0) == 0 && comm, "ncclCommInitRank W=1");
  const int kInvalidArgument = 4, kInvalidUsage = 5;
  uint8_t *buf = dalloc(cu, 64);
  std::vector<uint8_t> host(64);
  CT_CHECK(send(buf, 8, 0, 0, comm, nullptr) == kInvalidUsage, "ncclSend outside a group");
  CT_CHECK(gend() == kInvalidUsage, "ncclGroupEnd without ncclGroupStart");
  CT_CHECK(gather(buf + 1, buf, 8, 0, comm, nullptr) == kInvalidArgument, "overlapping all-gather not in place");
  CT_CHECK(gather(buf, buf, 8, 0, comm, nullptr) == 0, "in-place all-gather at rank 0");
  CT_CHECK(gather(host.data(), buf, 8, 0, comm, nullptr) == kInvalidArgument, "host sendbuff");
  CT_CHECK(gather(buf, buf + 8, 8, 99, comm, nullptr) == kInvalidArgument, "unknown datatype");
  gstart();
  CT_CHECK(gather(buf, buf + 8, 8, 0, comm, nullptr) == kInvalidUsage, "collective inside a group");
  CT_CHECK(send(buf, 8, 0, 1, comm, nullptr) == kInvalidArgument, "peer out of range");
  CT_CHECK(gend() == kInvalidArgument, "ncclGroupEnd reports the group's first error");
  // An unmatched pair: the error is asynchronous.
  gstart();
  CT_CHECK(send(buf, 8, 0, 0, comm, nullptr) == 0 && recv(buf + 32, 4, 0, 0, comm, nullptr) == 0, "send/recv");
  CT_CHECK(gend() == 0, "ncclGroupEnd");
  cu.StreamSynchronize(nullptr);
  int e = 0;
  CT_CHECK(async(comm, &e) == 0 && e == kInvalidUsage, "unmatched send/recv -> async error %d", e);
  abort_(comm);
  pass("stand-in NCCL rules: send outside a group, unbalanced group end, overlapping or host buffers, "
       "collective in a group, unmatched send/recv");
}

}  // namespace

int main(int argc, char **argv) {
  if (argc != 3) {
    fprintf(stderr, "usage: %s <libzopt-fake-cuda.so> <stand-in libnccl.so.2>\n", argv[0]);
    return 2;
  }
  double t0 = now_s();
  g_cuda = argv[1];
  g_nccl = argv[2];
  char tmpl[] = "/tmp/zopt-nccl-test-XXXXXX";
  if (!mkdtemp(tmpl)) return perror("mkdtemp"), 2;
  g_logdir = tmpl;
  setenv("ZOPT_CUDA_DRIVER", g_cuda.c_str(), 1);
  setenv("FAKE_NCCL_INIT_TIMEOUT_S", "10", 1);

  // Before anything loads NCCL in this process: a missing library.
  bool ok = run_ranks(1, 30, [](int) {
    setenv("ZOPT_NCCL_LIB", "/nonexistent/libnccl.so.2", 1);
    uint8_t id[ZOPT_NCCL_UNIQUE_ID_BYTES];
    CT_ERR(zopt_comm_nccl_unique_id(id), ZOPT_ERR_UNSUPPORTED, "cannot be loaded", "ZOPT_NCCL_LIB");
    zopt_comm *c = nullptr;
    CT_ERR(zopt_comm_create_nccl(id, 0, 1, nullptr, &c), ZOPT_ERR_UNSUPPORTED, "cannot be loaded");
  });
  if (ok) pass("no NCCL library: ZOPT_ERR_UNSUPPORTED naming it");
  setenv("ZOPT_NCCL_LIB", g_nccl.c_str(), 1);

  uint8_t ids[3][3][ZOPT_NCCL_UNIQUE_ID_BYTES];
  CT_ERR(zopt_comm_nccl_unique_id(nullptr), ZOPT_ERR_INVALID_ARGUMENT, "id is NULL");
  for (auto &w : ids)
    for (auto &id : w) CT_OK(zopt_comm_nccl_unique_id(id));
  zopt_comm *c = nullptr;
  CT_ERR(zopt_comm_create_nccl(nullptr, 0, 1, nullptr, &c), ZOPT_ERR_INVALID_ARGUMENT, "id is NULL");
  CT_ERR(zopt_comm_create_nccl(ids[0][0], 2, 2, nullptr, &c), ZOPT_ERR_INVALID_ARGUMENT, "rank 2 out of range");
  CT_ERR(zopt_comm_create_nccl(ids[0][0], 0, 1, nullptr, nullptr), ZOPT_ERR_INVALID_ARGUMENT, "out is NULL");

  for (int W : {2, 3}) {
    uint8_t(*id)[ZOPT_NCCL_UNIQUE_ID_BYTES] = ids[W - 2];
    if (run_ranks(W, 60, [&](int r) { ranks_data(W, r, id[0]); }))
      pass("nccl W=%d: collectives on random data, the exact NCCL call sequence, a mismatch naming rank 1", W);
    else
      failures()++;
    if (run_ranks(W, 60, [&](int r) { ranks_missing(W, r, id[1]); }))
      pass("nccl W=%d: a rank that never calls: the others time out after 1 s and abort", W);
    else
      failures()++;
    if (run_ranks(W, 60, [&](int r) { ranks_async(W, r, id[2]); }))
      pass("nccl W=%d: checks off, mismatched sizes: NCCL's asynchronous error at synchronize", W);
    else
      failures()++;
  }
  if (!run_ranks(1, 30, [](int) { stand_in_rules(); })) failures()++;
  // A rank that never joins: ncclCommInitRank gives up (the stand-in's timeout).
  if (run_ranks(1, 30, [&](int) {
        setenv("FAKE_NCCL_INIT_TIMEOUT_S", "1", 1);
        make_context_current(cuda());
        zopt_comm *c = nullptr;
        CT_ERR(zopt_comm_create_nccl(ids[2][0], 0, 2, nullptr, &c), kCommErr, "ncclCommInitRank (rank 0 of 2)",
               "rank(s) 1 did not join within 1 s");
      }))
    pass("nccl: a rank that never joins: zopt_comm_create_nccl fails naming it");
  else
    failures()++;

  std::string rm = "rm -rf '" + g_logdir + "'";
  if (!failures() && system(rm.c_str()) != 0) fprintf(stderr, "cannot remove %s\n", g_logdir.c_str());
  int n = failures();
  printf("%s: %d failures in %.1f s%s%s\n", n ? "FAILED" : "OK", n, now_s() - t0, n ? "; logs in " : "",
         n ? g_logdir.c_str() : "");
  return n ? 1 : 0;
}
