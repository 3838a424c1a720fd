// test_comm.cpp - the communicator wrapper and the in-process engines
// (zopt/comm.h): self; loopback at W = 1, 2, 3, 4, 8 on random data with
// and without the DELAY/POISON modes; mismatched operations and sizes;
// a rank that never calls; a rank that leaves; poisoning; API misuse; a
// user-supplied table (the wrapper's own signature exchange).
//
// Built from the runtime's comm sources directly (like test_convert), so
// that it also reaches the internal entry points the optimizer calls
// (zopt::comm_all_to_all(..., what)).
#include "comm_test_util.h"

#include "../src/comm/comm_internal.h"

#include <cmath>
#include <condition_variable>
#include <functional>
#include <thread>

using namespace ct;

namespace {

constexpr zopt_status kCommErr = zopt::kCommError;

// Runs fn(rank) on W threads.
void on_threads(int W, const std::function<void(int)> &fn) {
  std::vector<std::thread> ts;
  for (int r = 0; r < W; ++r) ts.emplace_back(fn, r);
  for (auto &t : ts) t.join();
}

std::vector<zopt_comm *> loopback(int W, double timeout, uint32_t flags, uint64_t seed = 1) {
  std::vector<zopt_comm *> comms((size_t)W, nullptr);
  zopt_loopback_options o{};
  o.timeout_s = timeout;
  o.flags = flags;
  o.seed = seed;
  CT_OK(zopt_comm_create_loopback(W, &o, comms.data()));
  return comms;
}

void free_all(std::vector<zopt_comm *> &comms) {
  for (zopt_comm *c : comms) zopt_comm_free(c);
  comms.clear();
}

const size_t kSizes[] = {0, 1, 3, 8, 17, 4093, 65536 + 7};

// ---- self ----------------------------------------------------------------------
void test_self() {
  zopt_comm *c = nullptr;
  CT_OK(zopt_comm_create_self(&c));
  CT_CHECK(zopt_comm_rank(c) == 0 && zopt_comm_size(c) == 1, "self rank/size");
  CT_CHECK(!strcmp(zopt_comm_name(c), "self"), "self name %s", zopt_comm_name(c));
  CT_CHECK(zopt_comm_memory(c) == ZOPT_COMM_MEM_HOST, "self memory");
  for (size_t B : kSizes) {
    std::vector<uint8_t> send(B + 1), recv(B + 1, 0);
    fill_all_to_all(send.data(), B, 0, 1, B);
    CT_OK(zopt_comm_all_to_all(c, send.data(), recv.data(), B));
    CT_CHECK(check_all_to_all(recv.data(), B, 0, 1, B).empty(), "self all_to_all %zu", B);
    fill_all_gather(send.data(), B + 100, 0, B);
    CT_OK(zopt_comm_all_gather(c, send.data(), recv.data(), B));
    CT_CHECK(check_all_gather(recv.data(), B + 100, 1, B).empty(), "self all_gather %zu", B);
    CT_OK(zopt_comm_all_gather(c, recv.data(), recv.data(), B));  // in place
    CT_CHECK(check_all_gather(recv.data(), B + 100, 1, B).empty(), "self in-place all_gather %zu", B);
  }
  CT_OK(zopt_comm_barrier(c));
  CT_OK(zopt_comm_synchronize(c));
  CT_OK(zopt_comm_set_timeout(c, 5));
  CT_OK(zopt_comm_set_checks(c, 0));
  CT_CHECK(zopt_comm_count(c) == 3 * 7 + 1, "self count %llu", (unsigned long long)zopt_comm_count(c));
  zopt_comm_free(c);
  pass("self: all_to_all, all_gather (also in place), barrier, count");
}

// ---- loopback on random data ----------------------------------------------------
void test_loopback_data(int W, uint32_t flags) {
  auto comms = loopback(W, 30, flags, 1000 + (uint64_t)W);
  if (comms.empty() || !comms[0]) return;
  on_threads(W, [&](int r) {
    zopt_comm *c = comms[(size_t)r];
    CT_CHECK(zopt_comm_rank(c) == r && zopt_comm_size(c) == W, "loopback rank/size");
    uint64_t round = 0;
    for (int checks = 1; checks >= 0; --checks) {
      CT_OK(zopt_comm_set_checks(c, checks));
      for (size_t B : kSizes) {
        ++round;
        std::vector<uint8_t> send((size_t)W * B + 1), recv((size_t)W * B + 1, 0);
        fill_all_to_all(send.data(), round, r, W, B);
        CT_OK(zopt::comm_all_to_all(c, send.data(), recv.data(), B, "REDUCE_SCATTER test"));
        std::string e = check_all_to_all(recv.data(), round, r, W, B);
        CT_CHECK(e.empty(), "W=%d flags=%u rank %d B=%zu: %s", W, flags, r, B, e.c_str());
        // The send buffer is untouched.
        std::vector<uint8_t> again((size_t)W * B + 1);
        fill_all_to_all(again.data(), round, r, W, B);
        CT_CHECK(!memcmp(again.data(), send.data(), (size_t)W * B), "W=%d all_to_all changed send", W);

        ++round;
        fill_all_gather(send.data(), round, r, B);
        CT_OK(zopt::comm_all_gather(c, send.data(), recv.data(), B, "GATHER test"));
        e = check_all_gather(recv.data(), round, W, B);
        CT_CHECK(e.empty(), "W=%d flags=%u rank %d B=%zu: %s", W, flags, r, B, e.c_str());

        ++round;  // in place: this rank's piece already sits in recv
        std::vector<uint8_t> buf((size_t)W * B + 1, 0xAB);
        fill_all_gather(buf.data() + (size_t)r * B, round, r, B);
        CT_OK(zopt_comm_all_gather(c, buf.data() + (size_t)r * B, buf.data(), B));
        e = check_all_gather(buf.data(), round, W, B);
        CT_CHECK(e.empty(), "W=%d flags=%u rank %d B=%zu in place: %s", W, flags, r, B, e.c_str());
      }
      CT_OK(zopt_comm_barrier(c));
    }
    uint64_t want = 2 * (3 * (sizeof kSizes / sizeof kSizes[0]) + 1);
    CT_CHECK(zopt_comm_count(c) == want, "count %llu, want %llu", (unsigned long long)zopt_comm_count(c),
             (unsigned long long)want);
  });
  free_all(comms);
  pass("loopback W=%d%s%s: all_to_all, all_gather, in-place all_gather, %zu sizes from 0 to 65543 bytes", W,
       flags & ZOPT_LOOPBACK_DELAY ? " DELAY" : "", flags & ZOPT_LOOPBACK_POISON ? " POISON" : "",
       sizeof kSizes / sizeof kSizes[0]);
}

// POISON writes 0xFF into recv before the copy: a piece the engine forgot
// would show up; here every piece is written, and the poisoned fill of a
// failing collective is visible.
void test_loopback_poison_visible() {
  auto comms = loopback(2, 0.3, ZOPT_LOOPBACK_POISON);
  std::vector<uint8_t> recv(16, 0);
  std::vector<uint8_t> send(16, 1);
  CT_ERR(zopt_comm_all_to_all(comms[0], send.data(), recv.data(), 8), kCommErr, "timed out", "rank 1");
  bool all_ff = true;
  for (uint8_t b : recv) all_ff = all_ff && b == 0xFF;
  CT_CHECK(all_ff, "POISON did not fill recv with 0xFF");
  free_all(comms);
  pass("loopback POISON fills recv with 0xFF before the copies");
}

// ---- mismatches -------------------------------------------------------------------
void test_mismatch_op() {
  const int W = 4;
  auto comms = loopback(W, 10, ZOPT_LOOPBACK_DELAY);
  std::vector<std::string> msgs((size_t)W);
  on_threads(W, [&](int r) {
    zopt_comm *c = comms[(size_t)r];
    std::vector<uint8_t> send(W * 64, 7), recv(W * 64);
    CT_OK(zopt_comm_barrier(c));  // #1
    CT_OK(zopt_comm_all_gather(c, send.data(), recv.data(), 16));  // #2
    zopt_status st;
    if (r == 1)
      st = zopt::comm_all_gather(c, send.data(), recv.data(), 8, "NORM step 7");
    else
      st = zopt::comm_all_to_all(c, send.data(), recv.data(), 64, "REDUCE_SCATTER grad bucket 2 step 7");
    msgs[(size_t)r] = zopt_last_error();
    CT_CHECK(st == kCommErr, "rank %d: mismatch -> %d", r, (int)st);
    // Poisoned: later calls fail at once with the first error.
    double t0 = now_s();
    CT_ERR(zopt_comm_all_gather(c, send.data(), recv.data(), 16), kCommErr, "failed earlier", "#3");
    CT_ERR(zopt_comm_barrier(c), kCommErr, "failed earlier");
    CT_CHECK(now_s() - t0 < 0.5, "poisoned calls took %.3f s", now_s() - t0);
  });
  const std::string want0 =
      "loopback rank 0 of 4: collective #3 all_to_all of 64 bytes/rank (REDUCE_SCATTER grad bucket 2 step 7): "
      "rank 1 called #3 all_gather of 8 bytes (NORM step 7)";
  CT_CHECK(msgs[0] == want0, "rank 0 message:\n  %s\nwant\n  %s", msgs[0].c_str(), want0.c_str());
  CT_CHECK(msgs[1].find("rank 1 (this rank) differs: ranks 0, 2, 3 called #3 all_to_all of 64 bytes/rank "
                        "(REDUCE_SCATTER grad bucket 2 step 7)") != std::string::npos,
           "rank 1 message: %s", msgs[1].c_str());
  for (int r : {2, 3})
    CT_CHECK(msgs[(size_t)r].find("rank 1 called #3 all_gather of 8 bytes (NORM step 7)") != std::string::npos,
             "rank %d message: %s", r, msgs[(size_t)r].c_str());
  free_all(comms);
  pass("mismatched op: every rank fails naming rank 1 and both operations; later calls fail fast");
  printf("    e.g. %s\n    and  %s\n", msgs[0].c_str(), msgs[1].c_str());
}

void test_mismatch_size() {
  const int W = 3;
  auto comms = loopback(W, 10, 0);
  on_threads(W, [&](int r) {
    zopt_comm *c = comms[(size_t)r];
    size_t B = r == 2 ? 65 : 64;
    std::vector<uint8_t> send(W * 65, 1), recv(W * 65);
    std::string m = CT_ERR(zopt_comm_all_to_all(c, send.data(), recv.data(), B), kCommErr, "rank 2");
    if (r != 2)
      CT_CHECK(m.find("rank 2 called #1 all_to_all of 65 bytes/rank") != std::string::npos, "rank %d: %s", r,
               m.c_str());
    else
      CT_CHECK(m.find("rank 2 (this rank) differs: ranks 0, 1 called #1 all_to_all of 64 bytes/rank") !=
                   std::string::npos,
               "rank 2: %s", m.c_str());
  });
  free_all(comms);
  // Different `what` with the same op and size is a mismatch too.
  comms = loopback(2, 10, 0);
  on_threads(2, [&](int r) {
    uint8_t send[8] = {1}, recv[16];
    CT_ERR(zopt::comm_all_gather(comms[(size_t)r], send, recv, 8, r ? "GATHER param bucket 1" : "GATHER param bucket 0"),
           kCommErr, "rank 1");
  });
  free_all(comms);
  pass("mismatched size (and description): every rank fails naming rank 2 (rank 1)");
}

// ---- a rank that never calls, a rank that leaves -------------------------------------
void test_missing_rank() {
  const int W = 4;
  auto comms = loopback(W, 1.0, 0);
  std::mutex mu;
  std::condition_variable cv;
  int failed = 0;
  on_threads(W, [&](int r) {
    zopt_comm *c = comms[(size_t)r];
    std::vector<uint8_t> send(W * 32, 3), recv(W * 32);
    CT_OK(zopt_comm_all_to_all(c, send.data(), recv.data(), 32));  // #1, everyone
    if (r == 3) {
      // Calls #2 only after the others gave up: fails at once, naming them.
      std::unique_lock<std::mutex> lk(mu);
      cv.wait(lk, [&] { return failed == W - 1; });
      lk.unlock();
      double t0 = now_s();
      std::string m = CT_ERR(zopt_comm_all_to_all(c, send.data(), recv.data(), 32), kCommErr, "gave up on collective #2",
                             "(timed out after 1 s)");
      printf("    late rank: %s\n", m.c_str());
      CT_CHECK(now_s() - t0 < 0.5, "late rank waited %.3f s", now_s() - t0);
      return;
    }
    double t0 = now_s();
    CT_ERR(zopt_comm_all_to_all(c, send.data(), recv.data(), 32), kCommErr,
           "timed out after 1 s", "rank 3 did not call collective #2 (its last collective was #1)");
    double dt = now_s() - t0;
    CT_CHECK(dt > 0.9 && dt < 5, "rank %d failed after %.3f s (timeout 1 s)", r, dt);
    if (r == 2) printf("    rank 2: %s\n", zopt_last_error());
    std::lock_guard<std::mutex> lk(mu);
    ++failed;
    cv.notify_all();
  });
  free_all(comms);
  pass("a rank that never calls: the others fail after the 1 s timeout naming it; it then fails at once");
}

void test_rank_leaves() {
  const int W = 3;
  auto comms = loopback(W, 30, 0);
  on_threads(W, [&](int r) {
    uint8_t send[3] = {1, 2, 3}, recv[3];
    if (r == 2) {
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
      zopt_comm_free(comms[2]);  // leaves while 0 and 1 wait
      return;
    }
    double t0 = now_s();
    CT_ERR(zopt_comm_all_gather(comms[(size_t)r], send, recv, 1), kCommErr, "rank 2 left", "collective #1");
    CT_CHECK(now_s() - t0 < 2, "rank %d waited %.3f s for a rank that left", r, now_s() - t0);
  });
  zopt_comm_free(comms[0]);
  zopt_comm_free(comms[1]);
  pass("zopt_comm_free of a rank while the others wait: they fail promptly (\"rank 2 left\")");
}

// ---- API misuse -------------------------------------------------------------------
void test_misuse() {
  uint8_t a[64] = {1}, b[64];
  CT_ERR(zopt_comm_all_to_all(nullptr, a, b, 1), ZOPT_ERR_INVALID_ARGUMENT, "NULL");
  CT_ERR(zopt_comm_all_gather(nullptr, a, b, 1), ZOPT_ERR_INVALID_ARGUMENT, "NULL");
  CT_ERR(zopt_comm_barrier(nullptr), ZOPT_ERR_INVALID_ARGUMENT, "NULL");
  CT_ERR(zopt_comm_synchronize(nullptr), ZOPT_ERR_INVALID_ARGUMENT, "NULL");
  CT_ERR(zopt_comm_set_timeout(nullptr, 1), ZOPT_ERR_INVALID_ARGUMENT, "NULL");
  CT_ERR(zopt_comm_set_checks(nullptr, 1), ZOPT_ERR_INVALID_ARGUMENT, "NULL");
  CT_CHECK(zopt_comm_rank(nullptr) == -1 && zopt_comm_size(nullptr) == -1 && zopt_comm_memory(nullptr) == 0 &&
               zopt_comm_count(nullptr) == 0 && zopt_comm_name(nullptr) != nullptr,
           "queries of NULL");
  zopt_comm_free(nullptr);
  CT_ERR(zopt_comm_create_self(nullptr), ZOPT_ERR_INVALID_ARGUMENT, "out");

  zopt_comm *comms[4] = {};
  CT_ERR(zopt_comm_create_loopback(0, nullptr, comms), ZOPT_ERR_INVALID_ARGUMENT, "size 0");
  CT_ERR(zopt_comm_create_loopback(2, nullptr, nullptr), ZOPT_ERR_INVALID_ARGUMENT, "comms");
  zopt_loopback_options bad{};
  bad.flags = 8;
  CT_ERR(zopt_comm_create_loopback(2, &bad, comms), ZOPT_ERR_INVALID_ARGUMENT, "flags");
  CT_OK(zopt_comm_create_loopback(2, nullptr, comms));  // default options
  zopt_comm *c = comms[0];
  CT_ERR(zopt_comm_all_to_all(c, nullptr, b, 1), ZOPT_ERR_INVALID_ARGUMENT, "send buffer is NULL");
  CT_ERR(zopt_comm_all_gather(c, a, nullptr, 1), ZOPT_ERR_INVALID_ARGUMENT, "recv buffer is NULL");
  CT_ERR(zopt_comm_all_to_all(c, a, b, SIZE_MAX / 2 + 1), ZOPT_ERR_INVALID_ARGUMENT, "overflows");
  CT_ERR(zopt_comm_all_gather(c, a, b, SIZE_MAX / 3), ZOPT_ERR_INVALID_ARGUMENT, "overflows");
  CT_ERR(zopt_comm_all_to_all(c, a, a, 8), ZOPT_ERR_INVALID_ARGUMENT, "overlap", "never in place");
  CT_ERR(zopt_comm_all_to_all(c, a, a + 8, 8), ZOPT_ERR_INVALID_ARGUMENT, "overlap");
  CT_ERR(zopt_comm_all_gather(c, a + 8, a, 8), ZOPT_ERR_INVALID_ARGUMENT, "overlap", "rank * bytes");  // rank 0
  CT_ERR(zopt_comm_set_timeout(c, 0), ZOPT_ERR_INVALID_ARGUMENT, "> 0");
  CT_ERR(zopt_comm_set_timeout(c, -1), ZOPT_ERR_INVALID_ARGUMENT, "> 0");
  CT_ERR(zopt_comm_set_timeout(c, NAN), ZOPT_ERR_INVALID_ARGUMENT, "> 0");
  CT_ERR(zopt_comm_set_timeout(c, INFINITY), ZOPT_ERR_INVALID_ARGUMENT, "finite");
  CT_ERR(zopt_comm_set_checks(c, 2), ZOPT_ERR_INVALID_ARGUMENT, "0 or 1");
  CT_CHECK(zopt_comm_count(c) == 0, "misuse counted as collectives");
  // Misuse does not poison: both ranks still work (NULL buffers are fine for 0 bytes).
  on_threads(2, [&](int r) {
    CT_OK(zopt_comm_all_to_all(comms[r], nullptr, nullptr, 0));
    uint8_t s[2] = {(uint8_t)(r + 1), 9}, rv[4] = {};
    CT_OK(zopt_comm_all_gather(comms[r], s, rv, 2));
    CT_CHECK(rv[0] == 1 && rv[2] == 2, "after misuse: gather %u %u", rv[0], rv[2]);
  });
  zopt_comm_free(comms[0]);
  zopt_comm_free(comms[1]);

  // zopt_comm_create: the table's own checks.
  zopt_comm_ops ops{};
  ops.version = ZOPT_COMM_OPS_VERSION;
  ops.memory = ZOPT_COMM_MEM_HOST;
  ops.name = "user";
  ops.all_to_all = [](void *, const void *, void *, size_t) { return 0; };
  ops.all_gather = [](void *, const void *, void *, size_t) { return 0; };
  ops.last_error = [](void *) { return ""; };
  zopt_comm *u = nullptr;
  CT_ERR(zopt_comm_create(nullptr, nullptr, 0, 1, &u), ZOPT_ERR_INVALID_ARGUMENT, "ops is NULL");
  CT_ERR(zopt_comm_create(&ops, nullptr, 0, 1, nullptr), ZOPT_ERR_INVALID_ARGUMENT, "out is NULL");
  CT_ERR(zopt_comm_create(&ops, nullptr, 2, 2, &u), ZOPT_ERR_INVALID_ARGUMENT, "rank 2 out of range");
  CT_ERR(zopt_comm_create(&ops, nullptr, -1, 2, &u), ZOPT_ERR_INVALID_ARGUMENT, "rank -1");
  CT_ERR(zopt_comm_create(&ops, nullptr, 0, 0, &u), ZOPT_ERR_INVALID_ARGUMENT, "size 0");
  zopt_comm_ops o2 = ops;
  o2.version = 2;
  CT_ERR(zopt_comm_create(&o2, nullptr, 0, 1, &u), ZOPT_ERR_INVALID_ARGUMENT, "version is 2");
  o2 = ops;
  o2.memory = 3;
  CT_ERR(zopt_comm_create(&o2, nullptr, 0, 1, &u), ZOPT_ERR_INVALID_ARGUMENT, "memory is 3");
  o2 = ops;
  o2.all_gather = nullptr;
  CT_ERR(zopt_comm_create(&o2, nullptr, 0, 1, &u), ZOPT_ERR_INVALID_ARGUMENT, "all_gather is NULL");
  o2 = ops;
  o2.last_error = nullptr;
  CT_ERR(zopt_comm_create(&o2, nullptr, 0, 1, &u), ZOPT_ERR_INVALID_ARGUMENT, "last_error is NULL");
  CT_CHECK(u == nullptr, "out set on failure");
  CT_OK(zopt_comm_create(&ops, nullptr, 0, 1, &u));
  CT_ERR(zopt_comm_set_timeout(u, 1), ZOPT_ERR_UNSUPPORTED, "no timeout setting");
  zopt_comm_free(u);
  // A DEVICE table without exchange has no barrier.
  o2 = ops;
  o2.memory = ZOPT_COMM_MEM_DEVICE;
  CT_OK(zopt_comm_create(&o2, nullptr, 0, 2, &u));
  CT_ERR(zopt_comm_barrier(u), ZOPT_ERR_UNSUPPORTED, "no host exchange");
  CT_OK(zopt_comm_synchronize(u));  // no synchronize in the table: nothing to wait for
  zopt_comm_free(u);
  pass("API misuse: NULLs, overflow, overlap, bad timeouts/flags/tables -> INVALID_ARGUMENT, no poisoning");
}

// ---- a user table: the wrapper's signature exchange -----------------------------------
// A minimal host engine for W threads: all_gather / all_to_all through a
// shared staging area and a generation barrier (no timeouts, no checks).
struct UserHub {
  int W;
  std::mutex mu;
  std::condition_variable cv;
  int arrived = 0;
  uint64_t gen = 0;
  std::vector<const void *> sends;
  std::atomic<int> all_gathers{0}, exchanges{0}, aborts{0};
  int fail_rank = -1;  // this rank's next all_to_all fails
};
struct UserRank {
  UserHub *hub;
  int rank;
  std::string err;
};
void user_barrier(UserHub *h) {
  std::unique_lock<std::mutex> lk(h->mu);
  uint64_t g = h->gen;
  if (++h->arrived == h->W) {
    h->arrived = 0;
    h->gen++;
    h->cv.notify_all();
  } else {
    h->cv.wait(lk, [&] { return h->gen != g; });
  }
}
int user_all_gather(void *ctx, const void *send, void *recv, size_t bytes) {
  auto *u = static_cast<UserRank *>(ctx);
  UserHub *h = u->hub;
  h->all_gathers++;
  h->sends[(size_t)u->rank] = send;
  user_barrier(h);
  for (int q = 0; q < h->W; ++q) memcpy((char *)recv + (size_t)q * bytes, h->sends[(size_t)q], bytes);
  user_barrier(h);
  return ZOPT_COMM_OK;
}
int user_all_to_all(void *ctx, const void *send, void *recv, size_t bytes) {
  auto *u = static_cast<UserRank *>(ctx);
  UserHub *h = u->hub;
  if (h->fail_rank == u->rank) {
    u->err = "the user engine's link is down";
    return ZOPT_COMM_ERR_FAILED;
  }
  h->sends[(size_t)u->rank] = send;
  user_barrier(h);
  for (int q = 0; q < h->W; ++q)
    memcpy((char *)recv + (size_t)q * bytes, (const char *)h->sends[(size_t)q] + (size_t)u->rank * bytes, bytes);
  user_barrier(h);
  return ZOPT_COMM_OK;
}
int user_exchange(void *ctx, const void *send, void *recv, size_t bytes) {
  static_cast<UserRank *>(ctx)->hub->exchanges++;
  return user_all_gather(ctx, send, recv, bytes);
}

void test_user_table() {
  const int W = 3;
  for (int with_exchange = 0; with_exchange < 2; ++with_exchange) {
    UserHub hub;
    hub.W = W;
    hub.sends.resize(W);
    zopt_comm_ops ops{};
    ops.version = ZOPT_COMM_OPS_VERSION;
    ops.memory = ZOPT_COMM_MEM_HOST;
    ops.name = "user";
    ops.all_to_all = user_all_to_all;
    ops.all_gather = user_all_gather;
    ops.exchange = with_exchange ? user_exchange : nullptr;
    ops.abort = [](void *ctx) { static_cast<UserRank *>(ctx)->hub->aborts++; };
    ops.last_error = [](void *ctx) { return static_cast<UserRank *>(ctx)->err.c_str(); };
    std::vector<UserRank> ranks((size_t)W);
    std::vector<zopt_comm *> comms((size_t)W);
    for (int r = 0; r < W; ++r) {
      ranks[(size_t)r] = {&hub, r, ""};
      CT_OK(zopt_comm_create(&ops, &ranks[(size_t)r], r, W, &comms[(size_t)r]));
    }
    on_threads(W, [&](int r) {
      zopt_comm *c = comms[(size_t)r];
      std::vector<uint8_t> send(W * 100), recv(W * 100);
      fill_all_to_all(send.data(), 1, r, W, 100);
      CT_OK(zopt_comm_all_to_all(c, send.data(), recv.data(), 100));  // #1: exchange + all_to_all
      CT_CHECK(check_all_to_all(recv.data(), 1, r, W, 100).empty(), "user all_to_all");
      CT_OK(zopt_comm_set_checks(c, 0));
      CT_OK(zopt_comm_all_to_all(c, send.data(), recv.data(), 100));  // #2: no exchange
      CT_OK(zopt_comm_barrier(c));                                    // #3: always exchanges
      CT_OK(zopt_comm_set_checks(c, 1));
      // #4: rank 2 calls all_gather; the signature exchange catches it.
      zopt_status st = r == 2 ? zopt_comm_all_gather(c, send.data(), recv.data(), 4)
                              : zopt_comm_all_to_all(c, send.data(), recv.data(), 100);
      std::string m = zopt_last_error();
      CT_CHECK(st == kCommErr && m.find("rank 2") != std::string::npos && m.find("#4") != std::string::npos,
               "user table mismatch on rank %d: %d %s", r, (int)st, m.c_str());
      if (r == 0) CT_CHECK(m.find("user rank 0 of 3: collective #4 all_to_all of 100 bytes/rank (zopt_comm_all_to_all): "
                                  "rank 2 called #4 all_gather of 4 bytes (zopt_comm_all_gather)") != std::string::npos,
                           "%s", m.c_str());
    });
    int per_rank_exchanges = 3;  // #1, #3, #4
    if (with_exchange)
      CT_CHECK(hub.exchanges == W * per_rank_exchanges && hub.all_gathers == W * per_rank_exchanges,
               "exchange calls %d, all_gather calls %d", hub.exchanges.load(), hub.all_gathers.load());
    else
      CT_CHECK(hub.all_gathers == W * per_rank_exchanges, "all_gather (signature) calls %d",
               hub.all_gathers.load());
    CT_CHECK(hub.aborts == W, "abort called %d times, want %d (once per failed rank)", hub.aborts.load(), W);
    for (zopt_comm *c : comms) zopt_comm_free(c);
  }
  // An engine failure: prefixed with the collective, poisons, aborts.
  UserHub hub;
  hub.W = 1;
  hub.sends.resize(1);
  hub.fail_rank = 0;
  zopt_comm_ops ops{};
  ops.version = ZOPT_COMM_OPS_VERSION;
  ops.memory = ZOPT_COMM_MEM_HOST;
  ops.name = "user";
  ops.all_to_all = user_all_to_all;
  ops.all_gather = user_all_gather;
  ops.abort = [](void *ctx) { static_cast<UserRank *>(ctx)->hub->aborts++; };
  ops.last_error = [](void *ctx) { return static_cast<UserRank *>(ctx)->err.c_str(); };
  UserRank ur{&hub, 0, ""};
  zopt_comm *c = nullptr;
  CT_OK(zopt_comm_create(&ops, &ur, 0, 1, &c));
  uint8_t s[4] = {1, 2, 3, 4}, rv[4];
  CT_ERR(zopt::comm_all_to_all(c, s, rv, 4, "REDUCE_SCATTER grad bucket 0 step 1"), kCommErr,
         "user rank 0 of 1: collective #1 all_to_all of 4 bytes/rank (REDUCE_SCATTER grad bucket 0 step 1): "
         "the user engine's link is down");
  CT_ERR(zopt_comm_all_gather(c, s, rv, 4), kCommErr, "failed earlier", "link is down");
  CT_CHECK(hub.aborts == 1, "abort after an engine failure");
  zopt_comm_free(c);
  pass("user table: the wrapper exchanges signatures (exchange, else all_gather), off with set_checks(0), "
       "names the mismatched rank; engine failures are prefixed, poison and abort");
}

// A mismatch where every rank's signature carries kSigUnchanged (each rank
// at the start of a call that has changed nothing): every rank fails the
// call, no data moves, nothing is poisoned; the next collective works. With
// one unmarked rank it poisons as before. Loopback (its own rendezvous) and
// a user table (the wrapper's exchange over all_gather).
void test_clean_mismatch() {
  using zopt::kSigUnchanged;
  const int W = 3;
  auto comms = loopback(W, 10, ZOPT_LOOPBACK_DELAY | ZOPT_LOOPBACK_POISON);
  on_threads(W, [&](int r) {
    zopt_comm *c = comms[(size_t)r];
    std::vector<uint8_t> send(W * 64), recv(W * 64);
    if (r == 1)
      CT_ERR(zopt::comm_all_gather(c, send.data(), recv.data(), 64, "GATHER exp_avg bucket 0",
                                                          kSigUnchanged),
             kCommErr, "remains usable", "rank 1 (this rank) differs");
    else
      CT_ERR(zopt::comm_all_gather(c, send.data(), recv.data(), 10, "STEP settings and gradient mask", kSigUnchanged),
             kCommErr, "remains usable", "rank 1 called #1 all_gather of 64 bytes");
    fill_all_to_all(send.data(), 2, r, W, 64);
    CT_OK(zopt_comm_all_to_all(c, send.data(), recv.data(), 64));  // #2: still in step, right data
    CT_CHECK(check_all_to_all(recv.data(), 2, r, W, 64).empty(), "rank %d: data after a clean mismatch", r);
    // #3: rank 2 is not at the start of a call: poisoned.
    CT_ERR(zopt::comm_all_gather(c, send.data(), recv.data(), r == 1 ? 8 : 4, "X", r == 2 ? 0 : kSigUnchanged),
           kCommErr, "#3");
    CT_ERR(zopt_comm_barrier(c), kCommErr, "failed earlier");
  });
  free_all(comms);
  // The wrapper's own exchange (a user table without `exchange`).
  UserHub hub;
  hub.W = 2;
  hub.sends.resize(2);
  zopt_comm_ops ops{};
  ops.version = ZOPT_COMM_OPS_VERSION;
  ops.memory = ZOPT_COMM_MEM_HOST;
  ops.name = "user";
  ops.all_to_all = user_all_to_all;
  ops.all_gather = user_all_gather;
  ops.abort = [](void *ctx) { static_cast<UserRank *>(ctx)->hub->aborts++; };
  ops.last_error = [](void *ctx) { return static_cast<UserRank *>(ctx)->err.c_str(); };
  std::vector<UserRank> ranks(2);
  std::vector<zopt_comm *> uc(2);
  for (int r = 0; r < 2; ++r) {
    ranks[(size_t)r] = {&hub, r, ""};
    CT_OK(zopt_comm_create(&ops, &ranks[(size_t)r], r, 2, &uc[(size_t)r]));
  }
  on_threads(2, [&](int r) {
    std::vector<uint8_t> send(2 * 16), recv(2 * 16);
    CT_ERR(zopt::comm_barrier(uc[(size_t)r], r ? "state_dict()" : "SAVE identity", kSigUnchanged), kCommErr,
           "remains usable");
    fill_all_to_all(send.data(), 3, r, 2, 16);
    CT_OK(zopt_comm_all_to_all(uc[(size_t)r], send.data(), recv.data(), 16));
    CT_CHECK(check_all_to_all(recv.data(), 3, r, 2, 16).empty(), "user rank %d: data after a clean mismatch", r);
  });
  CT_CHECK(hub.aborts == 0, "a clean mismatch aborted the engine %d times", hub.aborts.load());
  for (zopt_comm *c : uc) zopt_comm_free(c);
  pass("a mismatch where every rank changed nothing yet fails every rank without poisoning (loopback, user "
       "table); with one rank mid-call it poisons");
}

void test_rank_list() {
  CT_CHECK(zopt::comm_rank_list({3}) == "rank 3", "%s", zopt::comm_rank_list({3}).c_str());
  CT_CHECK(zopt::comm_rank_list({0, 2, 3}) == "ranks 0, 2, 3", "%s", zopt::comm_rank_list({0, 2, 3}).c_str());
  CT_CHECK(zopt::comm_rank_list({0, 1, 2, 5, 7, 8, 9}) == "ranks 0-2, 5, 7-9", "%s",
           zopt::comm_rank_list({0, 1, 2, 5, 7, 8, 9}).c_str());
}

}  // namespace

int main() {
  double t0 = now_s();
  test_rank_list();
  test_self();
  for (int W : {1, 2, 3, 4, 8})
    for (uint32_t flags : {0u, (uint32_t)ZOPT_LOOPBACK_DELAY, (uint32_t)ZOPT_LOOPBACK_POISON,
                           (uint32_t)(ZOPT_LOOPBACK_DELAY | ZOPT_LOOPBACK_POISON)})
      test_loopback_data(W, flags);
  test_loopback_poison_visible();
  test_mismatch_op();
  test_mismatch_size();
  test_clean_mismatch();
  test_missing_rank();
  test_rank_leaves();
  test_misuse();
  test_user_table();
  int n = failures();
  printf("%s: %d failures in %.1f s\n", n ? "FAILED" : "OK", n, now_s() - t0);
  return n ? 1 : 0;
}
