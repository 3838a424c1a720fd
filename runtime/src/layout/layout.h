// layout/layout.h - where every element of every state lives, on every rank.
//
// This subsystem owns one pure function, make_layout: from the tensor sizes
// per parameter group, the world size W, the step's `align` and the bucket
// size it decides the flat spaces, the norm block, the buckets, every
// rank's shards and the padding. The step program, the checkpoints and the
// tests all use it; nothing else decides where an element is.
// docs/DISTRIBUTED.md explains the choices.
//
//   flat space  per group, the group's tensors in reverse add order (the
//               order backward produces their gradients), each segment
//               starting at a multiple of `align` elements;
//   block       the norm block B (block_for: a power of two from the
//               model's size, 64 .. 32768 elements, at least `align`): the
//               unit of sharding and of the norm's partial sums. It depends
//               on the tensor sizes and `align` only, never on W or the
//               bucket size;
//   buckets     the flat space cut at multiples of the bucket size, itself
//               rounded up to a multiple of W * B: bucket b covers the flat
//               range [begin, begin + len) of one group; buckets never mix
//               groups. Every bucket but a group's last is a whole number
//               of blocks per rank;
//   shards      bucket b is padded at its end to `padded`, a multiple of
//               W * B, and cut into W equal shards of shard = padded / W
//               elements: rank r owns bucket-relative [r * shard,
//               (r + 1) * shard). Only a group's last bucket has padding
//               (less than one block per rank), so a rank holds less than
//               one block per group more than 1/W of the elements. Padding
//               is never read by a kernel and is zero in every buffer;
//   local       a rank's buffer of a sharded state is its shards of every
//               bucket, concatenated in bucket order (`local_offset`); a
//               full (unsharded) buffer is the same with W = 1;
//   norm blocks B elements of the flat space (bucket boundaries are
//               multiples of B, so a block never straddles one); a shard is
//               a whole number of blocks, so every block lives on one rank.
//               The global norm is the sum of the blocks' partial sums in
//               (group, flat) order: the same bits at any W and any bucket
//               size.
//   per block   a step with q8 moments (abi.h "q8 moments") lays out with
//               align >= ZOPT_Q8_BLOCK (256): every segment, bucket, shard
//               and norm block then starts at a multiple of 256 of the flat
//               space, so at a block boundary of its tensor and a q8 block
//               never straddles a shard. A PER_BLOCK state (a q8 absmax,
//               one element per 256 of the tensor) is laid out by
//               per_block(L): the same layout with every offset divided by
//               256 (counts rounded up: a tensor's last block may be
//               partial), in its own index space: the same at every W.
#ifndef ZOPT_RUNTIME_LAYOUT_H
#define ZOPT_RUNTIME_LAYOUT_H

#include <cstdint>
#include <vector>

namespace zopt {
namespace layout {

// The norm block's bounds (powers of two; the largest is a multiple of
// every `align` the compiler accepts, up to 2^15, and of the kernels'
// vector widths).
constexpr int64_t kMaxBlock = 32768;
constexpr int64_t kMinBlock = 64;
// A model of `elems` elements gets at least this many blocks (up to
// kMaxBlock per block): balanced shards at small sizes.
constexpr int64_t kBlocksPerModel = 128;
// The largest default bucket size in elements.
constexpr int64_t kDefaultBucket = int64_t(1) << 23;

// The norm block of a model of `elems` elements (the tensors' numel summed)
// and a step aligned to `align`: the largest power of two <= elems /
// kBlocksPerModel, clamped to [max(kMinBlock, align), kMaxBlock].
int64_t block_for(int64_t elems, int64_t align);

struct Input {
  // Per tensor (ids 0, 1, ... in add order): its group and element count.
  std::vector<int> group;
  std::vector<int64_t> numel;
  int num_groups = 0;
  int world = 1;
  int64_t align = 1;                // power of two
  int64_t bucket = kDefaultBucket;  // elements; rounded up to a multiple of world * block
  int64_t block = 0;                // 0: block_for(the numels summed, align)
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
  int64_t padded = 0;        // len rounded up to a multiple of world * block
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
  int64_t block = kMaxBlock;            // the norm block
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

// The layout of a state with one element per `q` elements (a q8 absmax: q
// = ZOPT_Q8_BLOCK) of a layout L whose segments, buckets and shards start
// at multiples of q (align >= q): every offset divided by q, every count
// rounded up. Element i of tensor t is at index i / q of its state.
Layout per_block(const Layout &L, int64_t q);

}  // namespace layout
}  // namespace zopt

#endif
