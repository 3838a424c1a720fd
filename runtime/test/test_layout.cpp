// Property test of the layout function (runtime/src/layout): thousands of
// random models (empty tensors, tensors smaller than W, sizes that divide
// nothing, several groups and buckets, W > numel) and the properties the
// step, the collectives and the checkpoints rely on:
//   - every element of every tensor is owned by exactly one rank, once;
//   - a bucket's shards are equal, a whole number of norm blocks, and its
//     padding is at its end; pieces never cover padding or align gaps;
//   - segments start at multiples of align; each rank's local buffer is its
//     shards in bucket order, with every local index in range and distinct;
//   - the flat space, the buckets and the norm blocks' contents do not
//     depend on W (the global norm is the same bits at any W).
#include "layout/layout.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

using namespace zopt::layout;

static int failures = 0;
#define REQUIRE(cond, ...)                                   \
  do {                                                       \
    if (!(cond)) {                                           \
      if (failures++ < 20) {                                 \
        fprintf(stderr, "%s:%d: %s: ", __FILE__, __LINE__, #cond); \
        fprintf(stderr, __VA_ARGS__);                        \
        fprintf(stderr, "\n");                               \
      }                                                      \
    }                                                        \
  } while (0)

struct Run {
  int tensor;
  int64_t start, len;
  int rank;
};

int main() {
  std::mt19937_64 rng(20261122);
  const int kCases = 3000;
  int64_t elements = 0;
  for (int c = 0; c < kCases; ++c) {
    Input in;
    in.num_groups = 1 + (int)(rng() % 3);
    int T = (int)(rng() % 12);
    for (int t = 0; t < T; ++t) {
      in.group.push_back((int)(rng() % in.num_groups));
      int64_t n;
      switch (rng() % 6) {
        case 0: n = 0; break;                         // empty
        case 1: n = 1 + (int64_t)(rng() % 7); break;  // smaller than W
        case 2: n = (int64_t)(rng() % 100000); break;
        case 3: n = kNormBlock * (1 + (int64_t)(rng() % 3)); break;
        case 4: n = kNormBlock * (1 + (int64_t)(rng() % 3)) + 1; break;
        default: n = (int64_t)(rng() % 300000); break;
      }
      in.numel.push_back(n);
    }
    in.align = int64_t(1) << (rng() % 8);
    in.bucket = (rng() % 2) ? kNormBlock * (1 + (int64_t)(rng() % 4)) : 1 + (int64_t)(rng() % 200000);
    in.world = 1;
    const Layout L1 = make_layout(in);
    for (int world : {1, 2, 3, 4, 7, 8, 64}) {
      in.world = world;
      const Layout L = make_layout(in);
      REQUIRE(L.bucket % kNormBlock == 0, "bucket %lld", (long long)L.bucket);
      // Independent of W: flat space and buckets.
      REQUIRE(L.group_len == L1.group_len, "case %d W %d: group lengths depend on W", c, world);
      REQUIRE(L.buckets.size() == L1.buckets.size(), "case %d W %d: bucket count depends on W", c, world);
      for (size_t t = 0; t < L.tensors.size(); ++t) {
        REQUIRE(L.tensors[t].flat == L1.tensors[t].flat, "case %d: tensor %zu moved with W", c, t);
        REQUIRE(L.tensors[t].numel == 0 || L.tensors[t].flat % in.align == 0, "case %d: unaligned segment", c);
      }
      // Segments of a group do not overlap and stay inside it.
      for (int g = 0; g < in.num_groups; ++g) {
        int64_t end = 0;
        for (int id : L.order[g]) {
          const Segment &s = L.tensors[id];
          REQUIRE(s.group == g && s.flat >= end, "case %d: segments overlap", c);
          end = s.flat + s.numel;
        }
        REQUIRE(end == L.group_len[g], "case %d: group length", c);
      }
      int64_t local = 0, blocks = 0;
      std::vector<Run> runs;
      for (int b = 0; b < (int)L.buckets.size(); ++b) {
        const Bucket &k = L.buckets[b];
        const Bucket &k1 = L1.buckets[b];
        REQUIRE(k.begin == k1.begin && k.len == k1.len && k.group == k1.group, "case %d: bucket %d depends on W", c, b);
        REQUIRE(k.len > 0 && k.len <= L.bucket && k.begin % L.bucket == 0, "case %d: bucket %d bounds", c, b);
        REQUIRE(k.padded >= k.len && k.padded % ((int64_t)world * kNormBlock) == 0 &&
                    k.padded - k.len < (int64_t)world * kNormBlock,
                "case %d: bucket %d padding %lld of %lld", c, b, (long long)k.padded, (long long)k.len);
        REQUIRE(k.shard * world == k.padded && k.shard % kNormBlock == 0, "case %d: shards unequal", c);
        REQUIRE(k.local_offset == local && k.block_offset == blocks, "case %d: local buffer not in bucket order", c);
        local += k.shard;
        blocks += k.shard / kNormBlock;
        for (int r = 0; r < world; ++r) {
          int64_t a, e;
          L.shard_range(b, r, &a, &e);
          REQUIRE(a <= e && a >= k.begin && e <= k.begin + k.len, "case %d: shard range", c);
          int64_t prev_local = -1;
          for (const Piece &p : L.pieces(k.group, a, e)) {
            const Segment &s = L.tensors[p.tensor];
            REQUIRE(p.len > 0 && p.flat == s.flat + p.start && p.start + p.len <= s.numel && p.flat >= a &&
                        p.flat + p.len <= e,
                    "case %d: piece outside its tensor or shard", c);
            REQUIRE(L.owner(b, p.flat) == r && L.owner(b, p.flat + p.len - 1) == r, "case %d: owner", c);
            int64_t li = L.local_index(b, r, p.flat);
            REQUIRE(li > prev_local && li >= k.local_offset && li + p.len <= k.local_offset + k.shard,
                    "case %d: local index %lld out of the shard", c, (long long)li);
            prev_local = li + p.len - 1;
            runs.push_back(Run{p.tensor, p.start, p.len, r});
          }
          // Norm blocks: whole blocks per shard; their contents match W = 1's.
          for (int64_t j = 0; j < k.shard / kNormBlock; ++j) {
            int64_t fa = k.begin + (int64_t)r * k.shard + j * kNormBlock;
            int64_t id = (fa - k.begin) / kNormBlock;
            auto pw = L.pieces(k.group, fa, std::min(fa + kNormBlock, k.begin + k.len));
            int64_t fa1 = k1.begin + id * kNormBlock;
            auto p1 = L1.pieces(k1.group, fa1, std::min(fa1 + kNormBlock, k1.begin + k1.len));
            bool same = pw.size() == p1.size();
            for (size_t i = 0; same && i < pw.size(); ++i)
              same = pw[i].tensor == p1[i].tensor && pw[i].start == p1[i].start && pw[i].len == p1[i].len;
            REQUIRE(same, "case %d W %d: norm block %lld of bucket %d differs from W = 1's", c, world, (long long)id, b);
          }
        }
      }
      REQUIRE(local == L.local_elems && blocks == L.blocks_per_rank, "case %d: local size", c);
      // Every element of every tensor exactly once.
      std::sort(runs.begin(), runs.end(), [](const Run &x, const Run &y) {
        return x.tensor != y.tensor ? x.tensor < y.tensor : x.start < y.start;
      });
      std::vector<int64_t> covered(in.numel.size(), 0);
      for (size_t i = 0; i < runs.size(); ++i) {
        const Run &r = runs[i];
        REQUIRE(r.start == covered[r.tensor], "case %d W %d: tensor %d covered up to %lld, next run at %lld", c, world,
                r.tensor, (long long)covered[r.tensor], (long long)r.start);
        covered[r.tensor] = r.start + r.len;
      }
      for (size_t t = 0; t < in.numel.size(); ++t) {
        REQUIRE(covered[t] == in.numel[t], "case %d W %d: tensor %zu: %lld of %lld elements owned", c, world, t,
                (long long)covered[t], (long long)in.numel[t]);
        elements += in.numel[t];
      }
    }
  }
  if (failures) {
    fprintf(stderr, "test_layout: %d failure(s)\n", failures);
    return 1;
  }
  printf("test_layout: %d random models x 7 world sizes, %lld elements: every element owned once, shards equal "
         "and whole blocks, padding at bucket ends, norm blocks independent of W\n",
         kCases, (long long)elements);
  return 0;
}
