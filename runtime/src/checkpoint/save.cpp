// checkpoint/save.cpp - saving: zopt_optimizer_save and the mechanism it
// shares with zopt_optimizer_save_linked (linked.cpp): one identity, every
// rank's file of every part written and fsync'd under a new name, the
// ranks agree, one rename commits (docs/CHECKPOINT.md "Saving: one commit
// point"; the set's names and the commit are set.cpp's).
#include "internal.h"

#include "checkpoint/format.h"
#include "checkpoint/image.h"
#include "checkpoint/set.h"

#include "backend/backend.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <string>
#include <vector>

using namespace zopt;

namespace {

bool write_all_at(int fd, const void *p, size_t n, uint64_t off) {
  const char *c = (const char *)p;
  while (n) {
    ssize_t w = ::pwrite(fd, c, n, (off_t)off);
    if (w < 0) {
      if (errno == EINTR) continue;
      return false;
    }
    c += w;
    n -= (size_t)w;
    off += (uint64_t)w;
  }
  return true;
}

// A rank's file of a save (a name no other save uses): written, fsync'd
// (finish); removed unless finished.
class FileSink : public ckpt::Sink {
 public:
  FileSink(std::string file, ckpt::Fault fault) : file_(std::move(file)), fault_(fault) {}
  ~FileSink() override {
    if (fd_ >= 0) {
      ::close(fd_);
      ::unlink(file_.c_str());
    }
  }
  zopt_status begin(uint64_t) override {
    fd_ = ::open(file_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd_ < 0) return fail(ZOPT_ERR_IO, "cannot create '%s': %s", file_.c_str(), strerror(errno));
    return ZOPT_OK;
  }
  zopt_status write_at(uint64_t off, const void *p, size_t n) override {
    if (fault_ == ckpt::Fault::kWrite) {  // test fault: the first write fails
      errno = EIO;
      return io_fail("cannot write");
    }
    if (!write_all_at(fd_, p, n, off)) return io_fail("cannot write");
    return ZOPT_OK;
  }
  // The file durable under its name (before the commit).
  zopt_status finish() {
    if (fault_ == ckpt::Fault::kFsync) errno = EIO;
    if (fault_ == ckpt::Fault::kFsync || ::fsync(fd_) != 0) return io_fail("cannot fsync");
    const int fd = fd_;
    fd_ = -1;
    if (::close(fd) != 0) {
      int e = errno;
      ::unlink(file_.c_str());
      return fail(ZOPT_ERR_IO, "cannot close '%s': %s", file_.c_str(), strerror(e));
    }
    ckpt::fsync_dir(file_);  // its name is durable before the commit
    return ZOPT_OK;
  }

 private:
  zopt_status io_fail(const char *what) {
    int e = errno;
    return fail(ZOPT_ERR_IO, "%s '%s': %s%s", what, file_.c_str(), strerror(e),
                fault_ == ckpt::Fault::kWrite || fault_ == ckpt::Fault::kFsync ? " (ZOPT_TEST_SAVE_FAULT)" : "");
  }
  std::string file_;
  ckpt::Fault fault_;
  int fd_ = -1;
};


}  // namespace

namespace zopt {
namespace ckpt {

zopt_status save_file(const zopt_optimizer *o, const std::string &file, const SaveId &id, Fault fault, bool linked,
                      const char *fn) {
  FileSink sink(file, fault);
  if (zopt_status st = write_image(o, id, false, sink, fn, true, linked)) return st;
  return sink.finish();
}

zopt_status save_parts(zopt_optimizer *const *parts, int n, const char *const *paths, const char *fn) {
  zopt_optimizer *o = parts[0];  // its communicator carries the save's collectives
  // Step counts and scaler from where the backend keeps them (the device:
  // waits for the stream).
  for (int i = 0; i < n; ++i)
    if (zopt_status st = parts[i]->backend->pull(parts[i])) return st;
  // docs/CHECKPOINT.md "Saving": one identity every rank agrees on (with
  // the check that every rank passed the same paths); every rank writes its
  // file of every part under a name of that identity (the previous sets
  // stay untouched) and fsyncs it; the ranks agree that all did; then one
  // rename on rank 0 commits the save (set.cpp, ckpt::commit).
  std::string key = paths[0];
  for (int i = 1; i < n; ++i) key += std::string(1, '\0') + paths[i];
  SaveId id;
  if (zopt_status st = agree_save_id(o, key, &id)) return st;
  int fault_part = 0;
  const Fault fault = save_fault(o->rank, &fault_part);
  const bool linked = n > 1;
  std::vector<std::string> mine((size_t)n);
  for (int i = 0; i < n; ++i) mine[(size_t)i] = set_file(paths[i], (uint32_t)o->rank, (uint32_t)o->world, id);
  zopt_status st = ZOPT_OK;
  for (int i = 0; i < n && !st; ++i) {
    const bool hit = i == fault_part && (fault == Fault::kWrite || fault == Fault::kFsync);
    st = save_file(parts[i], mine[(size_t)i], id, hit ? fault : Fault::kNone, linked, fn);
    if (st) {
      if (linked) st = fail(st, "part %d ('%s'): %s", i, paths[i], std::string(zopt_last_error()).c_str());
      for (int j = 0; j < i; ++j) ::unlink(mine[(size_t)j].c_str());  // (part i's: removed by its sink)
    }
  }
  if (fault == Fault::kDieEarly && !st) return die(o, "before the ranks agreed");
  bool lost = false;
  if (zopt_status ag = agree_status(o, st, "SAVE status", 0, &lost)) {
    if (!st)
      for (const std::string &f : mine) ::unlink(f.c_str());
    if (lost)  // a rank failed or stopped answering: nothing was committed
      return fail(ag,
                  "%s('%s'): a rank failed or stopped answering before the commit; the previous "
                  "checkpoint there (if any) is unchanged. The communicator: %s",
                  fn, paths[0], std::string(zopt_last_error()).c_str());
    return ag;
  }
  std::vector<std::string> ps(paths, paths + n);
  return commit(o, ps, mine, fault, fn);
}

}  // namespace ckpt
}  // namespace zopt

extern "C" {

ZOPT_API zopt_status zopt_optimizer_save(const zopt_optimizer *co, const char *path) {
  zopt_optimizer *o = const_cast<zopt_optimizer *>(co);
  ZOPT_ENTER_CALL(o, "zopt_optimizer_save");
  if (zopt_status st = check_idle(o, "zopt_optimizer_save")) return st;
  if (!path || !*path) return fail(ZOPT_ERR_INVALID_ARGUMENT, "zopt_optimizer_save: path is NULL or empty");
  if (!o->finalized) return fail(ZOPT_ERR_BAD_STATE, "zopt_optimizer_save: call zopt_optimizer_finalize first");
  return ckpt::save_parts(&o, 1, &path, "zopt_optimizer_save");
}

}  // extern "C"
