// comm.cpp - the zopt_comm wrapper: validation, sequence numbers, signature
// checks, poisoning, messages; the public collectives and queries.
#include "comm_internal.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <new>

namespace zopt {

const char *comm_op_name(uint32_t op) {
  switch (op) {
    case COMM_OP_ALL_TO_ALL: return "all_to_all";
    case COMM_OP_ALL_GATHER: return "all_gather";
    case COMM_OP_BARRIER: return "barrier";
  }
  return "unknown collective";
}

void comm_make_signature(CommSignature *sig, uint32_t op, uint64_t seq, size_t bytes, int rank,
                         const char *what) {
  memset(sig, 0, sizeof *sig);
  sig->magic = kCommSignatureMagic;
  sig->op = op;
  sig->seq = seq;
  sig->bytes = bytes;
  sig->rank = (uint32_t)rank;
  if (what) strncpy(sig->what, what, kCommWhatChars - 1);
}

std::string comm_describe(const CommSignature &s) {
  if (s.magic != kCommSignatureMagic) return "something that is not a zopt collective signature";
  char what[kCommWhatChars + 1];
  memcpy(what, s.what, kCommWhatChars);
  what[kCommWhatChars] = 0;
  for (char *p = what; *p; ++p)
    if ((unsigned char)*p < 32) *p = '?';
  char buf[256];
  if (s.op == COMM_OP_BARRIER)
    snprintf(buf, sizeof buf, "#%llu barrier", (unsigned long long)s.seq);
  else
    snprintf(buf, sizeof buf, "#%llu %s of %llu bytes%s", (unsigned long long)s.seq, comm_op_name(s.op),
             (unsigned long long)s.bytes, s.op == COMM_OP_ALL_TO_ALL ? "/rank" : "");
  std::string out = buf;
  if (what[0]) out += std::string(" (") + what + ")";
  return out;
}

std::string comm_rank_list(const std::vector<int> &ranks) {
  std::string out = ranks.size() == 1 ? "rank " : "ranks ";
  for (size_t i = 0; i < ranks.size();) {
    size_t j = i;
    while (j + 1 < ranks.size() && ranks[j + 1] == ranks[j] + 1) ++j;
    if (i) out += ", ";
    out += std::to_string(ranks[i]);
    if (j > i) out += (j == i + 1 ? ", " : "-") + std::to_string(ranks[j]);
    i = j + 1;
  }
  return out;
}

namespace {

bool same_call(const CommSignature &a, const CommSignature &b) {
  if (a.magic != kCommSignatureMagic || b.magic != kCommSignatureMagic)
    return a.magic == b.magic && memcmp(&a, &b, sizeof a) == 0;
  return a.op == b.op && a.seq == b.seq && a.bytes == b.bytes &&
         memcmp(a.what, b.what, kCommWhatChars) == 0;
}

}  // namespace

std::string comm_mismatch(const CommSignature *sigs, int size, int rank) {
  // Groups of equal signatures, in order of their lowest rank.
  std::vector<std::vector<int>> groups;
  for (int q = 0; q < size; ++q) {
    bool placed = false;
    for (auto &g : groups)
      if (same_call(sigs[g[0]], sigs[q])) {
        g.push_back(q);
        placed = true;
        break;
      }
    if (!placed) groups.push_back({q});
  }
  if (groups.size() <= 1) return "";
  size_t ref = 0;
  for (size_t i = 1; i < groups.size(); ++i)
    if (groups[i].size() > groups[ref].size()) ref = i;
  std::string out;
  auto add = [&](const std::string &s) {
    if (!out.empty()) out += "; ";
    out += s;
  };
  bool mine_in_ref = std::find(groups[ref].begin(), groups[ref].end(), rank) != groups[ref].end();
  if (!mine_in_ref)
    add("rank " + std::to_string(rank) + " (this rank) differs: " + comm_rank_list(groups[ref]) +
        " called " + comm_describe(sigs[groups[ref][0]]));
  for (size_t i = 0; i < groups.size(); ++i) {
    if (i == ref) continue;
    if (std::find(groups[i].begin(), groups[i].end(), rank) != groups[i].end()) {
      // This rank's own group: say who else is in it, if anyone.
      std::vector<int> others;
      for (int q : groups[i])
        if (q != rank) others.push_back(q);
      if (!others.empty()) add(comm_rank_list(others) + " called the same as this rank");
      continue;
    }
    add(comm_rank_list(groups[i]) + " called " + comm_describe(sigs[groups[i][0]]));
  }
  return out;
}

}  // namespace zopt

using namespace zopt;

namespace {

const char *engine_error(const zopt_comm *c) {
  const char *e = c->ops->last_error ? c->ops->last_error(c->ctx) : nullptr;
  return e && *e ? e : "(the engine gave no message)";
}

std::string who(const zopt_comm *c) {
  return std::string(c->ops->name ? c->ops->name : "comm") + " rank " + std::to_string(c->rank) + " of " +
         std::to_string(c->size);
}

// Poisons the communicator with `msg` and tells the engine to leave (so that
// peers waiting on this rank fail promptly).
zopt_status poison(zopt_comm *c, const std::string &msg) {
  c->poisoned = true;
  c->first_error = msg;
  if (c->ops->abort) c->ops->abort(c->ctx);
  return fail(kCommError, "%s", msg.c_str());
}

zopt_status poisoned(const zopt_comm *c, const char *fn) {
  return fail(kCommError, "%s: the communicator failed earlier and is unusable (ranks are out of step): %s", fn,
              c->first_error.c_str());
}

// A mismatch where every rank had changed nothing yet (kSigUnchanged on
// every signature): every rank fails this collective alike and no data
// moved, so the communicator stays usable.
zopt_status clean_mismatch(const std::string &msg) {
  return fail(kCommError,
              "%s. Every rank must make the same collective calls in the same order; this call changed nothing "
              "and the communicator remains usable",
              msg.c_str());
}

// The signature exchange; returns ZOPT_OK or the failure (poisoning unless
// it is a clean mismatch).
zopt_status check_signatures(zopt_comm *c, const CommSignature &mine, const std::string &prefix) {
  c->sigs.resize((size_t)c->size);
  int rc;
  if (c->ops->exchange)
    rc = c->ops->exchange(c->ctx, &mine, c->sigs.data(), sizeof mine);
  else
    rc = c->ops->all_gather(c->ctx, &mine, c->sigs.data(), sizeof mine);
  if (rc != ZOPT_COMM_OK)
    return poison(c, prefix + ": signature exchange: " + engine_error(c));
  for (int q = 0; q < c->size; ++q)
    if (c->sigs[(size_t)q].magic == kCommSignatureMagic && c->sigs[(size_t)q].rank != (uint32_t)q)
      return poison(c, prefix + ": the engine's signature exchange put rank " +
                           std::to_string(c->sigs[(size_t)q].rank) + "'s signature in slot " +
                           std::to_string(q) + " (engine bug: pieces must be in rank order)");
  std::string diff = comm_mismatch(c->sigs.data(), c->size, c->rank);
  if (diff.empty()) return ZOPT_OK;
  bool clean = true;
  for (const CommSignature &s : c->sigs)
    clean = clean && s.magic == kCommSignatureMagic && (s.flags & kSigUnchanged);
  if (clean) return clean_mismatch(prefix + ": " + diff);
  return poison(c, prefix + ": " + diff);
}

bool overlaps(const void *a, size_t na, const void *b, size_t nb) {
  uintptr_t x = (uintptr_t)a, y = (uintptr_t)b;
  return na && nb && x < y + nb && y < x + na;
}

zopt_status collective(zopt_comm *c, uint32_t op, const void *send, void *recv, size_t bytes, const char *what,
                       const char *fn, uint32_t sig_flags = 0) {
  if (!c) return fail(ZOPT_ERR_INVALID_ARGUMENT, "%s: communicator is NULL", fn);
  if (c->poisoned) return poisoned(c, fn);
  if (!what || !*what) what = fn;
  size_t total = 0;
  if (op != COMM_OP_BARRIER) {
    if (__builtin_mul_overflow(bytes, (size_t)c->size, &total) || total > (SIZE_MAX >> 1))
      return fail(ZOPT_ERR_INVALID_ARGUMENT, "%s (%s): %zu bytes x %d ranks overflows", fn, what, bytes,
                  c->size);
    if (bytes && (!send || !recv))
      return fail(ZOPT_ERR_INVALID_ARGUMENT, "%s (%s): %s buffer is NULL", fn, what, !send ? "send" : "recv");
    size_t send_bytes = op == COMM_OP_ALL_TO_ALL ? total : bytes;
    bool in_place = op == COMM_OP_ALL_GATHER && bytes &&
                    (const char *)send == (const char *)recv + (size_t)c->rank * bytes;
    if (!in_place && overlaps(send, send_bytes, recv, total))
      return fail(ZOPT_ERR_INVALID_ARGUMENT,
                  "%s (%s): send and recv buffers overlap (%s)", fn, what,
                  op == COMM_OP_ALL_GATHER ? "an in-place all_gather has send == recv + rank * bytes"
                                           : "all_to_all is never in place");
  }
  bool host_exchange = c->ops->exchange || c->ops->memory == ZOPT_COMM_MEM_HOST;
  if (op == COMM_OP_BARRIER && c->size > 1 && !c->native && !host_exchange)
    return fail(ZOPT_ERR_UNSUPPORTED,
                "%s (%s): the %s engine has no host exchange (zopt_comm_ops.exchange) to build a barrier from", fn,
                what, c->ops->name);
  CommSignature mine;
  uint64_t seq = ++c->seq;
  comm_make_signature(&mine, op, seq, bytes, c->rank, what);
  mine.flags = sig_flags;
  std::string prefix = who(c) + ": collective " + comm_describe(mine);

  if (c->native) {
    bool clean = false;
    int rc = c->native->collective(c->ctx, &mine, send, recv, &clean);
    if (rc == ZOPT_COMM_ERR_MISMATCH && clean) return clean_mismatch(prefix + ": " + engine_error(c));
    if (rc != ZOPT_COMM_OK) return poison(c, prefix + ": " + engine_error(c));
    return ZOPT_OK;
  }
  if (c->size > 1) {
    if ((c->checks || op == COMM_OP_BARRIER) && host_exchange)
      if (zopt_status st = check_signatures(c, mine, prefix)) return st;
  }
  if (op == COMM_OP_BARRIER || bytes == 0) return ZOPT_OK;
  int rc = op == COMM_OP_ALL_TO_ALL ? c->ops->all_to_all(c->ctx, send, recv, bytes)
                                    : c->ops->all_gather(c->ctx, send, recv, bytes);
  if (rc != ZOPT_COMM_OK) return poison(c, prefix + ": " + engine_error(c));
  return ZOPT_OK;
}

}  // namespace

namespace zopt {

zopt_status comm_create_internal(const zopt_comm_ops *ops, void *ctx, int rank, int size, const CommNative *native,
                                 zopt_comm **out) {
  if (!out) return fail(ZOPT_ERR_INVALID_ARGUMENT, "zopt_comm_create: out is NULL");
  *out = nullptr;
  if (!ops) return fail(ZOPT_ERR_INVALID_ARGUMENT, "zopt_comm_create: ops is NULL");
  if (ops->version != ZOPT_COMM_OPS_VERSION)
    return fail(ZOPT_ERR_INVALID_ARGUMENT, "zopt_comm_create: ops->version is %u, this runtime knows version %u",
                ops->version, ZOPT_COMM_OPS_VERSION);
  if (ops->memory != ZOPT_COMM_MEM_HOST && ops->memory != ZOPT_COMM_MEM_DEVICE)
    return fail(ZOPT_ERR_INVALID_ARGUMENT,
                "zopt_comm_create: ops->memory is %u (ZOPT_COMM_MEM_HOST = 1 or ZOPT_COMM_MEM_DEVICE = 2)",
                ops->memory);
  const char *missing = !ops->name ? "name" : !ops->all_to_all ? "all_to_all" : !ops->all_gather ? "all_gather"
                        : !ops->last_error ? "last_error" : nullptr;
  if (missing) return fail(ZOPT_ERR_INVALID_ARGUMENT, "zopt_comm_create: ops->%s is NULL", missing);
  if (size < 1) return fail(ZOPT_ERR_INVALID_ARGUMENT, "zopt_comm_create: size %d (must be >= 1)", size);
  if (rank < 0 || rank >= size)
    return fail(ZOPT_ERR_INVALID_ARGUMENT, "zopt_comm_create: rank %d out of range [0, %d)", rank, size);
  zopt_comm *c = new (std::nothrow) zopt_comm;
  if (!c) return fail(ZOPT_ERR_OUT_OF_MEMORY, "zopt_comm_create: out of memory");
  c->ops = ops;
  c->ctx = ctx;
  c->rank = rank;
  c->size = size;
  c->native = native;
  *out = c;
  return ZOPT_OK;
}

zopt_status comm_all_to_all(zopt_comm *c, const void *send, void *recv, size_t bytes_per_rank, const char *what,
                            uint32_t sig_flags) {
  return collective(c, COMM_OP_ALL_TO_ALL, send, recv, bytes_per_rank, what, "zopt_comm_all_to_all", sig_flags);
}

zopt_status comm_all_gather(zopt_comm *c, const void *send, void *recv, size_t bytes, const char *what,
                            uint32_t sig_flags) {
  return collective(c, COMM_OP_ALL_GATHER, send, recv, bytes, what, "zopt_comm_all_gather", sig_flags);
}

zopt_status comm_barrier(zopt_comm *c, const char *what, uint32_t sig_flags) {
  return collective(c, COMM_OP_BARRIER, nullptr, nullptr, 0, what, "zopt_comm_barrier", sig_flags);
}

zopt_status comm_synchronize(zopt_comm *c, const char *what) {
  if (!c) return fail(ZOPT_ERR_INVALID_ARGUMENT, "zopt_comm_synchronize: communicator is NULL");
  if (c->poisoned) return poisoned(c, "zopt_comm_synchronize");
  if (c->ops->memory != ZOPT_COMM_MEM_DEVICE || !c->ops->synchronize) return ZOPT_OK;
  if (!what || !*what) what = "zopt_comm_synchronize";
  int rc = c->ops->synchronize(c->ctx);
  if (rc != ZOPT_COMM_OK)
    return poison(c, who(c) + ": " + what + " (waiting for the collectives up to #" + std::to_string(c->seq) +
                         "): " + engine_error(c));
  return ZOPT_OK;
}

}  // namespace zopt

// ---- the C API ----------------------------------------------------------------

ZOPT_API zopt_status zopt_comm_create(const zopt_comm_ops *ops, void *ctx, int rank, int size, zopt_comm **out) {
  return comm_create_internal(ops, ctx, rank, size, nullptr, out);
}

ZOPT_API void zopt_comm_free(zopt_comm *comm) {
  if (!comm) return;
  if (comm->ops->destroy) comm->ops->destroy(comm->ctx);
  delete comm;
}

ZOPT_API int zopt_comm_rank(const zopt_comm *comm) { return comm ? comm->rank : -1; }
ZOPT_API int zopt_comm_size(const zopt_comm *comm) { return comm ? comm->size : -1; }
ZOPT_API const char *zopt_comm_name(const zopt_comm *comm) { return comm ? comm->ops->name : "(null)"; }
ZOPT_API uint32_t zopt_comm_memory(const zopt_comm *comm) { return comm ? comm->ops->memory : 0u; }
ZOPT_API uint64_t zopt_comm_count(const zopt_comm *comm) { return comm ? comm->seq : 0; }

ZOPT_API zopt_status zopt_comm_set_timeout(zopt_comm *comm, double seconds) {
  if (!comm) return fail(ZOPT_ERR_INVALID_ARGUMENT, "zopt_comm_set_timeout: communicator is NULL");
  if (!(seconds > 0) || !std::isfinite(seconds))
    return fail(ZOPT_ERR_INVALID_ARGUMENT, "zopt_comm_set_timeout: %g s (must be finite and > 0)", seconds);
  if (!comm->ops->set_timeout)
    return fail(ZOPT_ERR_UNSUPPORTED, "zopt_comm_set_timeout: the %s engine has no timeout setting",
                comm->ops->name);
  if (comm->ops->set_timeout(comm->ctx, seconds) != ZOPT_COMM_OK)
    return fail(ZOPT_ERR_INVALID_ARGUMENT, "zopt_comm_set_timeout: the %s engine refused %g s: %s",
                comm->ops->name, seconds, engine_error(comm));
  comm->timeout_s = seconds;
  return ZOPT_OK;
}

ZOPT_API zopt_status zopt_comm_set_checks(zopt_comm *comm, int on) {
  if (!comm) return fail(ZOPT_ERR_INVALID_ARGUMENT, "zopt_comm_set_checks: communicator is NULL");
  if (on != 0 && on != 1) return fail(ZOPT_ERR_INVALID_ARGUMENT, "zopt_comm_set_checks: on is %d (0 or 1)", on);
  comm->checks = on != 0;
  return ZOPT_OK;
}

ZOPT_API zopt_status zopt_comm_all_to_all(zopt_comm *comm, const void *send, void *recv, size_t bytes_per_rank) {
  return comm_all_to_all(comm, send, recv, bytes_per_rank, "zopt_comm_all_to_all");
}

ZOPT_API zopt_status zopt_comm_all_gather(zopt_comm *comm, const void *send, void *recv, size_t bytes) {
  return comm_all_gather(comm, send, recv, bytes, "zopt_comm_all_gather");
}

ZOPT_API zopt_status zopt_comm_barrier(zopt_comm *comm) { return comm_barrier(comm, "zopt_comm_barrier"); }

ZOPT_API zopt_status zopt_comm_synchronize(zopt_comm *comm) {
  return comm_synchronize(comm, "zopt_comm_synchronize");
}
