// checkpoint/set.h - the files of a checkpoint set and the commit of a save
// (docs/CHECKPOINT.md "A set of files, one per rank" and "Saving").
//
// A save gets an identity (128 random bits drawn on rank 0, agreed by every
// rank). Rank r of W writes `path.<r>-of-<W>.<identity in hex>`, a name no
// other save uses, so the previous set stays untouched; when every rank's
// file is written and fsync'd, ONE rename on rank 0 (of its file to `path`)
// commits the set: rank 0's file names the identity and the world size, and
// a load reads exactly the files of that identity. Files of older sets are
// removed only after the commit.
#ifndef ZOPT_RUNTIME_CHECKPOINT_SET_H
#define ZOPT_RUNTIME_CHECKPOINT_SET_H

#include "internal.h"

#include <cstdint>
#include <string>
#include <vector>

namespace zopt {
namespace ckpt {

constexpr size_t kSaveIdBytes = 16;
struct SaveId {
  unsigned char b[kSaveIdBytes] = {0};
  bool operator==(const SaveId &o) const { return memcmp(b, o.b, kSaveIdBytes) == 0; }
  bool operator!=(const SaveId &o) const { return !(*this == o); }
};
std::string hex(const SaveId &id);  // 32 lowercase hex digits

// Rank r's file of a set of W ranks: format 3 (`id` given) path.<r>-of-<W>.<hex>
// (rank 0's before the commit; after it rank 0's is `path`); format 2
// path / path.<r>-of-<W>.
std::string set_file(const std::string &path, uint32_t r, uint32_t W, const SaveId &id);
std::string v2_file(const std::string &path, uint32_t r, uint32_t W);

// Every rank's status: a failure anywhere fails everywhere, with the same
// message on every rank ("rank q: <its message>", the first failing rank's),
// so that no rank changes state alone. `sig_flags`: comm_all_gather's;
// *no_exchange (if given) is set when the exchange itself failed (the
// communicator's error is returned: this rank cannot know the others').
zopt_status agree_status(zopt_optimizer *o, zopt_status st, const char *what, uint32_t sig_flags = 0,
                         bool *no_exchange = nullptr);

// fsync of the directory holding `path` (best effort).
void fsync_dir(const std::string &path);

// Test-only fault injection: ZOPT_TEST_SAVE_FAULT=<rank>:<stage>[:<part>]
// makes that rank's save fail at one stage of the commit: `write` (writing
// its file of part <part>, default 0), `fsync` (syncing it), `rename` (rank
// 0's commit rename; other ranks have none), `die-early` (with its files
// written, before the ranks agree that all are: the rank stops answering,
// its communicator aborted as a dead process's would be), `die` (the same
// once every rank's file is durable and the ranks agreed so) or
// `after-commit` (rank 0 dies right after its commit rename, before the
// renames of a linked save's parts i > 0).
enum class Fault { kNone, kWrite, kFsync, kRename, kDieEarly, kDie, kAfterCommit };
// The fault of this rank's save; *part: the part whose file it hits (write
// and fsync).
Fault save_fault(int rank, int *part = nullptr);
// The test fault `die`/`die-early`: this rank stops answering.
zopt_status die(zopt_optimizer *o, const char *when);

// The save's identity: drawn on rank 0 and agreed by every rank, with a
// check that every rank passed the same path(s) (`key`: the path, or a
// linked save's paths joined; a collective at W > 1; its mismatch leaves
// the communicator usable: nothing was written yet). `what` names the
// collective (an export's differs from a save's).
zopt_status agree_save_id(zopt_optimizer *o, const std::string &key, SaveId *id,
                          const char *what = "SAVE identity");

// After every rank wrote and fsync'd `mine[i]` (its set_file of paths[i],
// one per part of a linked save; one for a plain save) and agreed so:
// rank 0 renames its file of part 0 to paths[0] (the commit: the one commit
// point), then those of parts i > 0 to paths[i] (not the commit: a load
// finds a file whose rename did not happen under its set name), the ranks
// agree on the outcome (on `o`, part 0), and then (committed) remove stray
// files of older sets of every path, or (not committed) remove their new
// files. A rank that cannot learn the outcome (a peer stopped answering)
// removes nothing. The same status and message on every surviving rank.
zopt_status commit(zopt_optimizer *o, const std::vector<std::string> &paths, const std::vector<std::string> &mine,
                   Fault fault, const char *fn);

// Removes (best effort) the files of other sets of `path` that this rank
// owns: `path.<q>-of-<N>[.<hex>|.tmp]` with q % W == rank (q > 0, or q = 0
// before a commit's rename) and `path.tmp` (rank 0), except `keep` (a file
// name in the same directory).
void remove_strays(const std::string &path, int rank, int W, const std::string &keep);

}  // namespace ckpt
}  // namespace zopt

#endif
