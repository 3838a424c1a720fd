// checkpoint/format.h - the checkpoint format's reader (docs/CHECKPOINT.md
// "Layout of a file"): one file's image, from a file or from memory, parsed
// and checked into its in-memory form (format.cpp). checkpoint.cpp stages
// and applies sets of them and holds the writer (image.h).
#ifndef ZOPT_RUNTIME_CHECKPOINT_FORMAT_H
#define ZOPT_RUNTIME_CHECKPOINT_FORMAT_H

#include "internal.h"

#include "checkpoint/image.h"
#include "checkpoint/set.h"

#include <unistd.h>

#include <cstdint>
#include <string>
#include <vector>

namespace zopt {
namespace ckpt {

inline constexpr char kMagic2[8] = {'Z', 'O', 'P', 'T', 'C', 'K', 'P', '2'};
inline constexpr char kMagic1[8] = {'Z', 'O', 'P', 'T', 'C', 'K', 'P', '1'};
inline constexpr uint32_t kVersion = 3;                // written; 2 is still read
inline constexpr uint32_t kGroupFlagsKnown = 1u;       // bit 0: maximize (Group::flags)
// Header flags, bit 0: the pieces carry no checksum (ZOPT_EXPORT_NO_CHECKSUMS);
// read only from an image in memory, never from a file.
inline constexpr uint32_t kFlagNoChecksums = 1u;
// Header flags, bit 1: a file of a linked save (zopt_optimizer_save_linked):
// every part of that save has this file's identity (format 3 only).
inline constexpr uint32_t kFlagLinked = 2u;
inline constexpr uint64_t kFnvBasisV1 = 1469598103934665603ull;  // format 1's (wrong) basis
inline constexpr size_t kDataAlign = 64;
inline constexpr uint32_t kMaxRanks = 1u << 20;

// ---- in-memory form of one file -------------------------------------------

struct TensorRec {
  uint32_t group = 0;
  int64_t numel = 0, steps = 0;
};
struct KindRec {
  uint32_t kind, dtype;
};
struct PieceRec {
  uint32_t kind_index, tensor;
  int64_t start, len;
  uint64_t offset, fnv;
};
struct File {
  std::string path;
  uint32_t version = 0, world = 1, rank = 0;
  bool checksums = true;  // false: kFlagNoChecksums (an image in memory)
  bool linked = false;    // kFlagLinked: a part of a linked save
  SaveId id;  // format 3
  uint64_t desc_sum = 0;
  char name[ZOPT_NAME_LEN + 1] = {0};
  LossScaler scaler;
  uint64_t seed = 0;
  bool has_seed = false;
  std::vector<GroupRec> groups;
  std::vector<TensorRec> tensors;
  std::vector<KindRec> kinds;
  std::vector<PieceRec> pieces;
  uint64_t size = 0;
  // Format 1 keeps its data in memory (it was read whole to check it).
  std::vector<unsigned char> v1_data;
  int fd = -1;
  const unsigned char *mem = nullptr;  // an image in memory (size bytes), else the file fd
  ~File() {
    if (fd >= 0) ::close(fd);
  }
};

// ZOPT_ERR_CHECKPOINT "checkpoint 'PATH': <message>".
zopt_status ck_fail(const std::string &path, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
// n bytes at offset off of the file's image (on disk or in memory).
bool read_at(const File &f, void *p, size_t n, uint64_t off);
// A file's header, checked (an image in memory: f.mem and f.size set,
// `path` its label; else the file `path` is opened). Format 1 stops after
// its magic: read_v1 reads the rest.
zopt_status read_header(File &f, const std::string &path);
// Format 1 (ABI 1 runtimes; one rank, whole tensors, a whole-file FNV with
// the old offset basis): read whole, checked, turned into pieces.
zopt_status read_v1(File &f);

}  // namespace ckpt
}  // namespace zopt

#endif
