// loopback.cpp - W ranks as threads of one process (the test workhorse).
//
// The ranks share a hub. A collective is two rendezvous under one mutex:
//  1. every rank posts its signature and buffers and waits (until the
//     timeout) for all W posts of this sequence number; the posts must agree
//     (else every rank fails naming the odd ones out). Each rank then copies
//     straight from its peers' send buffers into its own recv buffer.
//  2. every rank marks its copies done and waits for all W, so that no rank
//     returns (and reuses its send buffer, or posts the next collective)
//     while a peer still reads from it.
// A rank that fails (timeout, a peer that left) withdraws its post and is
// marked gone, so that peers fail promptly instead of timing out; so does a
// rank whose communicator is freed or aborted.
#include "comm_internal.h"

#include <chrono>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <new>
#include <random>
#include <thread>

using namespace zopt;

namespace {

enum Gone : int { ACTIVE = 0, FREED = 1, ABORTED = 2 };

struct Slot {
  CommSignature sig{};
  const void *send = nullptr;
  void *recv = nullptr;
  uint64_t arrived = 0;  // sequence number posted (0: none, or withdrawn)
  uint64_t done = 0;     // sequence number whose copies are finished
  uint64_t last = 0;     // the last sequence number this rank called
  int gone = ACTIVE;
  std::string reason;    // why it gave up (ABORTED)
};

struct Hub {
  std::mutex mu;
  std::condition_variable cv;
  std::vector<Slot> slots;
  int refs = 0;
};

struct Rank {
  Hub *hub = nullptr;
  int rank = 0;
  double timeout = 30;
  uint32_t flags = 0;
  std::mt19937_64 rng;
  std::string err;
  uint64_t direct_seq = 0;  // collectives called through the table directly
};

void random_sleep(Rank *R) {
  if (!(R->flags & ZOPT_LOOPBACK_DELAY)) return;
  std::this_thread::sleep_for(std::chrono::microseconds(R->rng() % 2001));
}

std::string seconds(double s) {
  char b[32];
  snprintf(b, sizeof b, "%g s", s);
  return b;
}

int failed(Rank *R, int code, std::string msg) {
  R->err = std::move(msg);
  return code;
}

int lb_collective(void *ctx, const CommSignature *sig, const void *send, void *recv, bool *clean) {
  Rank *R = static_cast<Rank *>(ctx);
  Hub &h = *R->hub;
  const int r = R->rank, W = (int)h.slots.size();
  const uint64_t seq = sig->seq;
  const size_t B = sig->bytes;
  const bool in_place =
      sig->op == COMM_OP_ALL_GATHER && B && (const char *)send == (const char *)recv + (size_t)r * B;

  random_sleep(R);
  if ((R->flags & ZOPT_LOOPBACK_POISON) && sig->op != COMM_OP_BARRIER && B) {
    char *out = static_cast<char *>(recv);
    for (int q = 0; q < W; ++q)
      if (!(in_place && q == r)) memset(out + (size_t)q * B, 0xFF, B);
  }

  std::unique_lock<std::mutex> lk(h.mu);
  Slot &me = h.slots[(size_t)r];
  if (me.gone) return failed(R, ZOPT_COMM_ERR_FAILED, "this rank already left the loopback group");
  me.sig = *sig;
  me.send = send;
  me.recv = recv;
  me.arrived = seq;
  me.last = seq;
  h.cv.notify_all();

  // Rendezvous 1: all W posts of `seq`.
  const auto start = std::chrono::steady_clock::now();
  const auto deadline = start + std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                                    std::chrono::duration<double>(R->timeout));
  for (;;) {
    std::vector<int> missing, absent;
    std::vector<std::pair<std::string, std::vector<int>>> gone;  // description -> ranks
    for (int q = 0; q < W; ++q) {
      const Slot &s = h.slots[(size_t)q];
      if (s.arrived == seq) continue;
      missing.push_back(q);
      if (!s.gone) {
        absent.push_back(q);
        continue;
      }
      std::string d = s.gone != FREED ? "gave up on collective #" + std::to_string(s.last) + " (" + s.reason + ")"
                      : s.last ? "left (communicator freed after collective #" + std::to_string(s.last) + ")"
                               : "left (communicator freed before any collective)";
      size_t i = 0;
      while (i < gone.size() && gone[i].first != d) ++i;
      if (i == gone.size()) gone.push_back({d, {}});
      gone[i].second.push_back(q);
    }
    if (missing.empty()) break;
    bool timed_out = std::chrono::steady_clock::now() >= deadline;
    if (gone.empty() && !timed_out) {
      h.cv.wait_until(lk, deadline);
      continue;
    }
    // Fail: name the ranks that left or gave up, and those that did not call.
    std::string msg = timed_out ? "timed out after " + seconds(R->timeout) : "";
    for (auto &g : gone) msg += (msg.empty() ? "" : "; ") + comm_rank_list(g.second) + " " + g.first;
    if (!absent.empty()) {
      bool same = true;
      for (int q : absent) same = same && h.slots[(size_t)q].last == h.slots[(size_t)absent[0]].last;
      std::string last;
      if (same) {
        last = std::string(absent.size() == 1 ? "its" : "their") + " last collective was #" +
               std::to_string(h.slots[(size_t)absent[0]].last);
      } else {
        last = "last collectives:";
        for (int q : absent) last += " rank " + std::to_string(q) + " #" + std::to_string(h.slots[(size_t)q].last);
      }
      msg += (timed_out && gone.empty() ? ": " : "; ") + comm_rank_list(absent) + " did not call collective #" +
             std::to_string(seq) + " (" + last + ")";
    }
    me.arrived = 0;  // withdraw: nobody may use this rank's buffers now
    me.gone = ABORTED;
    me.reason = timed_out ? "timed out after " + seconds(R->timeout) : "another rank gave up or left";
    h.cv.notify_all();
    return failed(R, timed_out ? ZOPT_COMM_ERR_TIMEOUT : ZOPT_COMM_ERR_FAILED, msg);
  }

  std::vector<CommSignature> sigs((size_t)W);
  for (int q = 0; q < W; ++q) sigs[(size_t)q] = h.slots[(size_t)q].sig;
  std::string diff = comm_mismatch(sigs.data(), W, r);
  if (!diff.empty()) {  // every rank sees the same posts and fails the same way
    me.reason = "the ranks called different collectives";
    bool all_unchanged = true;
    for (const CommSignature &s : sigs) all_unchanged = all_unchanged && (s.flags & kSigUnchanged);
    if (clean) *clean = all_unchanged;
    // Rendezvous 2 as for data: no rank posts its next collective (over
    // its slot) before every rank has read this one's signatures.
    me.done = seq;
    h.cv.notify_all();
    h.cv.wait(lk, [&] {
      for (const Slot &s : h.slots)
        if (s.done != seq) return false;
      return true;
    });
    return failed(R, ZOPT_COMM_ERR_MISMATCH, diff);
  }
  lk.unlock();

  // Copies, straight from the peers' send buffers (they wait in rendezvous 2).
  if (B && sig->op != COMM_OP_BARRIER) {
    char *out = static_cast<char *>(recv);
    for (int i = 0; i < W; ++i) {
      int q = (r + i) % W;  // start with this rank's own piece, then spread
      const char *src = static_cast<const char *>(h.slots[(size_t)q].send);
      if (sig->op == COMM_OP_ALL_TO_ALL) src += (size_t)r * B;
      char *dst = out + (size_t)q * B;
      if (src != dst) memcpy(dst, src, B);
      if (i + 1 < W) random_sleep(R);
    }
  }

  // Rendezvous 2: every rank's copies are done (no timeout: every rank that
  // passed rendezvous 1 only copies memory before it gets here).
  lk.lock();
  me.done = seq;
  h.cv.notify_all();
  h.cv.wait(lk, [&] {
    for (const Slot &s : h.slots)
      if (s.done != seq) return false;
    return true;
  });
  lk.unlock();
  random_sleep(R);
  return ZOPT_COMM_OK;
}

int lb_direct(void *ctx, uint32_t op, const void *send, void *recv, size_t bytes) {
  Rank *R = static_cast<Rank *>(ctx);
  CommSignature sig;
  comm_make_signature(&sig, op, ++R->direct_seq, bytes, R->rank, "loopback table call");
  return lb_collective(ctx, &sig, send, recv, nullptr);
}
int lb_all_to_all(void *ctx, const void *send, void *recv, size_t bytes) {
  return lb_direct(ctx, COMM_OP_ALL_TO_ALL, send, recv, bytes);
}
int lb_all_gather(void *ctx, const void *send, void *recv, size_t bytes) {
  return lb_direct(ctx, COMM_OP_ALL_GATHER, send, recv, bytes);
}
int lb_set_timeout(void *ctx, double s) {
  static_cast<Rank *>(ctx)->timeout = s;
  return ZOPT_COMM_OK;
}
const char *lb_last_error(void *ctx) { return static_cast<Rank *>(ctx)->err.c_str(); }

void lb_leave(Rank *R, int how) {
  Hub &h = *R->hub;
  std::lock_guard<std::mutex> lk(h.mu);
  Slot &me = h.slots[(size_t)R->rank];
  if (!me.gone || how == FREED) me.gone = how;
  if (me.reason.empty()) me.reason = "it failed";
  h.cv.notify_all();
}
void lb_abort(void *ctx) { lb_leave(static_cast<Rank *>(ctx), ABORTED); }
void lb_destroy(void *ctx) {
  Rank *R = static_cast<Rank *>(ctx);
  Hub *h = R->hub;
  lb_leave(R, FREED);
  bool last;
  {
    std::lock_guard<std::mutex> lk(h->mu);
    last = --h->refs == 0;
  }
  if (last) delete h;
  delete R;
}

const zopt_comm_ops kLoopbackOps = {
    ZOPT_COMM_OPS_VERSION, ZOPT_COMM_MEM_HOST, "loopback",
    lb_all_to_all, lb_all_gather,
    nullptr,  // exchange: the rendezvous checks the signatures itself
    nullptr,  // synchronize
    lb_set_timeout, lb_abort, lb_last_error, lb_destroy,
};
const CommNative kLoopbackNative = {lb_collective};

}  // namespace

ZOPT_API zopt_status zopt_comm_create_loopback(int size, const zopt_loopback_options *options, zopt_comm **comms) {
  if (!comms) return fail(ZOPT_ERR_INVALID_ARGUMENT, "zopt_comm_create_loopback: comms is NULL");
  if (size < 1 || size > 4096)
    return fail(ZOPT_ERR_INVALID_ARGUMENT, "zopt_comm_create_loopback: size %d (must be in [1, 4096])", size);
  for (int r = 0; r < size; ++r) comms[r] = nullptr;
  zopt_loopback_options o{};
  if (options) o = *options;
  if (o.flags & ~(uint32_t)(ZOPT_LOOPBACK_DELAY | ZOPT_LOOPBACK_POISON))
    return fail(ZOPT_ERR_INVALID_ARGUMENT, "zopt_comm_create_loopback: unknown flags 0x%x",
                o.flags & ~(uint32_t)(ZOPT_LOOPBACK_DELAY | ZOPT_LOOPBACK_POISON));
  if (o.timeout_s != o.timeout_s || o.timeout_s <= 0) o.timeout_s = 30;
  Hub *h = new (std::nothrow) Hub;
  if (!h) return fail(ZOPT_ERR_OUT_OF_MEMORY, "zopt_comm_create_loopback: out of memory");
  h->slots.resize((size_t)size);
  for (int r = 0; r < size; ++r) {
    Rank *R = new (std::nothrow) Rank;
    zopt_status st = R ? ZOPT_OK : fail(ZOPT_ERR_OUT_OF_MEMORY, "zopt_comm_create_loopback: out of memory");
    if (R) {
      R->hub = h;
      R->rank = r;
      R->timeout = o.timeout_s;
      R->flags = o.flags;
      R->rng.seed(o.seed * 0x9E3779B97F4A7C15ull + (uint64_t)r);
      st = comm_create_internal(&kLoopbackOps, R, r, size, &kLoopbackNative, &comms[r]);
      if (st) delete R;
    }
    if (st) {
      std::string msg = zopt_last_error();
      for (int q = 0; q < r; ++q) zopt_comm_free(comms[q]), comms[q] = nullptr;
      if (r == 0) delete h;
      return fail(st, "%s", msg.c_str());
    }
    h->refs++;
  }
  return ZOPT_OK;
}
