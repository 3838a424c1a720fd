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
//  - no current CUDA context, no NCCL library, a rank that never joins;
//  - with compiled steps on the command line (test/Integration/ZeRO/
//    nccl-refusals*.test compiles them), what an optimizer refuses at W = 2
//    ranks of NCCL: the communicator attached to a step that updates on
//    the CPU (zopt_optimizer_set_comm: it moves device memory), a step that
//    updates on the GPU at world size 2 (zopt_optimizer_finalize: GPU steps
//    run at world size 1 for now). Each refusal has its error code and a
//    message naming the problem, and leaves the optimizer as it was: it
//    finalizes without the communicator and steps bit-identically to an
//    optimizer that was never offered one (params, grads, every state, the
//    step results and counts).
//
// Usage: zopt_test_comm_nccl <libzopt-fake-cuda.so> <stand-in libnccl.so.2>
//                            [CPU_STEP.so|- [GPU_STEP.so]]
#include "comm_test_util.h"
#include "zopt/zopt.h"

#include <dlfcn.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
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

// ---- refusals: a device communicator for a CPU step, a GPU step at W > 1 ----------------

// A model of three tensors in two groups; params and grads in host memory
// (a CPU step) or in the stand-in's device memory (host memory too, so the
// test writes them directly).
const std::vector<int64_t> kOptSizes = {5, 1000, 40001};

size_t dsize(uint32_t dt) { return dt == ZOPT_DTYPE_F32 ? 4 : 2; }
void store(uint8_t *p, uint32_t dt, int64_t i, float v) {
  if (dt == ZOPT_DTYPE_F32) {
    memcpy(p + 4 * i, &v, 4);
  } else if (dt == ZOPT_DTYPE_BF16) {
    uint32_t u;
    memcpy(&u, &v, 4);
    uint16_t h = (uint16_t)(u >> 16);
    memcpy(p + 2 * i, &h, 2);
  } else {
    _Float16 h = (_Float16)v;
    memcpy(p + 2 * i, &h, 2);
  }
}
float opt_value(uint64_t a, uint64_t t, int64_t i) {
  uint64_t h = (a + 1) * 0x9E3779B97F4A7C15ull ^ (t << 40) ^ (uint64_t)i;
  h ^= h >> 31;
  h *= 0xBF58476D1CE4E5B9ull;
  h ^= h >> 29;
  return (float)(((double)(h >> 11) / 9007199254740992.0 - 0.5) * 0.2);
}

struct Opt {
  const zopt_step_descriptor *d = nullptr;
  uint32_t pdt = 0, gdt = 0;
  zopt_optimizer *o = nullptr;
  std::vector<uint8_t *> p, g;
  std::vector<std::vector<uint8_t>> host;  // the memory of a CPU step
  ~Opt() { zopt_optimizer_free(o); }
};

// An optimizer of the model with the initial params (not finalized).
bool make_opt(const zopt_step *step, bool device, const Cuda *cu, Opt &m) {
  m.d = zopt_step_get_descriptor(step);
  for (uint32_t i = 0; i < m.d->num_states; ++i) {
    if (m.d->states[i].kind == ZOPT_STATE_PARAM) m.pdt = m.d->states[i].dtype;
    if (m.d->states[i].kind == ZOPT_STATE_GRAD) m.gdt = m.d->states[i].dtype;
  }
  CT_OK(zopt_optimizer_create(step, &m.o));
  if (!m.o) return false;
  int g0 = 0, g1 = 0, id = 0;
  CT_OK(zopt_optimizer_add_group(m.o, &g0));
  CT_OK(zopt_optimizer_add_group(m.o, &g1));
  CT_OK(zopt_optimizer_set_hyper(m.o, g1, "lr", 3e-3));
  for (size_t t = 0; t < kOptSizes.size(); ++t) {
    const size_t np = (size_t)kOptSizes[t] * dsize(m.pdt), ng = (size_t)kOptSizes[t] * dsize(m.gdt);
    if (device) {
      m.p.push_back(dalloc(*cu, np));
      m.g.push_back(dalloc(*cu, ng));
    } else {
      m.host.emplace_back(np);
      m.p.push_back(m.host.back().data());
      m.host.emplace_back(ng);
      m.g.push_back(m.host.back().data());
    }
    for (int64_t i = 0; i < kOptSizes[t]; ++i) store(m.p[t], m.pdt, i, opt_value(0, t, i));
    CT_OK(zopt_optimizer_add_tensor(m.o, t == 1 ? g1 : g0, m.p[t], m.g[t], kOptSizes[t], (zopt_dtype)m.pdt, &id));
  }
  return true;
}

// Steps `a` (the optimizer that refused) and `b` (never offered the
// communicator) three times on the same gradients; everything must match.
// `kernels_run`: false on the stand-in driver, which runs no GPU kernel (the
// step counts the device keeps are not counted then).
void step_both(Opt &a, Opt &b, const char *what, bool kernels_run) {
  bool same = true;
  std::string first;
  auto differ = [&](const std::string &m) {
    if (same) first = m;
    same = false;
  };
  for (int k = 1; k <= 3; ++k) {
    for (Opt *m : {&a, &b})
      for (size_t t = 0; t < kOptSizes.size(); ++t)
        for (int64_t i = 0; i < kOptSizes[t]; ++i) store(m->g[t], m->gdt, i, opt_value(k, t, i));
    zopt_step_result ra{}, rb{};
    CT_OK(zopt_optimizer_step(a.o, &ra));
    CT_OK(zopt_optimizer_step(b.o, &rb));
    // (The stand-in runs no kernel: a GPU step's results are NaN, in no
    // particular bits.)
    auto same_value = [](double x, double y) { return !memcmp(&x, &y, 8) || (std::isnan(x) && std::isnan(y)); };
    if (!same_value(ra.grad_norm, rb.grad_norm) || ra.skipped != rb.skipped || !same_value(ra.loss_scale, rb.loss_scale))
      differ("step " + std::to_string(k) + ": the step results differ (norm " + std::to_string(ra.grad_norm) + " vs " + std::to_string(rb.grad_norm) + ", skipped " + std::to_string(ra.skipped) + " vs " + std::to_string(rb.skipped) + ", scale " + std::to_string(ra.loss_scale) + " vs " + std::to_string(rb.loss_scale) + ")");
    for (uint32_t s = 0; s < a.d->num_states; ++s)
      for (size_t t = 0; t < kOptSizes.size(); ++t) {
        const size_t n = (size_t)kOptSizes[t] * dsize(a.d->states[s].dtype);
        std::vector<uint8_t> x(n, 1), y(n, 2);
        CT_OK(zopt_optimizer_read_state_raw(a.o, (int)t, (zopt_state_kind)a.d->states[s].kind, x.data(), n));
        CT_OK(zopt_optimizer_read_state_raw(b.o, (int)t, (zopt_state_kind)b.d->states[s].kind, y.data(), n));
        if (x != y)
          differ("step " + std::to_string(k) + ": state " + std::to_string(a.d->states[s].kind) + " of tensor " +
                 std::to_string(t) + " differs");
      }
    for (size_t t = 0; t < kOptSizes.size(); ++t) {
      int64_t ca = -1, cb = -2;
      CT_OK(zopt_optimizer_get_tensor_step(a.o, (int)t, &ca));
      CT_OK(zopt_optimizer_get_tensor_step(b.o, (int)t, &cb));
      if (ca != cb || (kernels_run && ca != k))
        differ("step " + std::to_string(k) + ": tensor " + std::to_string(t) + " took " + std::to_string(ca) +
               " steps, the other optimizer " + std::to_string(cb));
    }
  }
  CT_CHECK(same, "%s: after the refusal, not bit-identical to an optimizer never offered the communicator: %s",
           what, first.c_str());
}

bool same_memory_info(const zopt_optimizer *a, const zopt_optimizer *b) {
  zopt_memory_info x, y;
  memset(&x, 1, sizeof x);
  memset(&y, 2, sizeof y);
  if (zopt_optimizer_memory_info(a, &x) != ZOPT_OK || zopt_optimizer_memory_info(b, &y) != ZOPT_OK) return false;
  return !memcmp(&x, &y, sizeof x);
}

// A CPU step refuses the NCCL communicator (it moves device memory).
void ranks_cpu_refusal(int W, int r, const uint8_t *id, const std::string &path) {
  Cuda cu = cuda();
  make_context_current(cu);
  zopt_step *step = nullptr;
  CT_OK(zopt_step_load(path.c_str(), &step));
  zopt_comm *c = nullptr;
  CT_OK(zopt_comm_create_nccl(id, r, W, nullptr, &c));
  if (!step || !c) return;
  {
    Opt a, b;
    if (!make_opt(step, false, nullptr, a) || !make_opt(step, false, nullptr, b)) return;
    std::string m = CT_ERR(zopt_optimizer_set_comm(a.o, c), ZOPT_ERR_INVALID_ARGUMENT,
                           "communicator 'nccl' moves device memory", "updates on the CPU",
                           std::string("step '") + a.d->name + "'", "use a host communicator");
    if (r == 0) printf("    CPU step, NCCL communicator: %s\n", m.c_str());
    int rank = -1, world = -1;
    CT_OK(zopt_optimizer_get_world(a.o, &rank, &world));
    CT_CHECK(rank == 0 && world == 1, "after the refusal: rank %d of %d, want 0 of 1 (no communicator)", rank, world);
    CT_CHECK(same_memory_info(a.o, b.o), "after the refusal: memory_info differs from a fresh optimizer's");
    CT_OK(zopt_optimizer_finalize(a.o));
    CT_OK(zopt_optimizer_finalize(b.o));
    CT_CHECK(same_memory_info(a.o, b.o), "finalized: memory_info differs from a fresh optimizer's");
    step_both(a, b, "CPU step", true);
  }
  zopt_comm_free(c);
  zopt_step_free(step);
}

// A GPU step takes the NCCL communicator but refuses world size W > 1 at
// finalize; without the communicator it finalizes at world size 1.
void ranks_gpu_refusal(int W, int r, const uint8_t *id, const std::string &path) {
  Cuda cu = cuda();
  make_context_current(cu);
  zopt_step *step = nullptr;
  CT_OK(zopt_step_load(path.c_str(), &step));
  zopt_comm *c = nullptr;
  CT_OK(zopt_comm_create_nccl(id, r, W, nullptr, &c));
  if (!step || !c) return;
  {
    Opt a, b;
    if (!make_opt(step, true, &cu, a) || !make_opt(step, true, &cu, b)) return;
    CT_OK(zopt_optimizer_set_comm(a.o, c));  // a device communicator for a GPU step
    zopt_memory_info pre{};
    CT_OK(zopt_optimizer_memory_info(a.o, &pre));
    CT_CHECK(pre.world_size == W && pre.rank == r, "before finalize: memory_info says rank %d of %d, want %d of %d",
             pre.rank, pre.world_size, r, W);
    std::string m = CT_ERR(zopt_optimizer_finalize(a.o), ZOPT_ERR_UNSUPPORTED,
                           std::string("step '") + a.d->name + "' updates on the GPU", "world size 1",
                           "the communicator has " + std::to_string(W) + " ranks");
    if (r == 0) printf("    GPU step at %d ranks: %s\n", W, m.c_str());
    // Still not finalized: a step is refused as before finalize.
    zopt_step_result res{};
    CT_ERR(zopt_optimizer_step(a.o, &res), ZOPT_ERR_BAD_STATE, "finalize first");
    CT_OK(zopt_optimizer_set_comm(a.o, nullptr));
    double D = 0;
    CT_OK(zopt_optimizer_get_grad_divisor(a.o, &D));
    CT_CHECK(D == 1, "after the refusal, without the communicator: gradient divisor %g, want 1", D);
    CT_CHECK(same_memory_info(a.o, b.o), "after the refusal: memory_info differs from a fresh optimizer's");
    CT_OK(zopt_optimizer_finalize(a.o));
    CT_OK(zopt_optimizer_finalize(b.o));
    zopt_memory_info mi{};
    CT_OK(zopt_optimizer_memory_info(a.o, &mi));
    CT_CHECK(mi.world_size == 1 && mi.rank == 0, "finalized without the communicator: rank %d of %d", mi.rank,
             mi.world_size);
    CT_CHECK(same_memory_info(a.o, b.o), "finalized: memory_info differs from a fresh optimizer's");
    step_both(a, b, "GPU step", false);
  }
  zopt_comm_free(c);
  zopt_step_free(step);
}

}  // namespace

int main(int argc, char **argv) {
  if (argc < 3 || argc > 5) {
    fprintf(stderr, "usage: %s <libzopt-fake-cuda.so> <stand-in libnccl.so.2> [CPU_STEP.so|- [GPU_STEP.so]]\n",
            argv[0]);
    return 2;
  }
  const std::string cpu_step = argc > 3 && strcmp(argv[3], "-") ? argv[3] : "";
  const std::string gpu_step = argc > 4 ? argv[4] : "";
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

  uint8_t ids[3][3][ZOPT_NCCL_UNIQUE_ID_BYTES], ref_ids[2][ZOPT_NCCL_UNIQUE_ID_BYTES];
  CT_ERR(zopt_comm_nccl_unique_id(nullptr), ZOPT_ERR_INVALID_ARGUMENT, "id is NULL");
  for (auto &w : ids)
    for (auto &id : w) CT_OK(zopt_comm_nccl_unique_id(id));
  for (auto &id : ref_ids) CT_OK(zopt_comm_nccl_unique_id(id));
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

  // Refusals (with compiled steps only: the lit tests give them).
  if (!cpu_step.empty()) {
    if (run_ranks(2, 60, [&](int r) { ranks_cpu_refusal(2, r, ref_ids[0], cpu_step); }))
      pass("a CPU step refuses the NCCL communicator (ZOPT_ERR_INVALID_ARGUMENT naming it) and then steps "
           "bit-identically to one never offered it");
    else
      failures()++;
  } else {
    printf("SKIP a CPU step with the NCCL communicator: no CPU step given\n");
  }
  if (!gpu_step.empty()) {
    if (run_ranks(2, 60, [&](int r) { ranks_gpu_refusal(2, r, ref_ids[1], gpu_step); }))
      pass("a GPU step refuses to finalize at 2 ranks (ZOPT_ERR_UNSUPPORTED naming the world size) and then, "
           "without the communicator, steps bit-identically to one never offered it");
    else
      failures()++;
  } else {
    printf("SKIP a GPU step at 2 ranks: no GPU step given\n");
  }

  std::string rm = "rm -rf '" + g_logdir + "'";
  if (!failures() && system(rm.c_str()) != 0) fprintf(stderr, "cannot remove %s\n", g_logdir.c_str());
  int n = failures();
  printf("%s: %d failures in %.1f s%s%s\n", n ? "FAILED" : "OK", n, now_s() - t0, n ? "; logs in " : "",
         n ? g_logdir.c_str() : "");
  return n ? 1 : 0;
}
