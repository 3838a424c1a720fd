// checkpoint.cpp - zopt_optimizer_save / zopt_optimizer_load.
// Format: docs/CHECKPOINT.md (little-endian, FNV-1a-64 checksums).
#include "internal.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <cerrno>
#include <cstdarg>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <libgen.h>

using namespace zopt;

namespace {

constexpr char kMagic[8] = {'Z', 'O', 'P', 'T', 'C', 'K', 'P', '1'};
constexpr uint32_t kFormatVersion = 1;
constexpr uint64_t kFnvInit = 1469598103934665603ull;
constexpr size_t kDataAlign = 64;

struct Writer {
  std::string buf;
  template <class T>
  void put(T v) {
    buf.append((const char *)&v, sizeof v);
  }
  void bytes(const void *p, size_t n) { buf.append((const char *)p, n); }
};

struct Reader {
  const unsigned char *p;
  size_t n, pos = 0;
  bool ok = true;
  template <class T>
  T get() {
    T v{};
    if (!ok || n - pos < sizeof v) {
      ok = false;
      return v;
    }
    memcpy(&v, p + pos, sizeof v);
    pos += sizeof v;
    return v;
  }
  void bytes(void *out, size_t k) {
    if (!ok || n - pos < k) {
      ok = false;
      return;
    }
    memcpy(out, p + pos, k);
    pos += k;
  }
};

struct StateRec {
  uint32_t kind, dtype;
  uint64_t bytes, offset, fnv;
};
struct TensorRec {
  uint32_t group;
  int64_t numel;
  std::vector<StateRec> states;
};
struct GroupRec {
  int64_t step_count;
  std::vector<std::pair<uint32_t, double>> hypers;
};

zopt_status ck_fail(const char *path, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
zopt_status ck_fail(const char *path, const char *fmt, ...) {
  char m[768];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(m, sizeof m, fmt, ap);
  va_end(ap);
  return fail(ZOPT_ERR_CHECKPOINT, "checkpoint '%s': %s", path, m);
}

bool write_all(int fd, const void *p, size_t n) {
  const char *c = (const char *)p;
  while (n) {
    ssize_t w = ::write(fd, c, n);
    if (w < 0) {
      if (errno == EINTR) continue;
      return false;
    }
    c += w;
    n -= (size_t)w;
  }
  return true;
}

}  // namespace

extern "C" {

ZOPT_API zopt_status zopt_optimizer_save(const zopt_optimizer *o, const char *path) {
  if (!o) return fail(ZOPT_ERR_INVALID_ARGUMENT, "zopt_optimizer_save: optimizer is NULL");
  if (!path || !*path) return fail(ZOPT_ERR_INVALID_ARGUMENT, "zopt_optimizer_save: path is NULL or empty");
  if (!o->finalized) return fail(ZOPT_ERR_BAD_STATE, "zopt_optimizer_save: call zopt_optimizer_finalize first");
  if (o->gpu)  // step counts and scaler from the device (waits for the stream)
    if (zopt_status st = gpu_pull(const_cast<zopt_optimizer *>(o))) return st;
  const zopt_step_descriptor *d = o->d;
  // The bytes of state s of tensor t: in place for CPU states, staged
  // through `staging` for GPU ones (each state is read twice, for the
  // header's checksum and for the data, so no whole-model host copy).
  std::vector<unsigned char> staging;
  auto state_bytes = [&](size_t t, uint32_t s, const void **out) -> zopt_status {
    size_t bytes = (size_t)o->tensors[t].numel * dtype_size(d->states[s].dtype);
    if (!o->gpu) {
      *out = state_ptr(o, (int)t, (int)s);
      return ZOPT_OK;
    }
    try {
      staging.resize(bytes);
    } catch (...) {
      return fail(ZOPT_ERR_OUT_OF_MEMORY, "zopt_optimizer_save: out of host memory");
    }
    *out = staging.data();
    return gpu_copy(o, (int)t, (int)s, staging.data(), bytes, false);
  };
  Writer w;
  try {
    w.bytes(kMagic, 8);
    w.put<uint32_t>(kFormatVersion);
    w.put<uint32_t>(0);  // flags, reserved
    w.put<uint64_t>(d->checksum);
    w.bytes(d->name, ZOPT_NAME_LEN);
    w.put<uint32_t>((uint32_t)o->groups.size());
    w.put<uint32_t>((uint32_t)o->tensors.size());
    const LossScaler &ls = o->scaler;
    w.put<double>(ls.scale);
    w.put<int64_t>(ls.good_steps);
    w.put<double>(ls.cfg.init_scale);
    w.put<double>(ls.cfg.growth_factor);
    w.put<double>(ls.cfg.backoff_factor);
    w.put<int64_t>(ls.cfg.growth_interval);
    w.put<double>(ls.cfg.min_scale);
    w.put<uint32_t>((uint32_t)ls.cfg.dynamic);
    w.put<uint32_t>(0);
    for (const Group &g : o->groups) {
      w.put<int64_t>(g.step_count);
      w.put<uint32_t>(d->num_hypers);
      w.put<uint32_t>(0);
      for (uint32_t h = 0; h < d->num_hypers; ++h) {
        w.put<uint32_t>(d->hypers[h].kind);
        w.put<uint32_t>(0);
        w.put<double>(g.hypers[h]);
      }
    }
    // Tensor table; data offsets are computed after the header size is known.
    uint32_t nowned = 0;
    for (uint32_t s = 0; s < d->num_states; ++s) nowned += is_owned_kind(d->states[s].kind);
    size_t table_pos = w.buf.size();
    size_t header_size = table_pos + o->tensors.size() * (16 + (size_t)nowned * 32) + 8;
    uint64_t off = (header_size + kDataAlign - 1) / kDataAlign * kDataAlign;
    for (size_t t = 0; t < o->tensors.size(); ++t) {
      const Tensor &x = o->tensors[t];
      w.put<uint32_t>((uint32_t)x.group);
      w.put<uint32_t>(nowned);
      w.put<int64_t>(x.numel);
      for (uint32_t s = 0; s < d->num_states; ++s) {
        if (!is_owned_kind(d->states[s].kind)) continue;
        uint64_t bytes = (uint64_t)x.numel * dtype_size(d->states[s].dtype);
        w.put<uint32_t>(d->states[s].kind);
        w.put<uint32_t>(d->states[s].dtype);
        w.put<uint64_t>(bytes);
        w.put<uint64_t>(off);
        const void *p = nullptr;
        if (zopt_status st = state_bytes(t, s, &p)) return st;
        w.put<uint64_t>(fnv1a64(p, bytes));
        off = (off + bytes + kDataAlign - 1) / kDataAlign * kDataAlign;
      }
    }
    w.put<uint64_t>(off);  // end of data = offset of the trailing checksum
    if (w.buf.size() != header_size) return fail(ZOPT_ERR_INTERNAL, "checkpoint header size mismatch");
  } catch (...) {
    return fail(ZOPT_ERR_OUT_OF_MEMORY, "zopt_optimizer_save: out of memory");
  }

  std::string tmp = std::string(path) + ".tmp";
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return fail(ZOPT_ERR_IO, "cannot create '%s': %s", tmp.c_str(), strerror(errno));
  auto io_fail = [&](const char *what) {
    int e = errno;
    ::close(fd);
    ::unlink(tmp.c_str());
    return fail(ZOPT_ERR_IO, "%s '%s': %s", what, tmp.c_str(), strerror(e));
  };
  static const char zeros[kDataAlign] = {0};
  uint64_t h = fnv1a64(w.buf.data(), w.buf.size(), kFnvInit);
  uint64_t pos = w.buf.size();
  if (!write_all(fd, w.buf.data(), w.buf.size())) return io_fail("cannot write");
  auto pad_to = [&](uint64_t target) {
    while (pos < target) {
      size_t k = (size_t)std::min<uint64_t>(target - pos, kDataAlign);
      h = fnv1a64(zeros, k, h);
      if (!write_all(fd, zeros, k)) return false;
      pos += k;
    }
    return true;
  };
  for (size_t t = 0; t < o->tensors.size(); ++t) {
    for (uint32_t s = 0; s < d->num_states; ++s) {
      if (!is_owned_kind(d->states[s].kind)) continue;
      if (!pad_to((pos + kDataAlign - 1) / kDataAlign * kDataAlign)) return io_fail("cannot write");
      size_t bytes = (size_t)o->tensors[t].numel * dtype_size(d->states[s].dtype);
      const void *p = nullptr;
      if (zopt_status st = state_bytes(t, s, &p)) {
        ::close(fd);
        ::unlink(tmp.c_str());
        return st;
      }
      h = fnv1a64(p, bytes, h);
      if (!write_all(fd, p, bytes)) return io_fail("cannot write");
      pos += bytes;
    }
  }
  if (!pad_to((pos + kDataAlign - 1) / kDataAlign * kDataAlign)) return io_fail("cannot write");
  if (!write_all(fd, &h, sizeof h)) return io_fail("cannot write");
  if (::fsync(fd) != 0) return io_fail("cannot fsync");
  if (::close(fd) != 0) {
    int e = errno;
    ::unlink(tmp.c_str());
    return fail(ZOPT_ERR_IO, "cannot close '%s': %s", tmp.c_str(), strerror(e));
  }
  if (::rename(tmp.c_str(), path) != 0) {
    int e = errno;
    ::unlink(tmp.c_str());
    return fail(ZOPT_ERR_IO, "cannot rename '%s' to '%s': %s", tmp.c_str(), path, strerror(e));
  }
  // Make the rename durable.
  std::string dir = path;
  size_t slash = dir.rfind('/');
  dir = slash == std::string::npos ? "." : (slash == 0 ? "/" : dir.substr(0, slash));
  int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    ::fsync(dfd);
    ::close(dfd);
  }
  return ZOPT_OK;
}

ZOPT_API zopt_status zopt_optimizer_load(zopt_optimizer *o, const char *path) {
  if (!o) return fail(ZOPT_ERR_INVALID_ARGUMENT, "zopt_optimizer_load: optimizer is NULL");
  if (!path || !*path) return fail(ZOPT_ERR_INVALID_ARGUMENT, "zopt_optimizer_load: path is NULL or empty");
  if (!o->finalized) return fail(ZOPT_ERR_BAD_STATE, "zopt_optimizer_load: call zopt_optimizer_finalize first");
  const zopt_step_descriptor *d = o->d;

  // 1. Read the whole file (64-byte aligned buffer).
  int fd = ::open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return fail(ZOPT_ERR_IO, "cannot open checkpoint '%s': %s", path, strerror(errno));
  struct stat st;
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    return fail(ZOPT_ERR_IO, "checkpoint '%s' is not a regular file", path);
  }
  size_t n = (size_t)st.st_size;
  if (n < 8 + 8) {
    ::close(fd);
    return ck_fail(path, "file is %zu bytes, too short to be a checkpoint", n);
  }
  void *raw = nullptr;
  if (posix_memalign(&raw, 64, n) != 0 || !raw) {
    ::close(fd);
    return fail(ZOPT_ERR_OUT_OF_MEMORY, "cannot allocate %zu bytes to read checkpoint '%s'", n, path);
  }
  struct Free {
    void *p;
    ~Free() { free(p); }
  } guard{raw};
  unsigned char *buf = (unsigned char *)raw;
  size_t got = 0;
  while (got < n) {
    ssize_t r = ::read(fd, buf + got, n - got);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) {
      int e = errno;
      ::close(fd);
      return fail(ZOPT_ERR_IO, "cannot read checkpoint '%s': %s", path, r == 0 ? "unexpected end of file" : strerror(e));
    }
    got += (size_t)r;
  }
  ::close(fd);

  // 2. Validate the file on its own.
  if (memcmp(buf, kMagic, 8) != 0) return ck_fail(path, "bad magic (not a zopt checkpoint)");
  uint32_t version;
  memcpy(&version, buf + 8, 4);
  if (version != kFormatVersion)
    return ck_fail(path, "format version %u, this runtime reads version %u", version, kFormatVersion);
  uint64_t stored_sum;
  memcpy(&stored_sum, buf + n - 8, 8);
  uint64_t sum = fnv1a64(buf, n - 8, kFnvInit);
  if (sum != stored_sum)
    return ck_fail(path, "file checksum mismatch (corrupt or truncated: stored %016llx, computed %016llx)",
                   (unsigned long long)stored_sum, (unsigned long long)sum);
  Reader r{buf, n - 8};
  r.pos = 16;
  uint64_t desc_sum = r.get<uint64_t>();
  char name[ZOPT_NAME_LEN + 1] = {0};
  r.bytes(name, ZOPT_NAME_LEN);
  uint32_t ngroups = r.get<uint32_t>();
  uint32_t ntensors = r.get<uint32_t>();
  LossScaler ls;
  ls.scale = r.get<double>();
  ls.good_steps = r.get<int64_t>();
  ls.cfg.init_scale = r.get<double>();
  ls.cfg.growth_factor = r.get<double>();
  ls.cfg.backoff_factor = r.get<double>();
  ls.cfg.growth_interval = r.get<int64_t>();
  ls.cfg.min_scale = r.get<double>();
  ls.cfg.dynamic = (int)r.get<uint32_t>();
  r.get<uint32_t>();
  if (!r.ok) return ck_fail(path, "truncated header");
  if (ngroups != o->groups.size())
    return ck_fail(path, "has %u groups, the optimizer has %zu", ngroups, o->groups.size());
  if (ntensors != o->tensors.size())
    return ck_fail(path, "has %u tensors, the optimizer has %zu", ntensors, o->tensors.size());
  if (!(std::isfinite(ls.scale) && ls.scale > 0) || ls.good_steps < 0 || !(std::isfinite(ls.cfg.init_scale) && ls.cfg.init_scale > 0) ||
      (ls.cfg.dynamic != 0 && ls.cfg.dynamic != 1) ||
      (ls.cfg.dynamic && (!(ls.cfg.growth_factor >= 1 && std::isfinite(ls.cfg.growth_factor)) ||
                          !(ls.cfg.backoff_factor > 0 && ls.cfg.backoff_factor < 1) || ls.cfg.growth_interval < 1 ||
                          !(ls.cfg.min_scale > 0 && std::isfinite(ls.cfg.min_scale)))))
    return ck_fail(path, "invalid loss-scaler state (scale %g, good steps %lld)", ls.scale, (long long)ls.good_steps);
  std::vector<GroupRec> groups;
  std::vector<TensorRec> tensors;
  try {
    groups.resize(ngroups);
    for (uint32_t g = 0; g < ngroups; ++g) {
      groups[g].step_count = r.get<int64_t>();
      uint32_t nh = r.get<uint32_t>();
      r.get<uint32_t>();
      if (!r.ok || nh > ZOPT_MAX_HYPERS) return ck_fail(path, "group %u: bad hyperparameter table", g);
      if (groups[g].step_count < 0) return ck_fail(path, "group %u: negative step count", g);
      for (uint32_t h = 0; h < nh; ++h) {
        uint32_t kind = r.get<uint32_t>();
        r.get<uint32_t>();
        double v = r.get<double>();
        if (kind < ZOPT_HYPER_LR || kind > ZOPT_HYPER_BIAS_CORRECTION)
          return ck_fail(path, "group %u: unknown hyperparameter kind %u", g, kind);
        int hi = hyper_index(d, kind);
        if (hi >= 0) {
          const zopt_hyper_desc &hd = d->hypers[hi];
          bool ok = !std::isnan(v) && v >= hd.min_value && (hd.max_exclusive ? v < hd.max_value : v <= hd.max_value);
          if (!ok) return ck_fail(path, "group %u: %s = %g out of the step's range", g, hyper_name(kind), v);
        }
        groups[g].hypers.emplace_back(kind, v);
      }
    }
    tensors.resize(ntensors);
    for (uint32_t t = 0; t < ntensors; ++t) {
      TensorRec &tr = tensors[t];
      tr.group = r.get<uint32_t>();
      uint32_t ns = r.get<uint32_t>();
      tr.numel = r.get<int64_t>();
      if (!r.ok || ns > ZOPT_MAX_STATES) return ck_fail(path, "tensor %u: bad state table", t);
      const Tensor &x = o->tensors[t];
      if (tr.group != (uint32_t)x.group)
        return ck_fail(path, "tensor %u is in group %u, in the optimizer in group %d", t, tr.group, x.group);
      if (tr.numel != x.numel)
        return ck_fail(path, "tensor %u has %lld elements, the optimizer's has %lld", t, (long long)tr.numel,
                       (long long)x.numel);
      unsigned seen = 0;
      for (uint32_t s = 0; s < ns; ++s) {
        StateRec sr;
        sr.kind = r.get<uint32_t>();
        sr.dtype = r.get<uint32_t>();
        sr.bytes = r.get<uint64_t>();
        sr.offset = r.get<uint64_t>();
        sr.fnv = r.get<uint64_t>();
        if (!r.ok) return ck_fail(path, "truncated tensor table");
        if (sr.kind < ZOPT_STATE_PARAM || sr.kind > ZOPT_STATE_MOMENTUM_BUFFER)
          return ck_fail(path, "tensor %u: unknown state kind %u", t, sr.kind);
        if (seen & (1u << sr.kind)) return ck_fail(path, "tensor %u: state %s stored twice", t, state_kind_name(sr.kind));
        seen |= 1u << sr.kind;
        size_t es = dtype_size(sr.dtype);
        if (!es) return ck_fail(path, "tensor %u state %s: unknown dtype %u", t, state_kind_name(sr.kind), sr.dtype);
        if (sr.bytes != (uint64_t)tr.numel * es)
          return ck_fail(path, "tensor %u state %s: %llu bytes for %lld %s elements", t, state_kind_name(sr.kind),
                         (unsigned long long)sr.bytes, (long long)tr.numel, dtype_name(sr.dtype));
        if (sr.offset % kDataAlign || sr.offset > n - 8 || sr.bytes > n - 8 - sr.offset)
          return ck_fail(path, "tensor %u state %s: data outside the file", t, state_kind_name(sr.kind));
        if (fnv1a64(buf + sr.offset, sr.bytes) != sr.fnv)
          return ck_fail(path, "tensor %u state %s: data checksum mismatch", t, state_kind_name(sr.kind));
        tr.states.push_back(sr);
      }
    }
    uint64_t end = r.get<uint64_t>();
    if (!r.ok || end != n - 8) return ck_fail(path, "data size mismatch (truncated or extended file)");
  } catch (...) {
    return fail(ZOPT_ERR_OUT_OF_MEMORY, "zopt_optimizer_load: out of memory");
  }

  // 3. Match against the optimizer: every runtime-owned state must be in the
  // file (any dtype: converted via f32), except MAX_EXP_AVG_SQ and
  // MOMENTUM_BUFFER, which start at zero when absent.
  bool same_step = desc_sum == d->checksum && strncmp(name, d->name, ZOPT_NAME_LEN) == 0;
  for (uint32_t t = 0; t < ntensors; ++t) {
    for (uint32_t s = 0; s < d->num_states; ++s) {
      uint32_t kind = d->states[s].kind;
      if (!is_owned_kind(kind)) continue;
      const StateRec *found = nullptr;
      for (const StateRec &sr : tensors[t].states)
        if (sr.kind == kind) found = &sr;
      if (!found && kind != ZOPT_STATE_MAX_EXP_AVG_SQ && kind != ZOPT_STATE_MOMENTUM_BUFFER)
        return ck_fail(path, "tensor %u: state %s missing (written by step '%s'%s)", t, state_kind_name(kind), name,
                       same_step ? "" : ", a different step");
    }
  }

  // 4. Apply. Cannot fail for CPU states; GPU states go through a host
  // staging buffer and a copy, which fails only if the device does (then
  // the optimizer's state is undefined: the CUDA context is unusable).
  std::vector<unsigned char> staging;
  if (o->gpu) {
    size_t most = 0;
    for (uint32_t t = 0; t < ntensors; ++t)
      for (uint32_t s = 0; s < d->num_states; ++s)
        if (is_owned_kind(d->states[s].kind))
          most = std::max(most, (size_t)tensors[t].numel * dtype_size(d->states[s].dtype));
    try {
      staging.resize(most);
    } catch (...) {
      return ck_fail(path, "out of host memory for staging");
    }
  }
  for (uint32_t t = 0; t < ntensors; ++t) {
    for (uint32_t s = 0; s < d->num_states; ++s) {
      uint32_t kind = d->states[s].kind;
      if (!is_owned_kind(kind)) continue;
      size_t bytes = (size_t)tensors[t].numel * dtype_size(d->states[s].dtype);
      void *dst = o->gpu ? (void *)staging.data() : state_ptr(o, (int)t, (int)s);
      const StateRec *found = nullptr;
      for (const StateRec &sr : tensors[t].states)
        if (sr.kind == kind) found = &sr;
      if (found)
        convert(buf + found->offset, found->dtype, dst, d->states[s].dtype, tensors[t].numel);
      else
        memset(dst, 0, bytes);
      if (o->gpu)
        if (zopt_status st = gpu_copy(o, (int)t, (int)s, dst, bytes, true)) return st;
    }
  }
  for (uint32_t g = 0; g < ngroups; ++g) {
    o->groups[g].step_count = groups[g].step_count;
    for (auto &kv : groups[g].hypers) {
      int hi = hyper_index(d, kv.first);
      if (hi >= 0) o->groups[g].hypers[hi] = kv.second;
    }
  }
  o->scaler = ls;
  if (o->gpu) {  // step counts, scaler and hyperparameters to the device
    gpu_hypers_changed(o);
    return gpu_push(o);
  }
  return ZOPT_OK;
}

}  // extern "C"
