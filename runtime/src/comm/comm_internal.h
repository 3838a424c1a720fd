// comm_internal.h - the communicator subsystem of libzopt_runtime (not installed).
//
// runtime/src/comm/ owns everything behind zopt/comm.h: the zopt_comm wrapper
// around an engine table (validation, sequence numbers, signature checks,
// poisoning after a failure, error messages), and the built-in engines:
// self (W = 1), loopback (ranks as threads), the loader of the MPI plugin
// (the plugin itself is runtime/plugins/mpi/) and NCCL through dlopen.
// docs/COMM.md describes the behaviour.
//
// The optimizer calls comm_all_to_all / comm_all_gather / comm_barrier below
// with `what` saying what it is doing ("REDUCE_SCATTER grad bucket 2 step 7");
// `what` must be the same text on every rank (it is part of the checked
// signature: do not put the rank into it).
#ifndef ZOPT_RUNTIME_COMM_INTERNAL_H
#define ZOPT_RUNTIME_COMM_INTERNAL_H

#include "zopt/comm.h"

#include "../internal.h"

#include <cstdint>
#include <string>
#include <vector>

namespace zopt {

// The status of a failed collective.
constexpr zopt_status kCommError = ZOPT_ERR_COMM;

enum CommOp : uint32_t {
  COMM_OP_ALL_TO_ALL = 1,
  COMM_OP_ALL_GATHER = 2,
  COMM_OP_BARRIER = 3,
};
const char *comm_op_name(uint32_t op);

// What every rank exchanges before a collective (checks on). 96 bytes,
// little-endian, no pointers: the same bytes on every rank that makes the
// same call.
constexpr uint32_t kCommSignatureMagic = 0x5A434F4Du;  // "MOCZ"
constexpr size_t kCommWhatChars = 64;
struct CommSignature {
  uint32_t magic;
  uint32_t op;     // CommOp
  uint64_t seq;    // 1, 2, ... per communicator
  uint64_t bytes;  // per rank (all_to_all) / per piece (all_gather); 0 for barrier
  uint32_t rank;   // the sender (not compared: checks the engine's rank order)
  uint32_t flags;  // kSig* (not compared)
  char what[kCommWhatChars];  // the first 63 chars of `what`, NUL padded
};
static_assert(sizeof(CommSignature) == 96, "CommSignature is exchanged as 96 bytes");
// CommSignature.flags: the caller has changed nothing yet (the first
// collective of an API call, or one of a call that only reads): if the
// signatures disagree and every rank's carries this flag, every rank fails
// this collective, no data moves, and the communicator is NOT poisoned (the
// ranks stay in step: each made one exchange); otherwise it is poisoned.
constexpr uint32_t kSigUnchanged = 1u;

void comm_make_signature(CommSignature *sig, uint32_t op, uint64_t seq, size_t bytes, int rank,
                         const char *what);
// "#17 all_to_all of 4194304 bytes/rank (REDUCE_SCATTER grad bucket 2 step 7)"
std::string comm_describe(const CommSignature &sig);
// Compares the W signatures gathered on rank `rank` (sigs[q] from rank q).
// Returns "" when they all agree, else what differs, naming the ranks, e.g.
// "rank 2 called #17 all_gather of 8 bytes (NORM step 7)" (on a rank of the
// majority) or "rank 1 (this rank) differs: ranks 0, 2-3 called #17 ..." (on
// a rank outside it). The majority is the largest group of equal
// signatures (ties: the group holding the lowest rank), so every rank's
// message names the same odd ones out.
std::string comm_mismatch(const CommSignature *sigs, int size, int rank);
// "rank 3" / "ranks 0, 2-4"
std::string comm_rank_list(const std::vector<int> &ranks);

// Engines that check the signatures themselves in their own rendezvous
// (loopback): the wrapper hands them the signature with the buffers instead
// of exchanging it separately. Returns a ZOPT_COMM_* code.
// On a mismatch it sets *clean when every rank's signature carries
// kSigUnchanged (the wrapper then does not poison).
struct CommNative {
  int (*collective)(void *ctx, const CommSignature *sig, const void *send, void *recv, bool *clean);
};

// zopt_comm_create with a native hook (may be null).
zopt_status comm_create_internal(const zopt_comm_ops *ops, void *ctx, int rank, int size,
                                 const CommNative *native, zopt_comm **out);

// ---- what the optimizer calls ---------------------------------------------
// Same contracts as zopt_comm_all_to_all / _all_gather / _barrier /
// _synchronize; `what` (may be null) describes the runtime's action and
// appears in error messages and in the checked signature. `sig_flags`:
// kSigUnchanged where the caller has changed nothing yet (a mismatch there
// fails the call without poisoning the communicator).
zopt_status comm_all_to_all(zopt_comm *c, const void *send, void *recv, size_t bytes_per_rank,
                            const char *what, uint32_t sig_flags = 0);
zopt_status comm_all_gather(zopt_comm *c, const void *send, void *recv, size_t bytes,
                            const char *what, uint32_t sig_flags = 0);
zopt_status comm_barrier(zopt_comm *c, const char *what, uint32_t sig_flags = 0);
zopt_status comm_synchronize(zopt_comm *c, const char *what);

// ---- engines (one file each) -----------------------------------------------
// self.cpp, loopback.cpp, mpi.cpp and nccl.cpp implement the public
// zopt_comm_create_* functions of their engine.

}  // namespace zopt

// The communicator: an engine table plus the wrapper's state.
struct zopt_comm {
  const zopt_comm_ops *ops = nullptr;
  void *ctx = nullptr;
  int rank = 0, size = 1;
  const zopt::CommNative *native = nullptr;  // loopback
  double timeout_s = 0;  // the last zopt_comm_set_timeout; 0: the engine's default
  bool checks = true;
  uint64_t seq = 0;    // the last collective's sequence number (= collectives issued)
  bool poisoned = false;
  std::string first_error;  // the failure that poisoned it
  std::vector<zopt::CommSignature> sigs;  // W gathered signatures
};

#endif
