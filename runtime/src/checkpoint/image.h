// checkpoint/image.h - the checkpoint format's one writer and one reader,
// shared by the files of zopt_optimizer_save / _load (checkpoint.cpp) and
// the optimizer's state in memory (memory.cpp: zopt_optimizer_export_state,
// _import_state and the staged import, docs/CHECKPOINT.md "In memory").
//
// runtime/src/checkpoint/ owns the optimizer's state outside the optimizer:
// the format (docs/CHECKPOINT.md), written once (checkpoint.cpp) and read
// once (format.h/.cpp: one image parsed and checked), the set of files of a
// multi-rank save and its commit (set.h/.cpp), the file API (save.cpp:
// saving; checkpoint.cpp: loading; linked.cpp: the checkpoint of an
// optimizer of several parts, one save) and the state in memory
// (memory.cpp). It reads and writes states only
// through the backend's state access (backend/backend.h).
//
// An image is the bytes of one file of the format (docs/CHECKPOINT.md
// "Layout of a file"): write_image lays it out and hands its bytes to a
// Sink (a file, or a buffer); stage_path / stage_memory read a set of
// images (files or buffers), check everything and stage what this rank
// holds (Staged); apply changes the optimizer once every rank agreed.
#ifndef ZOPT_RUNTIME_CHECKPOINT_IMAGE_H
#define ZOPT_RUNTIME_CHECKPOINT_IMAGE_H

#include "internal.h"

#include "checkpoint/set.h"
#include "exec/exec.h"

#include <cstdint>
#include <utility>
#include <vector>

namespace zopt {
namespace ckpt {

// ---- writing ----------------------------------------------------------------

// Where write_image puts an image of `size` bytes: begin(size) first, then
// each piece's bytes at its offset and the header at offset 0 last. Bytes
// no call writes (padding between pieces) must read as zero.
class Sink {
 public:
  virtual ~Sink() = default;
  virtual zopt_status begin(uint64_t size) = 0;
  virtual zopt_status write_at(uint64_t off, const void *p, size_t n) = 0;
  // A sink in memory: its bytes (valid after begin), so that a gather can
  // land in place; NULL for a file.
  virtual unsigned char *direct() { return nullptr; }
};

// The image of the optimizer's state. whole = false: the elements this rank
// holds (world W, rank r: what zopt_optimizer_save writes into this rank's
// file); whole = true: every element of every state, world 1 and rank 0
// (at W > 1 a collective: sharded states are gathered; needs a sink with
// direct()). `id` is the save identity written into the header. `fn` names
// the API call in errors. checksums = false (ZOPT_EXPORT_NO_CHECKSUMS, an
// image in memory for the process that wrote it): every piece's checksum is
// 0 and the header's flags say so (kFlagNoChecksums); the header keeps its
// own checksum. linked: a part of a linked save (the header's kFlagLinked).
zopt_status write_image(const zopt_optimizer *o, const SaveId &id, bool whole, Sink &sink, const char *fn,
                        bool checksums = true, bool linked = false);

// ---- reading, staging, applying ---------------------------------------------

struct GroupRec {
  int64_t step_count = 0;
  uint32_t flags = 0;  // format 3 (Group::flags)
  std::vector<std::pair<uint32_t, double>> hypers;  // (zopt_hyper_kind, value)
};

// What a load changes, staged: validated completely before it is applied.
struct Staged {
  struct Dest {
    int t, si;
    int64_t start, len;  // a run this rank holds (exec::runs)
    std::vector<unsigned char> bytes;  // the state's storage dtype
  };
  std::vector<Dest> dests;
  std::vector<GroupRec> groups;  // one per optimizer group
  std::vector<int64_t> tensor_steps;
  LossScaler scaler;
  uint64_t seed = 0;
  bool has_seed = false;
  SaveId id;            // the save's identity (a format 3 file or image)
  bool has_id = false;
};

// With several ranks (a collective; nothing applied yet): every rank staged
// the same save (identity, where the files have one), step counts, group
// hyperparameters and flags, loss scaler and seed; otherwise
// ZOPT_ERR_INVALID_ARGUMENT naming the ranks that differ from rank 0 (a load
// of another checkpoint on some ranks would mix their shards). `fn` names
// the call, `what` the collective.
zopt_status agree_staged(zopt_optimizer *o, const Staged &sg, const char *fn, const char *what);
// The hash of what agree_staged compares (the staged import's agreement).
uint64_t staged_hash(const Staged &sg);

// The states a checkpoint holds: the optimizer's states, and the params
// where the runtime holds them (ZeRO-3).
bool saved_state(const zopt_optimizer *o, uint32_t s);

// Stages a load of the set of files that `path` names (zopt_optimizer_load).
// `file0` (if given) is read as rank 0's file instead of `path` (a linked
// save's part whose rename to `path` did not happen: linked.cpp); the other
// ranks' files are derived from `path` as always.
zopt_status stage_path(zopt_optimizer *o, const char *path, uint32_t flags, Staged &out,
                       const char *file0 = nullptr);
// Stages a load of n images in memory: one whole image (world 1), or
// images of one export at W ranks (each rank's at most once) that hold
// every element this rank needs (zopt_optimizer_import_state_set).
zopt_status stage_memory(zopt_optimizer *o, int n, const void *const *bufs, const size_t *sizes, uint32_t flags,
                         Staged &out);
// Writes this rank's file of the save `id` to `file` (a name no other save
// uses), fsync'd; on failure the file is removed (save.cpp). `fault`: the
// test hook's write and fsync faults; `linked`: write_image's.
zopt_status save_file(const zopt_optimizer *o, const std::string &file, const SaveId &id, Fault fault, bool linked,
                      const char *fn);
// A save of the n parts of one optimizer (n = 1: zopt_optimizer_save; n >
// 1: zopt_optimizer_save_linked, its files flagged kFlagLinked) to
// paths[i]: one identity, one commit point (docs/CHECKPOINT.md "Saving").
// The arguments checked by the caller; `fn` names it in errors.
zopt_status save_parts(zopt_optimizer *const *parts, int n, const char *const *paths, const char *fn);
// Applies a staged load on this rank (after the ranks agreed): states,
// step counts, group flags and hyperparameters, the loss scaler and the
// seed. Fails only if a GPU step's device does.
zopt_status apply(zopt_optimizer *o, Staged &sg);

}  // namespace ckpt
}  // namespace zopt

#endif
