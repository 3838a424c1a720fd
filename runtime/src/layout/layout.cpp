// layout/layout.cpp - the pure layout function (layout.h).
#include "layout/layout.h"

#include <algorithm>

namespace zopt {
namespace layout {

namespace {
int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }
}  // namespace

int64_t block_for(int64_t elems, int64_t align) {
  const int64_t lo = std::max(kMinBlock, align), want = elems / kBlocksPerModel;
  int64_t b = lo;
  while (b < kMaxBlock && b * 2 <= want) b *= 2;
  return b;
}

Layout make_layout(const Input &in) {
  Layout L;
  L.world = in.world < 1 ? 1 : in.world;
  L.align = in.align < 1 ? 1 : in.align;
  if (in.block > 0) {
    L.block = in.block;
  } else {
    int64_t total = 0;
    for (int64_t n : in.numel) total += n;
    L.block = block_for(total, L.align);
  }
  const int64_t quantum = (int64_t)L.world * L.block;
  L.bucket = round_up(std::max<int64_t>(in.bucket, 1), quantum);
  const size_t ntensors = in.numel.size();
  L.tensors.resize(ntensors);
  L.order.resize(in.num_groups);
  L.group_len.assign(in.num_groups, 0);
  std::vector<std::vector<int>> members(in.num_groups);
  for (size_t t = 0; t < ntensors; ++t) members[in.group[t]].push_back((int)t);
  for (int g = 0; g < in.num_groups; ++g) {
    // Reverse add order: the last tensor added (the first whose gradient
    // backward produces) comes first.
    int64_t off = 0;
    for (size_t k = members[g].size(); k-- > 0;) {
      int id = members[g][k];
      Segment &s = L.tensors[id];
      s.group = g;
      s.numel = in.numel[id];
      if (s.numel > 0) off = round_up(off, L.align);
      s.flat = off;
      off += s.numel;
      L.order[g].push_back(id);
    }
    L.group_len[g] = off;
    for (int64_t b = 0; b < off; b += L.bucket) {
      Bucket k;
      k.group = g;
      k.begin = b;
      k.len = std::min(L.bucket, off - b);
      k.padded = round_up(k.len, quantum);
      k.shard = k.padded / L.world;
      k.local_offset = L.local_elems;
      k.block_offset = L.blocks_per_rank;
      L.local_elems += k.shard;
      L.blocks_per_rank += k.shard / L.block;
      L.max_padded = std::max(L.max_padded, k.padded);
      L.buckets.push_back(k);
    }
  }
  for (Segment &s : L.tensors)
    if (s.numel > 0) s.bucket = L.bucket_of(s.group, s.flat);
  return L;
}

Layout per_block(const Layout &L, int64_t q) {
  auto up = [q](int64_t x) { return (x + q - 1) / q; };
  Layout B = L;
  B.align = std::max<int64_t>(L.align / q, 1);
  B.bucket = L.bucket / q;
  B.block = std::max<int64_t>(L.block / q, 1);
  for (Segment &s : B.tensors) {
    s.numel = up(s.numel);
    // (An empty tensor's flat is where the previous one ends, maybe inside
    // a block: rounded up, so that segment ends stay sorted for pieces().)
    s.flat = up(s.flat);
  }
  for (int64_t &n : B.group_len) n = up(n);
  for (Bucket &k : B.buckets) {
    // A bucket ends at a multiple of q, or at its group's end.
    k.len = up(k.begin + k.len) - k.begin / q;
    k.begin /= q;
    k.padded /= q;
    k.shard /= q;
    k.local_offset /= q;
  }
  B.local_elems = L.local_elems / q;
  B.max_padded = L.max_padded / q;
  return B;
}

int Layout::bucket_of(int group, int64_t flat) const {
  // Buckets are sorted by (group, begin).
  auto it = std::upper_bound(buckets.begin(), buckets.end(), std::make_pair(group, flat),
                             [](const std::pair<int, int64_t> &v, const Bucket &b) {
                               return v.first < b.group || (v.first == b.group && v.second < b.begin);
                             });
  if (it == buckets.begin()) return -1;
  --it;
  if (it->group != group || flat >= it->begin + it->len) return -1;
  return (int)(it - buckets.begin());
}

std::vector<Piece> Layout::pieces(int group, int64_t begin, int64_t end) const {
  std::vector<Piece> out;
  if (begin >= end) return out;
  const std::vector<int> &ord = order[group];
  // First tensor whose segment ends after `begin` (segments are sorted by flat).
  auto it = std::lower_bound(ord.begin(), ord.end(), begin, [&](int id, int64_t v) {
    return tensors[id].flat + tensors[id].numel <= v;
  });
  for (; it != ord.end(); ++it) {
    const Segment &s = tensors[*it];
    if (s.flat >= end) break;
    if (s.numel == 0) continue;
    int64_t a = std::max(begin, s.flat), e = std::min(end, s.flat + s.numel);
    if (a < e) out.push_back(Piece{*it, a - s.flat, e - a, a});
  }
  return out;
}

void Layout::shard_range(int b, int rank, int64_t *begin, int64_t *end) const {
  const Bucket &k = buckets[b];
  int64_t a = k.begin + (int64_t)rank * k.shard;
  int64_t e = a + k.shard;
  int64_t stop = k.begin + k.len;
  *begin = std::min(a, stop);
  *end = std::min(e, stop);
}

}  // namespace layout
}  // namespace zopt
