/*===- zopt/comm.h - communicators: the collectives of multi-rank steps -*- C -*-===*
 *
 * A communicator moves bytes between the W ranks of a job. The optimizer of
 * a multi-rank job (ZeRO across ranks, docs/DISTRIBUTED.md) runs its step
 * program's collectives through one: the same compiled step.so runs at any
 * world size W; only the communicator changes.
 *
 * Every collective is called by every rank, in the same order, with the same
 * sizes. A communicator is an existing engine behind one small C table
 * (zopt_comm_ops): built in are `self` (W = 1) and `loopback` (ranks as
 * threads of one process: the test workhorse); `mpi` is a plugin built
 * against the system's MPI (libzopt_comm_mpi.so, loaded on first use);
 * `nccl` loads libnccl.so.2 with dlopen; the Python binding makes one over a
 * torch.distributed ProcessGroup. A user may supply their own table.
 *
 * Errors, never hangs: a rank that calls a different collective (or the same
 * one with other sizes) or that never arrives (died, or stopped calling)
 * makes the collective fail on the ranks that did call it, within the
 * communicator's timeout, with a message naming the rank and both
 * operations. Checks: before each collective the ranks exchange a small
 * signature (sequence number, operation, byte count, what the runtime is
 * doing, e.g. "REDUCE_SCATTER grad bucket 2 step 7"); the engine's own
 * mechanism where it has one (loopback). zopt_comm_set_checks turns the
 * exchange off (one small collective less per collective); every rank must
 * use the same setting. A failed collective poisons the communicator: the
 * ranks are no longer in step, so every later call fails at once with the
 * first error (and the engine's abort, if any, is called once).
 *
 * Failed collectives return ZOPT_ERR_COMM; misuse (NULL pointers, sizes that overflow, overlapping
 * buffers) returns ZOPT_ERR_INVALID_ARGUMENT and does not poison. Messages
 * read "<engine> rank R of W: collective #N <op> of B bytes[/rank] (<what>):
 * <reason>". docs/COMM.md describes the engines.
 *
 * Thread safety: a communicator is used by one thread at a time (its
 * optimizer's caller). Distinct communicators are independent.
 *===----------------------------------------------------------------------===*/
#ifndef ZOPT_COMM_H
#define ZOPT_COMM_H

#include <stddef.h>
#include <stdint.h>

#include "zopt/zopt.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct zopt_comm zopt_comm;

/* ---- the engine table --------------------------------------------------- */

#define ZOPT_COMM_OPS_VERSION 1u

/* Return codes of the table's functions (any other value counts as FAILED). */
#define ZOPT_COMM_OK 0
#define ZOPT_COMM_ERR_FAILED 1   /* the engine failed; last_error says why */
#define ZOPT_COMM_ERR_TIMEOUT 2  /* a peer did not arrive within the timeout */
#define ZOPT_COMM_ERR_MISMATCH 3 /* peers called another collective or size */

/* Where the buffers of a communicator's collectives live. */
#define ZOPT_COMM_MEM_HOST 1u   /* host memory; calls are blocking */
#define ZOPT_COMM_MEM_DEVICE 2u /* CUDA device memory; calls enqueue on the
                                   communicator's stream and return (NCCL) */

typedef struct zopt_comm_ops {
  uint32_t version; /* ZOPT_COMM_OPS_VERSION */
  uint32_t memory;  /* ZOPT_COMM_MEM_* */
  const char *name; /* "self", "loopback", "mpi", "nccl", "torch", ... */
  /* send holds W pieces of `bytes` bytes, piece r for rank r; recv receives
   * W pieces, piece q from rank q (piece `rank` is this rank's own). Never
   * called with bytes == 0; send and recv never overlap. */
  int (*all_to_all)(void *ctx, const void *send, void *recv, size_t bytes);
  /* send holds `bytes` bytes; recv receives W pieces in rank order. Never
   * called with bytes == 0; in place when send == recv + rank * bytes
   * (otherwise they never overlap). */
  int (*all_gather)(void *ctx, const void *send, void *recv, size_t bytes);
  /* Optional (NULL: no signature checks unless memory is HOST, in which
   * case all_gather serves): a host-memory all_gather of `bytes` <= 256
   * bytes, honouring the timeout, used for the signature checks and
   * zopt_comm_barrier. */
  int (*exchange)(void *ctx, const void *send, void *recv, size_t bytes);
  /* Optional: waits for the enqueued collectives (DEVICE communicators). */
  int (*synchronize)(void *ctx);
  /* Optional: the timeout in seconds for the calls above (> 0). */
  int (*set_timeout)(void *ctx, double seconds);
  /* Optional: ends this rank's participation so that peers waiting on it
   * fail promptly instead of timing out (NCCL: ncclCommAbort). Called once,
   * after this rank's first failed collective. */
  void (*abort)(void *ctx);
  /* The message of the last failed call (never NULL). */
  const char *(*last_error)(void *ctx);
  /* Frees ctx (called once, by zopt_comm_free). May be NULL. */
  void (*destroy)(void *ctx);
} zopt_comm_ops;

/* Wraps an engine table. `ops` must stay valid until zopt_comm_free; ctx is
 * handed to every call. rank in [0, size), size >= 1; ops->version,
 * memory, name, all_to_all, all_gather and last_error are required. */
ZOPT_API zopt_status zopt_comm_create(const zopt_comm_ops *ops, void *ctx, int rank, int size,
                                      zopt_comm **out);

/* ---- built-in communicators --------------------------------------------- */

/* W = 1: collectives copy send to recv. */
ZOPT_API zopt_status zopt_comm_create_self(zopt_comm **out);

/* Loopback: `size` ranks as threads of this process. Creates `size`
 * communicators (comms[r] for rank r), each to be used by its own thread.
 * Mismatched collectives and ranks that do not arrive within the timeout
 * fail on every rank that called, naming the ranks that differ. */
#define ZOPT_LOOPBACK_DELAY 1u  /* random sleeps (0-2 ms) before and after each
                                   collective and between the copies */
#define ZOPT_LOOPBACK_POISON 2u /* recv buffers are filled with 0xFF bytes
                                   (NaN for every float dtype) before the
                                   collective writes them */
typedef struct zopt_loopback_options { /* NULL options: all defaults */
  double timeout_s; /* <= 0: 30 s */
  uint32_t flags;   /* ZOPT_LOOPBACK_* */
  uint32_t reserved;
  uint64_t seed;    /* of the delays */
} zopt_loopback_options;
ZOPT_API zopt_status zopt_comm_create_loopback(int size, const zopt_loopback_options *options,
                                               zopt_comm **comms);

/* MPI: `mpi_comm` points at an MPI_Comm of the system MPI (NULL:
 * MPI_COMM_WORLD, initializing MPI with MPI_THREAD_SERIALIZED if the process
 * has not, and finalizing it when the last such communicator is freed).
 * The MPI plugin libzopt_comm_mpi.so is loaded from the directory of
 * libzopt_runtime.so or $ZOPT_COMM_MPI_LIB; ZOPT_ERR_UNSUPPORTED when it was
 * not built (no MPI at build time) or cannot be loaded. Collective over the
 * MPI communicator (it is duplicated). Default timeout: 300 s. */
ZOPT_API zopt_status zopt_comm_create_mpi(const void *mpi_comm, zopt_comm **out);

/* NCCL (libnccl.so.2, or $ZOPT_NCCL_LIB, loaded with dlopen): device
 * memory, collectives enqueued on `cu_stream` (a CUstream/cudaStream_t,
 * NULL: the legacy default stream). One rank calls zopt_comm_nccl_unique_id
 * and the launcher hands the 128 bytes to every rank (e.g. a torch Store or
 * an MPI broadcast). Needs the rank's CUDA context current on the calling
 * thread (ZOPT_ERR_BAD_STATE otherwise) and the CUDA driver;
 * ZOPT_ERR_UNSUPPORTED without NCCL or the driver. Default timeout: 300 s;
 * zopt_comm_synchronize aborts the NCCL communicator when it expires. */
#define ZOPT_NCCL_UNIQUE_ID_BYTES 128
ZOPT_API zopt_status zopt_comm_nccl_unique_id(void *id /* ZOPT_NCCL_UNIQUE_ID_BYTES */);
ZOPT_API zopt_status zopt_comm_create_nccl(const void *id, int rank, int size, void *cu_stream,
                                           zopt_comm **out);

ZOPT_API void zopt_comm_free(zopt_comm *comm);

/* ---- queries and settings ----------------------------------------------- */

ZOPT_API int zopt_comm_rank(const zopt_comm *comm); /* -1 for NULL */
ZOPT_API int zopt_comm_size(const zopt_comm *comm); /* -1 for NULL */
ZOPT_API const char *zopt_comm_name(const zopt_comm *comm); /* "(null)" for NULL */
/* ZOPT_COMM_MEM_HOST or ZOPT_COMM_MEM_DEVICE (0 for NULL). */
ZOPT_API uint32_t zopt_comm_memory(const zopt_comm *comm);
/* Seconds a collective waits for its peers before failing (finite, > 0).
 * ZOPT_ERR_UNSUPPORTED when the engine has no set_timeout. */
ZOPT_API zopt_status zopt_comm_set_timeout(zopt_comm *comm, double seconds);
/* Signature checks before each collective: 1 on (the default), 0 off. The
 * loopback engine always checks (in its own rendezvous); a barrier always
 * exchanges signatures. */
ZOPT_API zopt_status zopt_comm_set_checks(zopt_comm *comm, int on);
/* Collectives (barriers included) issued so far through this communicator:
 * the sequence number of the last one. */
ZOPT_API uint64_t zopt_comm_count(const zopt_comm *comm);

/* ---- collectives (also what the optimizer uses) ------------------------- */
/* all_to_all: send and recv hold W * bytes_per_rank bytes and must not
 * overlap. all_gather: send holds `bytes`, recv W * bytes; in place when
 * send == recv + rank * bytes. Zero bytes is a valid (checked) collective.
 * DEVICE communicators enqueue and return: the buffers must stay untouched
 * until zopt_comm_synchronize. The barrier is a signature exchange
 * (ZOPT_ERR_UNSUPPORTED for a DEVICE table without `exchange`). */

ZOPT_API zopt_status zopt_comm_all_to_all(zopt_comm *comm, const void *send, void *recv,
                                          size_t bytes_per_rank);
ZOPT_API zopt_status zopt_comm_all_gather(zopt_comm *comm, const void *send, void *recv,
                                          size_t bytes);
ZOPT_API zopt_status zopt_comm_barrier(zopt_comm *comm);
/* Waits for the enqueued collectives of a DEVICE communicator (no-op for
 * host communicators). */
ZOPT_API zopt_status zopt_comm_synchronize(zopt_comm *comm);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* ZOPT_COMM_H */
