// checkpoint/format.cpp - the checkpoint format's reader (format.h): a
// file's header and piece table parsed and checked, from a file or from an
// image in memory; format 2 and format 1 files too.
#include "checkpoint/format.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstdarg>
#include <cstdio>

namespace zopt {
namespace ckpt {

namespace {

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

bool read_at(int fd, void *p, size_t n, uint64_t off) {
  char *c = (char *)p;
  while (n) {
    ssize_t r = ::pread(fd, c, n, (off_t)off);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return false;
    c += r;
    n -= (size_t)r;
    off += (uint64_t)r;
  }
  return true;
}

// The loss scaler's fields, in the order every format version stores them
// (docs/CHECKPOINT.md): scale, good steps, then the configuration.
void read_scaler(Reader &r, LossScaler &ls) {
  ls.scale = r.get<double>();
  ls.good_steps = r.get<int64_t>();
  ls.cfg.init_scale = r.get<double>();
  ls.cfg.growth_factor = r.get<double>();
  ls.cfg.backoff_factor = r.get<double>();
  ls.cfg.growth_interval = r.get<int64_t>();
  ls.cfg.min_scale = r.get<double>();
  ls.cfg.dynamic = (int)r.get<uint32_t>();
}

bool valid_scaler(const LossScaler &ls) {
  const zopt_loss_scaler_config &c = ls.cfg;
  return std::isfinite(ls.scale) && ls.scale > 0 && ls.good_steps >= 0 && std::isfinite(c.init_scale) &&
         c.init_scale > 0 && (c.dynamic == 0 || c.dynamic == 1) &&
         (!c.dynamic || (c.growth_factor >= 1 && std::isfinite(c.growth_factor) && c.backoff_factor > 0 &&
                         c.backoff_factor < 1 && c.growth_interval >= 1 && c.min_scale > 0 &&
                         std::isfinite(c.min_scale)));
}

}  // namespace

zopt_status ck_fail(const std::string &path, const char *fmt, ...) {
  char m[768];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(m, sizeof m, fmt, ap);
  va_end(ap);
  return fail(ZOPT_ERR_CHECKPOINT, "checkpoint '%s': %s", path.c_str(), m);
}

bool read_at(const File &f, void *p, size_t n, uint64_t off) {
  if (!f.mem) return read_at(f.fd, p, n, off);
  if (off > f.size || n > f.size - off) return false;
  if (n) memcpy(p, f.mem + off, n);
  return true;
}

// ---- reading ---------------------------------------------------------------

// A file's header (an image in memory: f.mem and f.size set; `path` its label).
zopt_status read_header(File &f, const std::string &path) {
  f.path = path;
  if (!f.mem) {
    f.fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (f.fd < 0) return fail(ZOPT_ERR_IO, "cannot open checkpoint '%s': %s", path.c_str(), strerror(errno));
    struct stat st;
    if (fstat(f.fd, &st) != 0 || !S_ISREG(st.st_mode))
      return fail(ZOPT_ERR_IO, "checkpoint '%s' is not a regular file", path.c_str());
    f.size = (uint64_t)st.st_size;
  }
  unsigned char fixed[24];
  if (f.size < sizeof fixed || !read_at(f, fixed, sizeof fixed, 0))
    return ck_fail(path, "file is %llu bytes, too short to be a checkpoint", (unsigned long long)f.size);
  if (memcmp(fixed, kMagic1, 8) == 0) {
    f.version = 1;
    return ZOPT_OK;  // read_v1 reads the rest
  }
  if (memcmp(fixed, kMagic2, 8) != 0) return ck_fail(path, "bad magic (not a zopt checkpoint)");
  uint32_t version, flags;
  uint64_t hsize;
  memcpy(&version, fixed + 8, 4);
  memcpy(&flags, fixed + 12, 4);
  memcpy(&hsize, fixed + 16, 8);
  if (version != 2 && version != kVersion)
    return ck_fail(path, "format version %u, this runtime reads versions 1 to %u", version, kVersion);
  if ((flags & kFlagNoChecksums) && !f.mem)
    return ck_fail(path,
                   "flags 0x%x: an image without piece checksums (ZOPT_EXPORT_NO_CHECKSUMS) is only read from "
                   "memory by the process that exported it, never from a file: export it with checksums (flags "
                   "without ZOPT_EXPORT_NO_CHECKSUMS) or save it with zopt_optimizer_save to keep it",
                   flags);
  if (flags & ~(kFlagNoChecksums | kFlagLinked))
    return ck_fail(path, "flags 0x%x: bits this runtime does not know (a newer writer?)", flags);
  if ((flags & kFlagLinked) && version < 3)
    return ck_fail(path, "flags 0x%x: a format %u file cannot be a part of a linked save (it has no identity)", flags,
                   version);
  f.checksums = !(flags & kFlagNoChecksums);
  f.linked = flags & kFlagLinked;
  if (hsize < 24 || hsize > f.size - 8 || hsize > (uint64_t)1 << 34)
    return ck_fail(path, "header size %llu outside the file", (unsigned long long)hsize);
  std::vector<unsigned char> h;
  try {
    h.resize((size_t)hsize + 8);
  } catch (...) {
    return fail(ZOPT_ERR_OUT_OF_MEMORY, "cannot read the header of checkpoint '%s'", path.c_str());
  }
  if (!read_at(f, h.data(), h.size(), 0)) return ck_fail(path, "truncated header");
  uint64_t stored;
  memcpy(&stored, h.data() + hsize, 8);
  if (fnv1a64(h.data(), (size_t)hsize) != stored)
    return ck_fail(path, "header checksum mismatch (corrupt or truncated)");
  Reader r{h.data(), (size_t)hsize};
  r.pos = 24;
  f.version = version;
  // Reserved fields (docs/CHECKPOINT.md: "pad u32, 0") must be 0, like
  // flags: a file with something there was not written by this format.
  const char *bad_pad = nullptr;
  auto pad = [&](const char *where) {
    if (r.get<uint32_t>() != 0 && r.ok && !bad_pad) bad_pad = where;
  };
  f.desc_sum = r.get<uint64_t>();
  r.bytes(f.name, ZOPT_NAME_LEN);
  f.world = r.get<uint32_t>();
  f.rank = r.get<uint32_t>();
  if (version >= 3) r.bytes(f.id.b, ckpt::kSaveIdBytes);
  uint32_t ngroups = r.get<uint32_t>(), ntensors = r.get<uint32_t>();
  LossScaler &ls = f.scaler;
  read_scaler(r, ls);
  pad("the loss scaler's");
  f.seed = r.get<uint64_t>();
  f.has_seed = true;
  uint32_t nkinds = r.get<uint32_t>();
  pad("the state kinds'");
  if (!r.ok) return ck_fail(path, "truncated header");
  if (f.world < 1 || f.world > kMaxRanks || f.rank >= f.world)
    return ck_fail(path, "rank %u of world size %u out of range", f.rank, f.world);
  if (!valid_scaler(ls))
    return ck_fail(path, "invalid loss-scaler state (scale %g, good steps %lld)", ls.scale, (long long)ls.good_steps);
  if (nkinds > ZOPT_MAX_STATES) return ck_fail(path, "%u state kinds", nkinds);
  try {
    for (uint32_t i = 0; i < nkinds; ++i) {
      KindRec k{r.get<uint32_t>(), r.get<uint32_t>()};
      if (!r.ok) return ck_fail(path, "truncated header");
      if (k.kind == ZOPT_STATE_GRAD || k.kind < ZOPT_STATE_PARAM || k.kind > ZOPT_STATE_KAHAN_COMP)
        return ck_fail(path, "state kind %u is not a state a checkpoint holds", k.kind);
      if (!dtype_size(k.dtype)) return ck_fail(path, "state %s: unknown dtype %u", state_kind_name(k.kind), k.dtype);
      const bool absmax = k.kind == ZOPT_STATE_EXP_AVG_ABSMAX || k.kind == ZOPT_STATE_EXP_AVG_SQ_ABSMAX;
      if ((absmax && k.dtype != ZOPT_DTYPE_F32) ||
          (k.dtype == ZOPT_DTYPE_Q8 && k.kind != ZOPT_STATE_EXP_AVG && k.kind != ZOPT_STATE_EXP_AVG_SQ))
        return ck_fail(path, "state %s: dtype %s does not fit it", state_kind_name(k.kind), dtype_name(k.dtype));
      for (const KindRec &o : f.kinds)
        if (o.kind == k.kind) return ck_fail(path, "state %s stored twice", state_kind_name(k.kind));
      f.kinds.push_back(k);
    }
    if (ngroups > (1u << 20) || ntensors > 0x7fffffffu / 2) return ck_fail(path, "too many groups or tensors");
    f.groups.resize(ngroups);
    for (uint32_t g = 0; g < ngroups; ++g) {
      f.groups[g].step_count = r.get<int64_t>();
      uint32_t nh = r.get<uint32_t>();
      if (version >= 3)
        f.groups[g].flags = r.get<uint32_t>();
      else
        pad("a group's");
      if (!r.ok || nh > ZOPT_MAX_HYPERS) return ck_fail(path, "group %u: bad hyperparameter table", g);
      if (f.groups[g].step_count < 0) return ck_fail(path, "group %u: negative step count", g);
      if (f.groups[g].flags & ~kGroupFlagsKnown)
        return ck_fail(path, "group %u: flags 0x%x has bits this runtime does not know (a newer writer?)", g,
                       f.groups[g].flags);
      for (uint32_t k = 0; k < nh; ++k) {
        uint32_t kind = r.get<uint32_t>();
        pad("a hyperparameter's");
        double v = r.get<double>();
        if (kind < ZOPT_HYPER_LR || kind > ZOPT_HYPER_BIAS_CORRECTION)
          return ck_fail(path, "group %u: unknown hyperparameter kind %u", g, kind);
        f.groups[g].hypers.emplace_back(kind, v);
      }
    }
    if (!r.ok) return ck_fail(path, "truncated header");
    if (hsize - r.pos < (uint64_t)ntensors * 24) return ck_fail(path, "truncated tensor table");
    f.tensors.resize(ntensors);
    for (uint32_t t = 0; t < ntensors; ++t) {
      TensorRec &tr = f.tensors[t];
      tr.group = r.get<uint32_t>();
      pad("a tensor's");
      tr.numel = r.get<int64_t>();
      tr.steps = r.get<int64_t>();
      if (tr.group >= ngroups || tr.numel < 0 || tr.steps < 0)
        return ck_fail(path, "tensor %u: bad group, size or step count", t);
    }
    uint64_t npieces = r.get<uint64_t>();
    if (!r.ok || npieces > (hsize - r.pos) / 40) return ck_fail(path, "bad piece table");
    f.pieces.resize((size_t)npieces);
    const uint64_t data_start = (hsize + 8 + kDataAlign - 1) / kDataAlign * kDataAlign;
    for (PieceRec &p : f.pieces) {
      p.kind_index = r.get<uint32_t>();
      p.tensor = r.get<uint32_t>();
      p.start = r.get<int64_t>();
      p.len = r.get<int64_t>();
      p.offset = r.get<uint64_t>();
      p.fnv = r.get<uint64_t>();
      if (!r.ok) return ck_fail(path, "truncated piece table");
      if (p.kind_index >= nkinds || p.tensor >= ntensors) return ck_fail(path, "a piece names no state or tensor");
      const TensorRec &tr = f.tensors[p.tensor];
      uint64_t bytes = (uint64_t)p.len * dtype_size(f.kinds[p.kind_index].dtype);
      // A q8 absmax holds one element per block of the tensor.
      const uint32_t pk = f.kinds[p.kind_index].kind;
      const int64_t n = pk == ZOPT_STATE_EXP_AVG_ABSMAX || pk == ZOPT_STATE_EXP_AVG_SQ_ABSMAX
                            ? (tr.numel + ZOPT_Q8_BLOCK - 1) / ZOPT_Q8_BLOCK
                            : tr.numel;
      if (p.start < 0 || p.len <= 0 || p.start > n || p.len > n - p.start)
        return ck_fail(path, "tensor %u: piece [%lld, +%lld) outside its %lld elements", p.tensor,
                       (long long)p.start, (long long)p.len, (long long)n);
      if (p.offset % kDataAlign || p.offset < data_start || p.offset > f.size || bytes > f.size - p.offset)
        return ck_fail(path, "tensor %u state %s: data outside the file", p.tensor,
                       state_kind_name(f.kinds[p.kind_index].kind));
    }
    if (bad_pad) return ck_fail(path, "%s reserved field is not 0 (not written by this format)", bad_pad);
    uint64_t data_end = r.get<uint64_t>();
    if (!r.ok || r.pos != hsize) return ck_fail(path, "header size mismatch");
    if (data_end != f.size) return ck_fail(path, "file is %llu bytes, its header says %llu (truncated or extended)",
                                           (unsigned long long)f.size, (unsigned long long)data_end);
  } catch (...) {
    return fail(ZOPT_ERR_OUT_OF_MEMORY, "zopt_optimizer_load: out of memory reading '%s'", path.c_str());
  }
  return ZOPT_OK;
}

// Format 1 (ABI 1 runtimes; one rank, whole tensors, a whole-file FNV with
// the old offset basis): read whole, checked, turned into pieces.
zopt_status read_v1(File &f) {
  const std::string &path = f.path;
  try {
    f.v1_data.resize((size_t)f.size);
  } catch (...) {
    return fail(ZOPT_ERR_OUT_OF_MEMORY, "cannot allocate %llu bytes to read checkpoint '%s'",
                (unsigned long long)f.size, path.c_str());
  }
  const unsigned char *buf = f.v1_data.data();
  const size_t n = (size_t)f.size;
  if (n < 16 || !read_at(f, f.v1_data.data(), n, 0)) return ck_fail(path, "cannot read the file");
  uint32_t version;
  memcpy(&version, buf + 8, 4);
  if (version != 1) return ck_fail(path, "format 1 file with version field %u", version);
  uint64_t stored;
  memcpy(&stored, buf + n - 8, 8);
  if (fnv1a64(buf, n - 8, kFnvBasisV1) != stored) return ck_fail(path, "file checksum mismatch (corrupt or truncated)");
  uint32_t flags;
  memcpy(&flags, buf + 12, 4);
  if (flags) return ck_fail(path, "flags 0x%x: no flags are defined", flags);
  Reader r{buf, n - 8};
  r.pos = 16;
  f.desc_sum = r.get<uint64_t>();
  r.bytes(f.name, ZOPT_NAME_LEN);
  uint32_t ngroups = r.get<uint32_t>(), ntensors = r.get<uint32_t>();
  LossScaler &ls = f.scaler;
  read_scaler(r, ls);
  r.get<uint32_t>();
  if (!r.ok) return ck_fail(path, "truncated header");
  if (!valid_scaler(ls))
    return ck_fail(path, "invalid loss-scaler state (scale %g, good steps %lld)", ls.scale, (long long)ls.good_steps);
  if (ngroups > (1u << 20) || ntensors > (n / 16)) return ck_fail(path, "too many groups or tensors");
  try {
    f.groups.resize(ngroups);
    for (uint32_t g = 0; g < ngroups; ++g) {
      f.groups[g].step_count = r.get<int64_t>();
      uint32_t nh = r.get<uint32_t>();
      r.get<uint32_t>();
      if (!r.ok || nh > ZOPT_MAX_HYPERS) return ck_fail(path, "group %u: bad hyperparameter table", g);
      if (f.groups[g].step_count < 0) return ck_fail(path, "group %u: negative step count", g);
      for (uint32_t k = 0; k < nh; ++k) {
        uint32_t kind = r.get<uint32_t>();
        r.get<uint32_t>();
        double v = r.get<double>();
        if (kind < ZOPT_HYPER_LR || kind > ZOPT_HYPER_BIAS_CORRECTION)
          return ck_fail(path, "group %u: unknown hyperparameter kind %u", g, kind);
        f.groups[g].hypers.emplace_back(kind, v);
      }
    }
    f.tensors.resize(ntensors);
    for (uint32_t t = 0; t < ntensors; ++t) {
      TensorRec &tr = f.tensors[t];
      tr.group = r.get<uint32_t>();
      uint32_t ns = r.get<uint32_t>();
      tr.numel = r.get<int64_t>();
      if (!r.ok || ns > ZOPT_MAX_STATES || tr.group >= ngroups || tr.numel < 0)
        return ck_fail(path, "tensor %u: bad state table", t);
      tr.steps = f.groups[tr.group].step_count;  // format 1 counted per group
      for (uint32_t s = 0; s < ns; ++s) {
        uint32_t kind = r.get<uint32_t>(), dtype = r.get<uint32_t>();
        uint64_t bytes = r.get<uint64_t>(), off = r.get<uint64_t>(), fnv = r.get<uint64_t>();
        if (!r.ok) return ck_fail(path, "truncated tensor table");
        if (kind <= ZOPT_STATE_GRAD || (kind > ZOPT_STATE_MOMENTUM_BUFFER && kind != ZOPT_STATE_KAHAN_COMP))
          return ck_fail(path, "tensor %u: unknown state kind %u", t, kind);
        size_t es = dtype_size(dtype);
        if (!es) return ck_fail(path, "tensor %u state %s: unknown dtype %u", t, state_kind_name(kind), dtype);
        if (bytes != (uint64_t)tr.numel * es)
          return ck_fail(path, "tensor %u state %s: %llu bytes for %lld elements", t, state_kind_name(kind),
                         (unsigned long long)bytes, (long long)tr.numel);
        if (off % kDataAlign || off > n - 8 || bytes > n - 8 - off)
          return ck_fail(path, "tensor %u state %s: data outside the file", t, state_kind_name(kind));
        if (fnv1a64(buf + off, bytes, kFnvBasisV1) != fnv)  // format 1: the old basis throughout
          return ck_fail(path, "tensor %u state %s: data checksum mismatch", t, state_kind_name(kind));
        uint32_t ki = 0;
        while (ki < f.kinds.size() && f.kinds[ki].kind != kind) ++ki;
        if (ki == f.kinds.size()) f.kinds.push_back(KindRec{kind, dtype});
        else if (f.kinds[ki].dtype != dtype) return ck_fail(path, "state %s stored in two dtypes", state_kind_name(kind));
        for (const PieceRec &p : f.pieces)
          if (p.tensor == t && p.kind_index == ki)
            return ck_fail(path, "tensor %u: state %s stored twice", t, state_kind_name(kind));
        if (tr.numel) f.pieces.push_back(PieceRec{ki, t, 0, tr.numel, off, 0});
      }
    }
    uint64_t end = r.get<uint64_t>();
    if (!r.ok || end != n - 8) return ck_fail(path, "data size mismatch (truncated or extended file)");
  } catch (...) {
    return fail(ZOPT_ERR_OUT_OF_MEMORY, "zopt_optimizer_load: out of memory");
  }
  return ZOPT_OK;
}


}  // namespace ckpt
}  // namespace zopt
