// checkpoint/set.cpp - the files of a checkpoint set, the save's identity and
// the commit of a multi-rank save (set.h; docs/CHECKPOINT.md "Saving").
#include "checkpoint/set.h"

#include "comm/comm_internal.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/random.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

namespace zopt {
namespace ckpt {

std::string hex(const SaveId &id) {
  static const char digits[] = "0123456789abcdef";
  std::string s;
  for (unsigned char c : id.b) {
    s += digits[c >> 4];
    s += digits[c & 15];
  }
  return s;
}

std::string set_file(const std::string &path, uint32_t r, uint32_t W, const SaveId &id) {
  return path + "." + std::to_string(r) + "-of-" + std::to_string(W) + "." + hex(id);
}

std::string v2_file(const std::string &path, uint32_t r, uint32_t W) {
  if (r == 0) return path;
  return path + "." + std::to_string(r) + "-of-" + std::to_string(W);
}

zopt_status agree_status(zopt_optimizer *o, zopt_status st, const char *what, uint32_t sig_flags, bool *no_exchange) {
  if (no_exchange) *no_exchange = false;
  if (o->world == 1) return st;
  struct Msg {
    int32_t status;
    char text[1020];
  } mine{};
  mine.status = (int32_t)st;
  if (st) snprintf(mine.text, sizeof mine.text, "%s", zopt_last_error());
  std::vector<Msg> all((size_t)o->world);
  if (zopt_status cst = comm_all_gather(o->comm, &mine, all.data(), sizeof mine, what, sig_flags)) {
    if (no_exchange) *no_exchange = true;
    return cst;
  }
  for (int q = 0; q < o->world; ++q)
    if (all[(size_t)q].status) {
      all[(size_t)q].text[sizeof all[(size_t)q].text - 1] = 0;
      return fail((zopt_status)all[(size_t)q].status, "rank %d: %s", q, all[(size_t)q].text);
    }
  return ZOPT_OK;
}

Fault save_fault(int rank, int *part) {
  if (part) *part = 0;
  const char *e = getenv("ZOPT_TEST_SAVE_FAULT");
  if (!e || !*e) return Fault::kNone;
  char *end = nullptr;
  long r = strtol(e, &end, 10);
  if (end == e || *end != ':' || r != rank) return Fault::kNone;
  std::string stage = end + 1;
  const size_t colon = stage.find(':');
  if (colon != std::string::npos) {  // :<part>
    if (part) *part = atoi(stage.c_str() + colon + 1);
    stage.resize(colon);
  }
  if (stage == "write") return Fault::kWrite;
  if (stage == "fsync") return Fault::kFsync;
  if (stage == "rename") return Fault::kRename;
  if (stage == "die") return Fault::kDie;
  if (stage == "die-early") return Fault::kDieEarly;
  if (stage == "after-commit") return Fault::kAfterCommit;
  return Fault::kNone;
}

namespace {

void random_id(SaveId *id) {
  size_t got = 0;
  while (got < kSaveIdBytes) {
    ssize_t n = getrandom(id->b + got, kSaveIdBytes - got, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    got += (size_t)n;
  }
  if (got == kSaveIdBytes) return;
  // No getrandom (an old kernel or a seccomp filter): the C++ library's
  // source, mixed with the time and the address space.
  std::random_device rd;
  uint64_t t = (uint64_t)std::chrono::steady_clock::now().time_since_epoch().count() ^ (uint64_t)(uintptr_t)id;
  for (size_t i = 0; i < kSaveIdBytes; i += 4) {
    uint32_t v = rd() ^ (uint32_t)(t >> (i * 2));
    memcpy(id->b + i, &v, 4);
  }
}

// "123" -> 123; false for an empty string, a leading zero (but "0") or
// anything that is not a decimal number below 2^31.
bool decimal(const std::string &s, long *out) {
  if (s.empty() || s.size() > 10 || (s.size() > 1 && s[0] == '0')) return false;
  long v = 0;
  for (char c : s) {
    if (c < '0' || c > '9') return false;
    v = v * 10 + (c - '0');
  }
  if (v > 0x7fffffff) return false;
  *out = v;
  return true;
}

}  // namespace

void fsync_dir(const std::string &path) {
  size_t slash = path.rfind('/');
  std::string dir = slash == std::string::npos ? "." : (slash == 0 ? "/" : path.substr(0, slash));
  int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    ::fsync(dfd);
    ::close(dfd);
  }
}

zopt_status agree_save_id(zopt_optimizer *o, const std::string &key, SaveId *id, const char *what) {
  if (o->rank == 0) random_id(id);
  if (o->world == 1) return ZOPT_OK;
  struct Msg {
    unsigned char id[kSaveIdBytes];
    uint64_t path_hash;
  } mine{}, *all = nullptr;
  memcpy(mine.id, id->b, kSaveIdBytes);
  mine.path_hash = fnv1a64(key.data(), key.size());
  std::vector<Msg> v((size_t)o->world);
  all = v.data();
  // The save's first collective: nothing written yet (kSigUnchanged).
  if (zopt_status st = comm_all_gather(o->comm, &mine, all, sizeof mine, what, kSigUnchanged)) return st;
  memcpy(id->b, all[0].id, kSaveIdBytes);
  std::string bad;
  for (int q = 1; q < o->world; ++q)
    if (all[q].path_hash != all[0].path_hash) bad += (bad.empty() ? "" : ", ") + std::to_string(q);
  if (!bad.empty())
    return fail(ZOPT_ERR_INVALID_ARGUMENT,
                "zopt_optimizer_save: rank(s) %s passed another path than rank 0: every rank must pass the same "
                "path (rank 0's file there names the set; the other ranks' files are found next to it)",
                bad.c_str());
  return ZOPT_OK;
}

zopt_status die(zopt_optimizer *o, const char *when) {
  // This rank stops answering (as a dead process would): its communicator
  // is poisoned and aborted, so that its peers fail promptly (loopback).
  zopt_comm *c = o->comm;
  if (c && !c->poisoned) {
    c->poisoned = true;
    c->first_error = "ZOPT_TEST_SAVE_FAULT: this rank died during a save";
    if (c->ops->abort) c->ops->abort(c->ctx);
  }
  return fail(ZOPT_ERR_COMM, "zopt_optimizer_save: ZOPT_TEST_SAVE_FAULT: rank %d died %s", o->rank, when);
}

zopt_status commit(zopt_optimizer *o, const std::vector<std::string> &paths, const std::vector<std::string> &mine,
                   Fault fault, const char *fn) {
  if (fault == Fault::kDie) return die(o, "during the commit");
  const size_t n = paths.size();
  const char *path = paths[0].c_str();
  // The commit point: one rename, on rank 0, of part 0's file.
  zopt_status st = ZOPT_OK;
  std::vector<bool> kept(n, false);  // rank 0: a part's file left under its set name
  if (o->rank == 0) {
    int e = 0;
    if (fault == Fault::kRename)
      e = EIO;
    else if (::rename(mine[0].c_str(), path) != 0)
      e = errno;
    if (e) {
      ::unlink(mine[0].c_str());
      st = fail(ZOPT_ERR_IO, "%s: cannot rename '%s' to '%s' (the commit): %s%s; the previous "
                             "checkpoint there (if any) is unchanged",
                fn, mine[0].c_str(), path, strerror(e), fault == Fault::kRename ? " (ZOPT_TEST_SAVE_FAULT)" : "");
    } else {
      fsync_dir(path);
      if (fault == Fault::kAfterCommit) return die(o, "after the commit, before the renames of the other parts");
      // Committed. The other parts' files to their paths: not the commit
      // (a load finds a file whose rename failed under its set name, which
      // is kept).
      for (size_t i = 1; i < n; ++i) {
        if (::rename(mine[i].c_str(), paths[i].c_str()) != 0)
          kept[i] = true;
        else
          fsync_dir(paths[i]);
      }
    }
  }
  // Every rank learns the outcome (rank 0's rename), with the same message.
  bool lost = false;
  st = agree_status(o, st, "SAVE commit outcome", 0, &lost);
  if (lost) {
    std::string why = zopt_last_error();
    return fail(ZOPT_ERR_COMM,
                "%s('%s'): a rank failed or stopped answering during the commit, so the ranks "
                "cannot agree on its outcome. '%s' names a whole checkpoint set (this save's if rank 0 had "
                "committed it, else the previous one); files of the other set stay until the next save. The "
                "communicator: %s",
                fn, path, path, why.c_str());
  }
  if (st) {
    for (const std::string &f : mine) ::unlink(f.c_str());  // not committed: the previous set stays
    return st;
  }
  // Committed: the files of older sets (and of failed saves) go now.
  for (size_t i = 0; i < n; ++i) {
    const size_t slash = mine[i].rfind('/');
    const std::string base = mine[i].substr(slash == std::string::npos ? 0 : slash + 1);
    remove_strays(paths[i], o->rank, o->world, o->rank == 0 && !kept[i] ? std::string() : base);
  }
  return ZOPT_OK;
}

void remove_strays(const std::string &path, int rank, int W, const std::string &keep) {
  const size_t slash = path.rfind('/');
  const std::string dir = slash == std::string::npos ? "." : (slash == 0 ? "/" : path.substr(0, slash));
  const std::string base = (slash == std::string::npos ? path : path.substr(slash + 1)) + ".";
  DIR *d = ::opendir(dir.c_str());
  if (!d) return;
  std::vector<std::string> doomed;
  while (struct dirent *e = ::readdir(d)) {
    const std::string name = e->d_name;
    if (name.compare(0, base.size(), base) != 0 || name == keep) continue;
    const std::string rest = name.substr(base.size());
    long owner = -1;
    if (rest == "tmp") {
      owner = 0;  // a format-2 save's rank-0 temporary
    } else {
      // <q>-of-<N>, then nothing (format 2), ".tmp" (format 2's temporary)
      // or "." and 32 hex digits (format 3).
      const size_t of = rest.find("-of-");
      if (of == std::string::npos) continue;
      const size_t dot = rest.find('.', of);
      const std::string tail = dot == std::string::npos ? "" : rest.substr(dot + 1);
      long q = 0, n = 0;
      if (!decimal(rest.substr(0, of), &q) || !decimal(rest.substr(of + 4, dot == std::string::npos ? std::string::npos
                                                                                                        : dot - of - 4),
                                                       &n) ||
          q >= n)
        continue;
      bool ok = dot == std::string::npos || tail == "tmp";
      if (!ok && tail.size() == 2 * kSaveIdBytes) {
        ok = true;
        for (char c : tail) ok = ok && ((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'));
      }
      if (!ok) continue;
      owner = q % W;
    }
    if (owner == rank) doomed.push_back(dir + "/" + name);
  }
  ::closedir(d);
  for (const std::string &f : doomed) ::unlink(f.c_str());
}

}  // namespace ckpt
}  // namespace zopt
