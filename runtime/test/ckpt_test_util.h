// ckpt_test_util.h - checkpoint file helpers shared by test_checkpoint.cpp
// and ckpt_check.cpp (docs/CHECKPOINT.md): whole-file reads and writes,
// FNV-1a-64, and a format-3 file rewritten as the format-2 file an older
// runtime would have written for the same save.
#ifndef ZOPT_CKPT_TEST_UTIL_H
#define ZOPT_CKPT_TEST_UTIL_H

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

namespace ckt {

inline std::vector<unsigned char> slurp(const std::string &f) {
  std::vector<unsigned char> b;
  FILE *fp = fopen(f.c_str(), "rb");
  if (!fp) return b;
  fseek(fp, 0, SEEK_END);
  b.resize((size_t)ftell(fp));
  fseek(fp, 0, SEEK_SET);
  if (fread(b.data(), 1, b.size(), fp) != b.size()) b.clear();
  fclose(fp);
  return b;
}

inline bool spit(const std::string &f, const std::vector<unsigned char> &b) {
  FILE *fp = fopen(f.c_str(), "wb");
  if (!fp) return false;
  bool ok = fwrite(b.data(), 1, b.size(), fp) == b.size();
  return fclose(fp) == 0 && ok;
}

// FNV-1a-64 as the specification writes it (offset basis
// 14695981039346656037, prime 1099511628211), independent of the runtime's.
inline uint64_t fnv1a64(const void *data, size_t n) {
  const unsigned char *p = (const unsigned char *)data;
  uint64_t h = 14695981039346656037ull;
  for (size_t i = 0; i < n; ++i) h = (h ^ p[i]) * 1099511628211ull;
  return h;
}

// Offsets of the format-3 header (docs/CHECKPOINT.md).
constexpr size_t kIdAt = 104;         // save_id, 16 bytes, after world and rank
constexpr size_t kNumGroupsAt = 120;  // num_groups, num_tensors
constexpr size_t kReservedAt = 188;   // the u32 after the loss scaler's `dynamic`

inline uint64_t header_size(const std::vector<unsigned char> &f) {
  uint64_t h = 0;
  if (f.size() >= 24) memcpy(&h, f.data() + 16, 8);
  return h;
}

// Recomputes the header checksum (after an edit of the header).
inline void reseal(std::vector<unsigned char> &f) {
  uint64_t H = header_size(f);
  uint64_t c = fnv1a64(f.data(), (size_t)H);
  memcpy(f.data() + H, &c, 8);
}

// Byte offset of format 3's piece table (40 bytes a piece) and the number of
// pieces (the u64 before it), after the groups' and tensors' records.
inline size_t pieces_at(const std::vector<unsigned char> &f, uint64_t *n) {
  uint32_t ngroups, ntensors;
  memcpy(&ngroups, f.data() + kNumGroupsAt, 4);
  memcpy(&ntensors, f.data() + kNumGroupsAt + 4, 4);
  size_t pos = kNumGroupsAt + 8 + 8 * 8 + 8;  // num_groups/tensors, scaler (64 bytes), seed
  uint32_t nkinds;
  memcpy(&nkinds, f.data() + pos, 4);
  pos += 8 + 8 * (size_t)nkinds;
  for (uint32_t g = 0; g < ngroups; ++g) {
    uint32_t nh;
    memcpy(&nh, f.data() + pos + 8, 4);
    pos += 16 + 16 * (size_t)nh;
  }
  pos += 24 * (size_t)ntensors;
  memcpy(n, f.data() + pos, 8);
  return pos + 8;
}

// Byte offset of group g's `flags` (format 3; format 2: its pad): the
// per-group records follow the state-kind table.
inline size_t group_flags_at(const std::vector<unsigned char> &f, uint32_t g) {
  size_t pos = kNumGroupsAt + 8 + 8 * 8 + 8;  // num_groups/tensors, scaler (64 bytes), seed
  uint32_t nkinds;
  memcpy(&nkinds, f.data() + pos, 4);
  pos += 8 + 8 * (size_t)nkinds;
  for (uint32_t i = 0;; ++i) {
    uint32_t nh;
    memcpy(&nh, f.data() + pos + 8, 4);
    if (i == g) return pos + 12;
    pos += 16 + 16 * (size_t)nh;
  }
}

// The same save in format 2: version 2, no save_id (the header 16 bytes
// shorter), the group flags (which must be 0) a reserved field; the data
// stay where they were (format 2 allows padding before the first piece).
inline std::vector<unsigned char> to_format2(const std::vector<unsigned char> &v3) {
  const uint64_t H3 = header_size(v3), H2 = H3 - 16;
  std::vector<unsigned char> v2(v3.begin(), v3.begin() + kIdAt);
  v2.insert(v2.end(), v3.begin() + kIdAt + 16, v3.begin() + (long)H3);
  uint32_t two = 2;
  memcpy(v2.data() + 8, &two, 4);
  memcpy(v2.data() + 16, &H2, 8);
  v2.resize(H2 + 8);
  uint64_t c = fnv1a64(v2.data(), (size_t)H2);
  memcpy(v2.data() + H2, &c, 8);
  v2.resize(H3 + 8, 0);
  v2.insert(v2.end(), v3.begin() + (long)(H3 + 8), v3.end());
  return v2;
}

}  // namespace ckt

#endif
