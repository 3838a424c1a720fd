// test_comm_mpi.cpp - the `mpi` communicator (the plugin libzopt_comm_mpi.so)
// under mpirun -np 2/3/4. Every rank runs this program:
//
//   zopt_test_comm_mpi plugin   zopt_comm_create_mpi(NULL): the plugin
//                               initializes MPI and finalizes it at free
//   zopt_test_comm_mpi user     the test initializes MPI itself and passes
//                               MPI_COMM_WORLD and a split communicator; a
//                               rank that never calls (timeout 1 s)
//
// Both check all_to_all / all_gather (also in place) on random data of
// several sizes (ZOPT_COMM_MPI_CHUNK_BYTES=1000 in the environment makes the
// larger ones take the chunked path), barriers, and a deliberate mismatch:
// rank 1 calls all_gather where the others call all_to_all; every rank must
// report an error naming rank 1. Exit status 0 when every check passed.
#include "comm_test_util.h"

#include <mpi.h>

#include <cstdlib>
#include <string>
#include <vector>

using namespace ct;

namespace {

constexpr zopt_status kCommErr = ZOPT_ERR_COMM;
const size_t kSizes[] = {0, 1, 3, 17, 999, 1000, 1001, 4093, 65536 + 7};

void data_round(zopt_comm *c, uint64_t round0) {
  int r = zopt_comm_rank(c), W = zopt_comm_size(c);
  uint64_t round = round0;
  for (size_t B : kSizes) {
    std::vector<uint8_t> send((size_t)W * B + 1), recv((size_t)W * B + 1, 0);
    fill_all_to_all(send.data(), ++round, r, W, B);
    CT_OK(zopt_comm_all_to_all(c, send.data(), recv.data(), B));
    std::string e = check_all_to_all(recv.data(), round, r, W, B);
    CT_CHECK(e.empty(), "W=%d B=%zu: %s", W, B, e.c_str());
    fill_all_gather(send.data(), ++round, r, B);
    CT_OK(zopt_comm_all_gather(c, send.data(), recv.data(), B));
    e = check_all_gather(recv.data(), round, W, B);
    CT_CHECK(e.empty(), "W=%d B=%zu: %s", W, B, e.c_str());
    std::vector<uint8_t> buf((size_t)W * B + 1, 0xAB);  // in place
    fill_all_gather(buf.data() + (size_t)r * B, ++round, r, B);
    CT_OK(zopt_comm_all_gather(c, buf.data() + (size_t)r * B, buf.data(), B));
    e = check_all_gather(buf.data(), round, W, B);
    CT_CHECK(e.empty(), "W=%d B=%zu in place: %s", W, B, e.c_str());
  }
  CT_OK(zopt_comm_barrier(c));
}

void mismatch(zopt_comm *c) {
  int r = zopt_comm_rank(c), W = zopt_comm_size(c);
  std::vector<uint8_t> send((size_t)W * 64, 5), recv((size_t)W * 64);
  zopt_status st = r == 1 ? zopt_comm_all_gather(c, send.data(), recv.data(), 8)
                          : zopt_comm_all_to_all(c, send.data(), recv.data(), 64);
  std::string m = zopt_last_error();
  CT_CHECK(st == kCommErr, "mismatch -> %d: %s", (int)st, m.c_str());
  const char *want = r == 1 ? "rank 1 (this rank) differs" : "rank 1 called #";
  CT_CHECK(m.find(want) != std::string::npos && m.find("all_gather of 8 bytes") != std::string::npos &&
               m.find("all_to_all of 64 bytes/rank") != std::string::npos,
           "mismatch message lacks \"%s\": %s", want, m.c_str());
  if (r == 0) printf("rank 0: mismatch reported as: %s\n", m.c_str());
  CT_ERR(zopt_comm_barrier(c), kCommErr, "failed earlier");
}

int run_plugin() {
  zopt_comm *c = nullptr;
  CT_OK(zopt_comm_create_mpi(nullptr, &c));
  if (!c) return 1;
  int r = zopt_comm_rank(c), W = zopt_comm_size(c);
  prefix() = "rank " + std::to_string(r) + ": ";
  CT_CHECK(!strcmp(zopt_comm_name(c), "mpi") && zopt_comm_memory(c) == ZOPT_COMM_MEM_HOST, "name/memory");
  CT_OK(zopt_comm_set_timeout(c, 30));
  data_round(c, 100);
  CT_OK(zopt_comm_set_checks(c, 0));
  data_round(c, 200);  // the same without the signature exchange
  CT_OK(zopt_comm_set_checks(c, 1));
  uint64_t want = 2 * (3 * (sizeof kSizes / sizeof kSizes[0]) + 1);
  CT_CHECK(zopt_comm_count(c) == want, "count %llu want %llu", (unsigned long long)zopt_comm_count(c),
           (unsigned long long)want);
  if (W > 1) mismatch(c);
  zopt_comm_free(c);  // finalizes MPI (the plugin initialized it)
  int finalized = 0;
  MPI_Finalized(&finalized);
  CT_CHECK(finalized, "MPI not finalized by zopt_comm_free of the last communicator it initialized for");
  if (!failures()) pass("mpi (plugin-initialized) W=%d: collectives on random data, mismatch names rank 1", W);
  return failures() ? 1 : 0;
}

int run_user() {
  int provided = 0;
  MPI_Init_thread(nullptr, nullptr, MPI_THREAD_SERIALIZED, &provided);
  int r = 0, W = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  MPI_Comm_size(MPI_COMM_WORLD, &W);
  prefix() = "rank " + std::to_string(r) + ": ";
  MPI_Comm world = MPI_COMM_WORLD;
  zopt_comm *c = nullptr;
  CT_OK(zopt_comm_create_mpi(&world, &c));
  if (!c) return 1;
  CT_CHECK(zopt_comm_rank(c) == r && zopt_comm_size(c) == W, "rank/size");
  data_round(c, 300);

  // A split communicator: even and odd ranks.
  MPI_Comm half;
  MPI_Comm_split(MPI_COMM_WORLD, r % 2, r, &half);
  zopt_comm *h = nullptr;
  CT_OK(zopt_comm_create_mpi(&half, &h));
  if (h) {
    CT_CHECK(zopt_comm_rank(h) == r / 2 && zopt_comm_size(h) == (W - r % 2 + 1) / 2, "split rank/size %d/%d",
             zopt_comm_rank(h), zopt_comm_size(h));
    data_round(h, 400 + (uint64_t)(r % 2) * 1000);
    int world_ranks[2] = {r, -1};
    std::vector<int> all((size_t)zopt_comm_size(h));
    CT_OK(zopt_comm_all_gather(h, world_ranks, all.data(), sizeof(int)));
    for (size_t i = 0; i < all.size(); ++i)
      CT_CHECK(all[i] == (int)(2 * i) + r % 2, "split gather[%zu] = %d", i, all[i]);
    zopt_comm_free(h);
  }
  MPI_Comm_free(&half);

  // A rank that never calls: the others fail after the timeout naming it.
  if (W > 1) {
    CT_OK(zopt_comm_set_timeout(c, 1.0));
    std::vector<uint8_t> send((size_t)W * 16, 1), recv((size_t)W * 16);
    if (r != W - 1) {
      double t0 = now_s();
      std::string m = CT_ERR(zopt_comm_all_to_all(c, send.data(), recv.data(), 16), kCommErr, "timed out after 1 s",
                             "rank " + std::to_string(W - 1) + " did not call it");
      double dt = now_s() - t0;
      CT_CHECK(dt > 0.9 && dt < 5, "failed after %.2f s (timeout 1 s)", dt);
      if (r == 0) printf("rank 0: missing rank reported as: %s\n", m.c_str());
      CT_ERR(zopt_comm_all_to_all(c, send.data(), recv.data(), 16), kCommErr, "failed earlier");
    }
    MPI_Barrier(MPI_COMM_WORLD);  // the last rank waits here until the others gave up
  }
  zopt_comm_free(c);
  int finalized = 0;
  MPI_Finalized(&finalized);
  CT_CHECK(!finalized, "zopt finalized an MPI it did not initialize");

  // And the mismatch, on a fresh communicator.
  if (W > 1) {
    CT_OK(zopt_comm_create_mpi(&world, &c));
    if (c) {
      mismatch(c);
      zopt_comm_free(c);
    }
  }
  int bad = failures(), any = 0;
  MPI_Allreduce(&bad, &any, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
  MPI_Finalize();
  if (!bad) pass("mpi (user MPI_COMM_WORLD and a split communicator) W=%d: collectives, missing rank, mismatch", W);
  return any ? 1 : 0;
}

}  // namespace

int main(int argc, char **argv) {
  std::string mode = argc > 1 ? argv[1] : "";
  if (mode == "plugin") return run_plugin();
  if (mode == "user") return run_user();
  fprintf(stderr, "usage: %s plugin|user (under mpirun)\n", argv[0]);
  return 2;
}
