/* comm_mpi.c - libzopt_comm_mpi.so: the `mpi` engine of zopt/comm.h over the
 * system MPI (built when CMake finds one; loaded by zopt_comm_create_mpi).
 *
 * runtime/plugins/ holds the engines that must be compiled against a
 * third-party library's headers (MPI handles differ between Open MPI and
 * MPICH), so that libzopt_runtime itself has no such dependency.
 *
 * Every call honours the communicator's timeout: the collectives use the
 * nonblocking forms (MPI_Ialltoall, MPI_Iallgather) polled with MPI_Test
 * until the deadline; the signature exchange uses MPI_Isend/MPI_Irecv with
 * every peer, so that a timeout names exactly the ranks whose signatures did
 * not arrive. After a data collective times out (a rank stalled inside it,
 * or checks off), a short liveness exchange on a second duplicate of the
 * communicator names the ranks that do not answer: every rank waiting in a
 * call of this communicator answers pings while it waits. Byte counts above
 * the chunk size (1 GiB; ZOPT_COMM_MPI_CHUNK_BYTES
 * overrides it, for tests) are moved as several collectives over a derived
 * datatype of `chunk` bytes whose extent is the whole piece.
 */
#include <mpi.h>

#include <limits.h>
#include <sched.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "mpi_plugin.h"

#define EXPORT __attribute__((visibility("default")))

typedef struct {
  MPI_Comm comm; /* our duplicate of the user's communicator */
  MPI_Comm live; /* another one, for the liveness exchange (pings) */
  int rank, size;
  double timeout;
  size_t chunk;
  int counted;  /* counts toward the MPI_Finalize we owe (MPI initialized here) */
  int stuck;    /* a collective request is still pending after a timeout */
  uint64_t xseq;
  uint64_t calls;     /* engine calls so far (the one running included) */
  uint64_t pong;      /* the payload of the last answer sent (stays valid while the send is pending) */
  char err[1024];
} Ctx;

enum { TAG_PING = 1, TAG_PONG = 2 };

static int g_we_initialized = 0; /* MPI_Init_thread was called by this plugin */
static int g_counted = 0;        /* live communicators created with mpi_comm == NULL since */
static int g_stuck = 0;          /* some communicator has an uncompletable request: never finalize */

static int set_err(Ctx *c, int code, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static int set_err(Ctx *c, int code, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(c->err, sizeof c->err, fmt, ap);
  va_end(ap);
  return code;
}

static const char *mpi_error(int rc) {
  static char buf[MPI_MAX_ERROR_STRING + 32];
  int n = 0;
  char s[MPI_MAX_ERROR_STRING];
  if (MPI_Error_string(rc, s, &n) != MPI_SUCCESS) n = 0;
  s[n] = 0;
  snprintf(buf, sizeof buf, "%s (MPI error %d)", n ? s : "unknown", rc);
  return buf;
}

/* Between two MPI_Test calls. A non-blocking collective of Open MPI
 * (libnbc over the shared-memory transport) advances only inside MPI_Test:
 * every round and every fragment of a large message needs a call, so the
 * waiting rank polls as the blocking collective's own progress loop does,
 * yielding the core to ranks that share it (--oversubscribe) instead of
 * sleeping. Only a wait already past `idle` seconds (a rank still working
 * on its step, or one that never arrives) sleeps between polls, 100 us.
 * (A 100 us sleep after every 1,024 polls held 32 KiB fragments to ~0.3
 * GB/s: zopt's all-to-all measured 0.4-0.5 of raw MPI_Alltoall.) */
/* Answers the pings of ranks that gave up on a collective (their liveness
 * exchange): this rank is alive and inside a call. */
static void serve(Ctx *c) {
  for (;;) {
    int flag = 0;
    MPI_Status st;
    if (MPI_Iprobe(MPI_ANY_SOURCE, TAG_PING, c->live, &flag, &st) != MPI_SUCCESS || !flag) return;
    uint64_t seq = 0;
    if (MPI_Recv(&seq, 8, MPI_BYTE, st.MPI_SOURCE, TAG_PING, c->live, MPI_STATUS_IGNORE) != MPI_SUCCESS) return;
    MPI_Request r;
    c->pong = c->calls;
    if (MPI_Isend(&c->pong, 8, MPI_BYTE, st.MPI_SOURCE, TAG_PONG, c->live, &r) == MPI_SUCCESS) MPI_Request_free(&r);
  }
}

static void backoff(Ctx *c, unsigned *spins, double waited, double idle) {
  ++*spins;
  if (*spins < 64) return;
  /* Pings come only after some rank waited a whole timeout: answer them
   * once this wait is not short (no probing in the fast path). */
  if (waited > 0.02 && (*spins & 15) == 0) serve(c);
  if (waited < idle) {
    sched_yield();
    return;
  }
  struct timespec ts = {0, 100000};
  nanosleep(&ts, NULL);
}

/* After a data collective timed out: pings every peer on `live` and waits
 * a short window for the answers (serving the pings of others meanwhile).
 * Appends to the error which ranks did not answer. A rank that answers is
 * inside some call of this communicator (it waits too, or it gave up); one
 * that does not is stalled elsewhere, dead, or wedged. */
static void liveness(Ctx *c) {
  const int W = c->size;
  double window = c->timeout / 4;
  if (window < 0.2) window = 0.2;
  if (window > 2.0) window = 2.0;
  uint64_t *pongs = (uint64_t *)calloc((size_t)W, sizeof *pongs);
  MPI_Request *reqs = (MPI_Request *)malloc(sizeof *reqs * 2u * (size_t)W);
  uint64_t ping = c->calls;
  if (!pongs || !reqs) {
    free(pongs);
    free(reqs);
    return;
  }
  for (int q = 0; q < W; ++q) {
    reqs[q] = reqs[W + q] = MPI_REQUEST_NULL;
    if (q == c->rank) continue;
    if (MPI_Irecv(&pongs[q], 8, MPI_BYTE, q, TAG_PONG, c->live, &reqs[q]) != MPI_SUCCESS) reqs[q] = MPI_REQUEST_NULL;
    if (MPI_Isend(&ping, 8, MPI_BYTE, q, TAG_PING, c->live, &reqs[W + q]) != MPI_SUCCESS) reqs[W + q] = MPI_REQUEST_NULL;
  }
  double start = MPI_Wtime();
  for (;;) {
    serve(c);
    int all = 1;
    for (int q = 0; q < W; ++q)
      if (reqs[q] != MPI_REQUEST_NULL) {
        int flag = 0;
        MPI_Test(&reqs[q], &flag, MPI_STATUS_IGNORE);
        if (!flag) all = 0;
      }
    if (all || MPI_Wtime() - start > window) break;
    struct timespec ts = {0, 200000};
    nanosleep(&ts, NULL);
  }
  char list[600] = "";
  size_t len = 0;
  int missing = 0;
  for (int q = 0; q < W; ++q) {
    if (reqs[q] != MPI_REQUEST_NULL) {  /* no answer: name it, cancel the receive */
      ++missing;
      if (len < sizeof list - 16) len += (size_t)snprintf(list + len, sizeof list - len, "%s%d", len ? ", " : "", q);
      MPI_Cancel(&reqs[q]);
      MPI_Wait(&reqs[q], MPI_STATUS_IGNORE);
    }
    if (reqs[W + q] != MPI_REQUEST_NULL) {
      /* `ping` is on this stack: wait for the (small, eager) send briefly */
      int flag = 0;
      double t0 = MPI_Wtime();
      while (!flag && MPI_Test(&reqs[W + q], &flag, MPI_STATUS_IGNORE) == MPI_SUCCESS && MPI_Wtime() - t0 < 0.5)
        ;
      if (!flag) {
        MPI_Cancel(&reqs[W + q]);
        MPI_Wait(&reqs[W + q], MPI_STATUS_IGNORE);
      }
    }
  }
  size_t n = strlen(c->err);
  if (missing)
    snprintf(c->err + n, sizeof c->err - n, "; rank%s %s did not answer within %g s (liveness check; the other ranks "
             "did: they are inside a collective too)", missing == 1 ? "" : "s", list, window);
  else
    snprintf(c->err + n, sizeof c->err - n, "; every rank answered the liveness check within %g s (they are inside "
             "collectives of this communicator, perhaps other ones)", window);
  free(pongs);
  free(reqs);
}

/* Polls `reqs` until all complete or the deadline; on a timeout the requests
 * stay pending (collective requests cannot be cancelled). */
static int wait_all(Ctx *c, int n, MPI_Request *reqs, const char *what, size_t bytes) {
  double start = MPI_Wtime(), deadline = start + c->timeout;
  unsigned spins = 0;
  for (;;) {
    int done = 0;
    int rc = MPI_Testall(n, reqs, &done, MPI_STATUSES_IGNORE);
    if (rc != MPI_SUCCESS) return set_err(c, ZOPT_COMM_ERR_FAILED, "%s: %s", what, mpi_error(rc));
    if (done) return ZOPT_COMM_OK;
    if (MPI_Wtime() > deadline) {
      c->stuck = 1;
      g_stuck = 1;
      set_err(c, ZOPT_COMM_ERR_TIMEOUT, "%s of %zu bytes did not complete within %g s", what, bytes, c->timeout);
      liveness(c);
      return ZOPT_COMM_ERR_TIMEOUT;
    }
    backoff(c, &spins, MPI_Wtime() - start, 0.5);
  }
}

/* A datatype of `n` bytes whose extent is `extent` bytes (a chunk of every
 * rank's piece). */
static int chunk_type(size_t n, size_t extent, MPI_Datatype *t) {
  MPI_Datatype base;
  int rc = MPI_Type_contiguous((int)n, MPI_BYTE, &base);
  if (rc != MPI_SUCCESS) return rc;
  rc = MPI_Type_create_resized(base, 0, (MPI_Aint)extent, t);
  MPI_Type_free(&base);
  if (rc != MPI_SUCCESS) return rc;
  return MPI_Type_commit(t);
}

static int collective(Ctx *c, int gather, const void *send, void *recv, size_t bytes) {
  ++c->calls;
  const char *what = gather ? "MPI_Iallgather" : "MPI_Ialltoall";
  int in_place = gather && (const char *)send == (const char *)recv + (size_t)c->rank * bytes;
  if (bytes <= c->chunk && bytes <= (size_t)INT_MAX) {
    MPI_Request req;
    int rc = gather ? MPI_Iallgather(in_place ? MPI_IN_PLACE : send, (int)bytes, MPI_BYTE, recv, (int)bytes,
                                     MPI_BYTE, c->comm, &req)
                    : MPI_Ialltoall(send, (int)bytes, MPI_BYTE, recv, (int)bytes, MPI_BYTE, c->comm, &req);
    if (rc != MPI_SUCCESS) return set_err(c, ZOPT_COMM_ERR_FAILED, "%s: %s", what, mpi_error(rc));
    return wait_all(c, 1, &req, what, bytes);
  }
  size_t chunk = c->chunk < (size_t)INT_MAX ? c->chunk : (size_t)INT_MAX;
  int n = (int)((bytes + chunk - 1) / chunk);
  MPI_Request *reqs = (MPI_Request *)calloc((size_t)n, sizeof *reqs);
  if (!reqs) return set_err(c, ZOPT_COMM_ERR_FAILED, "%s: out of memory", what);
  int issued = 0, rc = MPI_SUCCESS;
  for (size_t off = 0; off < bytes; off += chunk) {
    size_t len = bytes - off < chunk ? bytes - off : chunk;
    MPI_Datatype t;
    rc = chunk_type(len, bytes, &t);
    if (rc != MPI_SUCCESS) break;
    if (gather)
      rc = MPI_Iallgather(in_place ? MPI_IN_PLACE : (const char *)send + off, in_place ? 0 : (int)len,
                          MPI_BYTE, (char *)recv + off, 1, t, c->comm, &reqs[issued]);
    else
      rc = MPI_Ialltoall((const char *)send + off, 1, t, (char *)recv + off, 1, t, c->comm, &reqs[issued]);
    MPI_Type_free(&t); /* freed once the pending collective is done with it */
    if (rc != MPI_SUCCESS) break;
    ++issued;
  }
  int out;
  if (rc != MPI_SUCCESS) {
    /* The issued chunks cannot be cancelled; the communicator is unusable. */
    if (issued) c->stuck = g_stuck = 1;
    out = set_err(c, ZOPT_COMM_ERR_FAILED, "%s (chunk %d of %d): %s", what, issued + 1, n, mpi_error(rc));
  } else {
    out = wait_all(c, issued, reqs, what, bytes);
  }
  free(reqs);
  return out;
}

static int mpi_all_to_all(void *ctx, const void *send, void *recv, size_t bytes) {
  return collective((Ctx *)ctx, 0, send, recv, bytes);
}

static int mpi_all_gather(void *ctx, const void *send, void *recv, size_t bytes) {
  return collective((Ctx *)ctx, 1, send, recv, bytes);
}

/* Signature exchange: Isend to / Irecv from every peer. */
static int mpi_exchange(void *ctx, const void *send, void *recv, size_t bytes) {
  Ctx *c = (Ctx *)ctx;
  ++c->calls;
  int W = c->size, tag = (int)(++c->xseq % 32000u) + 1;
  MPI_Request *reqs = (MPI_Request *)malloc(sizeof *reqs * 2u * (size_t)W);
  if (!reqs) return set_err(c, ZOPT_COMM_ERR_FAILED, "signature exchange: out of memory");
  memcpy((char *)recv + (size_t)c->rank * bytes, send, bytes);
  int rc = MPI_SUCCESS;
  for (int q = 0; q < W; ++q) {
    reqs[q] = reqs[W + q] = MPI_REQUEST_NULL;
    if (q == c->rank) continue;
    rc = MPI_Irecv((char *)recv + (size_t)q * bytes, (int)bytes, MPI_BYTE, q, tag, c->comm, &reqs[q]);
    if (rc == MPI_SUCCESS) rc = MPI_Isend(send, (int)bytes, MPI_BYTE, q, tag, c->comm, &reqs[W + q]);
    if (rc != MPI_SUCCESS) break;
  }
  int out = ZOPT_COMM_OK;
  if (rc != MPI_SUCCESS) {
    out = set_err(c, ZOPT_COMM_ERR_FAILED, "MPI_Isend/MPI_Irecv: %s", mpi_error(rc));
  } else {
    double start = MPI_Wtime(), deadline = start + c->timeout;
    unsigned spins = 0;
    for (;;) {
      int done = 0;
      rc = MPI_Testall(2 * W, reqs, &done, MPI_STATUSES_IGNORE);
      if (rc != MPI_SUCCESS) {
        out = set_err(c, ZOPT_COMM_ERR_FAILED, "signature exchange: %s", mpi_error(rc));
        break;
      }
      if (done) break;
      if (MPI_Wtime() > deadline) {
        /* Name the ranks whose signature did not arrive. */
        char list[768] = "";
        size_t len = 0;
        int missing = 0;
        for (int q = 0; q < W; ++q) {
          int flag = 1;
          if (reqs[q] != MPI_REQUEST_NULL) MPI_Test(&reqs[q], &flag, MPI_STATUS_IGNORE);
          if (flag) continue;
          ++missing;
          if (len < sizeof list - 16) len += (size_t)snprintf(list + len, sizeof list - len, "%s%d", len ? ", " : "", q);
        }
        out = set_err(c, ZOPT_COMM_ERR_TIMEOUT, "timed out after %g s: rank%s %s did not call it", c->timeout,
                      missing == 1 ? "" : "s", missing ? list : "(none: the sends did not complete)");
        break;
      }
      backoff(c, &spins, MPI_Wtime() - start, 0.5);
    }
  }
  /* Pending point-to-point requests can be cleaned up: cancel the receives,
   * release the (small, eagerly sent) sends. */
  for (int q = 0; q < W; ++q) {
    if (reqs[q] != MPI_REQUEST_NULL) {
      MPI_Cancel(&reqs[q]);
      MPI_Wait(&reqs[q], MPI_STATUS_IGNORE);
    }
    if (reqs[W + q] != MPI_REQUEST_NULL) MPI_Request_free(&reqs[W + q]);
  }
  free(reqs);
  return out;
}

static int mpi_set_timeout(void *ctx, double seconds) {
  ((Ctx *)ctx)->timeout = seconds;
  return ZOPT_COMM_OK;
}

static const char *mpi_last_error(void *ctx) { return ((Ctx *)ctx)->err; }

static void mpi_destroy(void *ctx) {
  Ctx *c = (Ctx *)ctx;
  int finalized = 0;
  MPI_Finalized(&finalized);
  /* A communicator with a pending collective request cannot be freed. */
  if (!finalized && !c->stuck) {
    MPI_Comm_free(&c->comm);
    MPI_Comm_free(&c->live);
  }
  if (c->counted && --g_counted == 0 && g_we_initialized && !finalized && !g_stuck) {
    MPI_Finalize();
    g_we_initialized = 0;
  }
  free(c);
}

static const zopt_comm_ops kMpiOps = {
    ZOPT_COMM_OPS_VERSION, ZOPT_COMM_MEM_HOST, "mpi",
    mpi_all_to_all, mpi_all_gather, mpi_exchange,
    NULL, /* synchronize: calls are blocking */
    mpi_set_timeout,
    NULL, /* abort: MPI has no way to make peers fail short of MPI_Abort (which kills the job) */
    mpi_last_error, mpi_destroy,
};

static int open_err(char *err, size_t len, int code, const char *fmt, ...) __attribute__((format(printf, 4, 5)));
static int open_err(char *err, size_t len, int code, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(err, len, fmt, ap);
  va_end(ap);
  return code;
}

EXPORT int zopt_comm_mpi_open(uint32_t version, const void *mpi_comm, const zopt_comm_ops **ops, void **ctx,
                              int *rank, int *size, char *err, size_t err_len) {
  enum { INVALID = 1, UNSUPPORTED = 7, INTERNAL = 8 };
  if (version != ZOPT_COMM_MPI_PLUGIN_VERSION)
    return open_err(err, err_len, UNSUPPORTED, "plugin version %u, the runtime expects %u (rebuild both)",
                    ZOPT_COMM_MPI_PLUGIN_VERSION, version);
  int inited = 0, finalized = 0;
  MPI_Initialized(&inited);
  MPI_Finalized(&finalized);
  if (finalized) return open_err(err, err_len, UNSUPPORTED, "MPI was already finalized in this process");
  if (!inited) {
    if (mpi_comm)
      return open_err(err, err_len, INVALID, "an MPI_Comm was given but MPI is not initialized");
    int provided = 0;
    int rc = MPI_Init_thread(NULL, NULL, MPI_THREAD_SERIALIZED, &provided);
    if (rc != MPI_SUCCESS) return open_err(err, err_len, INTERNAL, "MPI_Init_thread: %s", mpi_error(rc));
    g_we_initialized = 1;
  }
  MPI_Comm base = mpi_comm ? *(const MPI_Comm *)mpi_comm : MPI_COMM_WORLD;
  Ctx *c = (Ctx *)calloc(1, sizeof *c);
  if (!c) return open_err(err, err_len, INTERNAL, "out of memory");
  c->timeout = 300;
  c->chunk = (size_t)1 << 30;
  const char *chunk = getenv("ZOPT_COMM_MPI_CHUNK_BYTES");
  if (chunk && *chunk) {
    char *end = NULL;
    unsigned long long v = strtoull(chunk, &end, 10);
    if (!*end && v >= 1 && v <= (unsigned long long)INT_MAX) c->chunk = (size_t)v;
  }
  int rc = MPI_Comm_dup(base, &c->comm);
  if (rc != MPI_SUCCESS) {
    free(c);
    return open_err(err, err_len, INTERNAL, "MPI_Comm_dup: %s", mpi_error(rc));
  }
  rc = MPI_Comm_dup(base, &c->live);
  if (rc != MPI_SUCCESS) {
    MPI_Comm_free(&c->comm);
    free(c);
    return open_err(err, err_len, INTERNAL, "MPI_Comm_dup: %s", mpi_error(rc));
  }
  MPI_Comm_set_errhandler(c->comm, MPI_ERRORS_RETURN);
  MPI_Comm_set_errhandler(c->live, MPI_ERRORS_RETURN);
  MPI_Comm_rank(c->comm, &c->rank);
  MPI_Comm_size(c->comm, &c->size);
  if (!mpi_comm && g_we_initialized) {
    c->counted = 1;
    ++g_counted;
  }
  *ops = &kMpiOps;
  *ctx = c;
  *rank = c->rank;
  *size = c->size;
  return 0;
}
