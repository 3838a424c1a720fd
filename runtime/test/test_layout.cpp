// Property test of the layout function (runtime/src/layout): thousands of
// random models (empty tensors, tensors smaller than W, sizes that divide
// nothing, several groups and buckets, bucket sizes from 1 element, W >
// numel) and the properties the step, the collectives and the checkpoints
// rely on:
//   - every element of every tensor is owned by exactly one rank, once;
//   - a bucket's shards are equal and a whole number of norm blocks; only a
//     group's last bucket is padded, at its end; pieces never cover padding
//     or align gaps;
//   - every rank holds less than one block per group more than 1/W of the
//     flat elements (any bucket size shards);
//   - segments start at multiples of align; each rank's local buffer is its
//     shards in bucket order, with every local index in range and distinct;
//   - the flat space, the norm block and the norm blocks' contents, in
//     order, do not depend on W or the bucket size (the global norm is the
//     same bits at any W).
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
        case 3: n = kMaxBlock * (1 + (int64_t)(rng() % 3)); break;
        case 4: n = kMaxBlock * (1 + (int64_t)(rng() % 3)) + 1; break;
        default: n = (int64_t)(rng() % 300000); break;
      }
      in.numel.push_back(n);
    }
    in.align = int64_t(1) << (rng() % 8);
    if (rng() % 4 == 0) in.align = 256 << (rng() % 2);  // a step with q8 moments (at least 256)
    switch (rng() % 3) {
      case 0: in.bucket = kMaxBlock * (1 + (int64_t)(rng() % 4)); break;
      case 1: in.bucket = 1 + (int64_t)(rng() % 200); break;  // below any block
      default: in.bucket = 1 + (int64_t)(rng() % 200000); break;
    }
    in.world = 1;
    const Layout L1 = make_layout(in);
    int64_t total = 0;
    for (int64_t n : in.numel) total += n;
    const int64_t B = L1.block;
    REQUIRE(B == block_for(total, in.align) && (B & (B - 1)) == 0 && B % in.align == 0 && B >= kMinBlock &&
                B <= kMaxBlock && (B == std::max(kMinBlock, in.align) || B * kBlocksPerModel <= total),
            "case %d: block %lld for %lld elements", c, (long long)B, (long long)total);
    // The norm blocks in order (per group, flat order): their pieces.
    auto blocks_of = [](const Layout &L) {
      std::vector<std::vector<Piece>> out;
      for (const Bucket &k : L.buckets)
        for (int64_t j = 0; j * L.block < k.len; ++j) {
          const int64_t fa = k.begin + j * L.block;
          out.push_back(L.pieces(k.group, fa, std::min(fa + L.block, k.begin + k.len)));
        }
      return out;
    };
    const auto blocks1 = blocks_of(L1);
    for (int world : {1, 2, 3, 4, 7, 8, 64}) {
      in.world = world;
      const Layout L = make_layout(in);
      const int64_t quantum = (int64_t)world * B;
      REQUIRE(L.block == B, "case %d W %d: the block depends on W", c, world);
      REQUIRE(L.bucket % quantum == 0 && L.bucket >= in.bucket && L.bucket - in.bucket < quantum, "bucket %lld",
              (long long)L.bucket);
      // Independent of W: the flat space and the norm blocks.
      REQUIRE(L.group_len == L1.group_len, "case %d W %d: group lengths depend on W", c, world);
      for (size_t t = 0; t < L.tensors.size(); ++t) {
        REQUIRE(L.tensors[t].flat == L1.tensors[t].flat, "case %d: tensor %zu moved with W", c, t);
        REQUIRE(L.tensors[t].numel == 0 || L.tensors[t].flat % in.align == 0, "case %d: unaligned segment", c);
      }
      {
        const auto bw = blocks_of(L);
        bool same = bw.size() == blocks1.size();
        for (size_t i = 0; same && i < bw.size(); ++i) {
          same = bw[i].size() == blocks1[i].size();
          for (size_t j = 0; same && j < bw[i].size(); ++j)
            same = bw[i][j].tensor == blocks1[i][j].tensor && bw[i][j].start == blocks1[i][j].start &&
                   bw[i][j].len == blocks1[i][j].len;
        }
        REQUIRE(same, "case %d W %d: the norm blocks differ from W = 1's", c, world);
      }
      // Segments of a group do not overlap and stay inside it.
      int groups_used = 0;
      int64_t flat_total = 0;
      for (int g = 0; g < in.num_groups; ++g) {
        int64_t end = 0;
        for (int id : L.order[g]) {
          const Segment &s = L.tensors[id];
          REQUIRE(s.group == g && s.flat >= end, "case %d: segments overlap", c);
          end = s.flat + s.numel;
        }
        REQUIRE(end == L.group_len[g], "case %d: group length", c);
        groups_used += end > 0;
        flat_total += end;
      }
      int64_t local = 0, blocks = 0;
      std::vector<Run> runs;
      for (int b = 0; b < (int)L.buckets.size(); ++b) {
        const Bucket &k = L.buckets[b];
        const bool last = b + 1 == (int)L.buckets.size() || L.buckets[b + 1].group != k.group;
        REQUIRE(k.len > 0 && k.len <= L.bucket && k.begin % L.bucket == 0 &&
                    (last ? k.begin + k.len == L.group_len[k.group] : k.len == L.bucket),
                "case %d: bucket %d bounds", c, b);
        REQUIRE(k.padded >= k.len && k.padded % quantum == 0 && k.padded - k.len < quantum &&
                    (last || k.padded == k.len),
                "case %d: bucket %d padding %lld of %lld", c, b, (long long)k.padded, (long long)k.len);
        REQUIRE(k.shard * world == k.padded && k.shard % B == 0, "case %d: shards unequal", c);
        REQUIRE(k.local_offset == local && k.block_offset == blocks, "case %d: local buffer not in bucket order", c);
        local += k.shard;
        blocks += k.shard / B;
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
        }
      }
      // Balance: a rank holds 1/W of the flat elements plus less than one
      // block per (non-empty) group.
      REQUIRE(local * world >= flat_total && local * world < flat_total + quantum * groups_used + (flat_total == 0),
              "case %d W %d: a rank holds %lld of %lld elements (block %lld, %d groups)", c, world, (long long)local,
              (long long)flat_total, (long long)B, groups_used);
      REQUIRE(local == L.local_elems && blocks == L.blocks_per_rank, "case %d: local size", c);
      // q8 moments (align >= 256): every shard piece starts at a block
      // boundary of its tensor, and per_block's layout holds each block of
      // each tensor once, where the piece's first element's index / 256 says.
      if (in.align >= 256) {
        const Layout Lb = per_block(L, 256);
        REQUIRE(Lb.local_elems * 256 == L.local_elems && Lb.tensors.size() == L.tensors.size(),
                "case %d W %d: per-block local size", c, world);
        std::vector<int64_t> blocks_seen(in.numel.size(), 0);
        for (int b = 0; b < (int)L.buckets.size(); ++b)
          for (int r = 0; r < world; ++r) {
            int64_t a, e, ab, eb;
            L.shard_range(b, r, &a, &e);
            Lb.shard_range(b, r, &ab, &eb);
            const std::vector<Piece> ps = L.pieces(L.buckets[b].group, a, e);
            const std::vector<Piece> pb = Lb.pieces(Lb.buckets[b].group, ab, eb);
            REQUIRE(ps.size() == pb.size(), "case %d W %d: per-block pieces", c, world);
            for (size_t i = 0; i < ps.size() && i < pb.size(); ++i) {
              const Piece &p = ps[i], &q = pb[i];
              const int64_t b0 = p.start / 256, b1 = (p.start + p.len + 255) / 256;
              REQUIRE(p.start % 256 == 0 && p.flat % 256 == 0 && q.tensor == p.tensor && q.start == b0 &&
                          q.len == b1 - b0 && Lb.local_index(b, r, q.flat) == L.local_index(b, r, p.flat) / 256,
                      "case %d W %d: tensor %d's piece at %lld is not block %lld of the per-block layout", c, world,
                      p.tensor, (long long)p.start, (long long)b0);
              blocks_seen[p.tensor] += q.len;
            }
          }
        for (size_t t = 0; t < in.numel.size(); ++t)
          REQUIRE(blocks_seen[t] == (in.numel[t] + 255) / 256, "case %d W %d: tensor %zu has %lld blocks held", c,
                  world, t, (long long)blocks_seen[t]);
      }
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
         "and whole blocks, within one block per group of 1/W at any bucket size, padding at the end of a group's "
         "last bucket, norm blocks independent of W; with align >= 256 shards on q8 block boundaries and the per-block "
         "layout holding every block once\n",
         kCases, (long long)elements);
  return 0;
}
