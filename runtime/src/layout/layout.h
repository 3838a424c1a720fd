// layout/layout.h - where every element of every state lives, on every rank.
//
// This subsystem owns one pure function, make_layout: from the tensor sizes
// per parameter group, the world size W, the step's `align` and the bucket
// size it decides the flat spaces, the buckets, every rank's shards, the
// norm blocks and the padding. The step program, the checkpoints and the
// tests all use it; nothing else decides where an element is.
// docs/DISTRIBUTED.md explains the choices.
//
//   flat space  per group, the group's tensors in reverse add order (the
//               order backward produces their gradients), each segment
//               starting at a multiple of `align` elements;
//   buckets     the flat space cut at multiples of the bucket size (itself
//               a multiple of the norm block): bucket b covers the flat
//               range [begin, begin + len) of one group; buckets never mix
//               groups. Bucket boundaries do not depend on W;
//   shards      bucket b is padded at its end to `padded`, a multiple of
//               W * kNormBlock, and cut into W equal shards of
//               shard = padded / W elements: rank r owns bucket-relative
//               [r * shard, (r + 1) * shard). Padding is never read by a
//               kernel and is zero in every buffer;
//   local       a rank's buffer of a sharded state is its shards of every
//               bucket, concatenated in bucket order (`local_offset`); a
//               full (unsharded) buffer is the same with W = 1;
//   norm blocks kNormBlock elements of a bucket, bucket-relative; a shard
//               is a whole number of blocks, so every block lives on one
//               rank. The global norm is the sum of the blocks' partial
//               sums in (bucket, block) order: the same bits at any W.
#ifndef ZOPT_RUNTIME_LAYOUT_H
#define ZOPT_RUNTIME_LAYOUT_H

#include <cstdint>
#include <vector>

namespace zopt {
namespace layout {

// Elements per norm block (a power of two, a multiple of every `align`
// the compiler accepts up to 2^15, and of the kernels' vector widths).
constexpr int64_t kNormBlock = 32768;
// Default bucket size in elements (a multiple of kNormBlock).
constexpr int64_t kDefaultBucket = int64_t(1) << 23;

struct Input {
  // Per tensor (ids 0, 1, ... in add order): its group and element count.
  std::vector<int> group;
  std::vector<int64_t> numel;
  int num_groups = 0;
  int world = 1;
  int64_t align = 1;                // power of two
  int64_t bucket = kDefaultBucket;  // elements; rounded up to a multiple of kNormBlock
};

struct Segment {    // one tensor (ids count over all groups in add order)
  int group = 0;
  int64_t numel = 0;
  int64_t flat = 0; // offset of its element 0 in the group's flat space
  int bucket = -1;  // bucket holding element 0 (-1 for an empty tensor)
};

struct Bucket {
  int group = 0;
  int64_t begin = 0;         // flat offset in the group
  int64_t len = 0;           // flat elements covered (content and align gaps)
  int64_t padded = 0;        // len rounded up to a multiple of world * kNormBlock
  int64_t shard = 0;         // padded / world: elements per rank
  int64_t local_offset = 0;  // of this bucket's shard in a rank's local buffer
  int64_t block_offset = 0;  // of this bucket's first block in a rank's partials
};

// A contiguous run of one tensor's elements inside a flat range.
struct Piece {
  int tensor;
  int64_t start;  // element index in the tensor
  int64_t len;
  int64_t flat;   // flat offset of element `start` in the group
};

struct Layout {
  int world = 1;
  int64_t align = 1, bucket = 0;
  std::vector<Segment> tensors;
  std::vector<int64_t> group_len;       // flat length of each group
  std::vector<std::vector<int>> order;  // per group: tensor ids in flat order
  std::vector<Bucket> buckets;          // in (group, begin) order
  int64_t local_elems = 0;              // of a rank's buffer of a sharded state
  int64_t blocks_per_rank = 0;          // norm partials a rank computes
  int64_t max_padded = 0;               // largest bucket, padded

  // The tensor pieces inside flat range [begin, end) of `group`, in flat
  // order (align gaps and padding have none).
  std::vector<Piece> pieces(int group, int64_t begin, int64_t end) const;
  // Rank r's shard of bucket b as a flat range [begin, end) (clipped to the
  // bucket's content; may be empty).
  void shard_range(int b, int rank, int64_t *begin, int64_t *end) const;
  // Local index (in a rank's buffer of a sharded state) of flat offset
  // `flat` of bucket b, which must lie in `rank`'s shard.
  int64_t local_index(int b, int rank, int64_t flat) const {
    const Bucket &k = buckets[b];
    return k.local_offset + (flat - k.begin) - (int64_t)rank * k.shard;
  }
  // The bucket holding flat offset `flat` of `group` (binary search).
  int bucket_of(int group, int64_t flat) const;
  // The rank owning flat offset `flat` of bucket b.
  int owner(int b, int64_t flat) const { return (int)((flat - buckets[b].begin) / buckets[b].shard); }
};

// The pure layout function. Never fails for valid input (world >= 1, align
// a power of two, numel >= 0); the caller checks sizes against memory.
Layout make_layout(const Input &in);

}  // namespace layout
}  // namespace zopt

#endif
