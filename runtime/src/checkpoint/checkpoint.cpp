// checkpoint/checkpoint.cpp - zopt_optimizer_save / zopt_optimizer_load.
//
// This subsystem owns the checkpoint files (docs/CHECKPOINT.md, format 3):
// every rank writes the elements it holds, as pieces of tensors (tensor,
// first element, count), so a checkpoint does not depend on the layout that
// wrote it: saved at W ranks it loads at any other W, into another dtype or
// placement, by reading the pieces that overlap what the loading rank holds.
// Loading validates everything on every rank before anything changes, and
// the ranks agree: a load that fails on one rank fails on all. Format 2
// files (no save identity, no group flags) and format 1 files (one rank,
// written before ABI 2) are still read. The set's file names and the
// commit of a multi-rank save are set.h's.
#include "internal.h"

#include "checkpoint/set.h"

#include "comm/comm_internal.h"
#include "backend/backend.h"
#include "exec/exec.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <string>

using namespace zopt;

namespace {

constexpr char kMagic2[8] = {'Z', 'O', 'P', 'T', 'C', 'K', 'P', '2'};
constexpr char kMagic1[8] = {'Z', 'O', 'P', 'T', 'C', 'K', 'P', '1'};
constexpr uint32_t kVersion = 3;                // written; 2 is still read
constexpr uint32_t kGroupFlagsKnown = 1u;       // bit 0: maximize (Group::flags)
constexpr uint64_t kFnvBasisV1 = 1469598103934665603ull;  // format 1's (wrong) basis
constexpr size_t kDataAlign = 64;
constexpr uint32_t kMaxRanks = 1u << 20;

// ---- in-memory form of one file -------------------------------------------

struct GroupRec {
  int64_t step_count = 0;
  uint32_t flags = 0;  // format 3 (Group::flags)
  std::vector<std::pair<uint32_t, double>> hypers;
};
struct TensorRec {
  uint32_t group = 0;
  int64_t numel = 0, steps = 0;
};
struct KindRec {
  uint32_t kind, dtype;
};
struct PieceRec {
  uint32_t kind_index, tensor;
  int64_t start, len;
  uint64_t offset, fnv;
};
struct File {
  std::string path;
  uint32_t version = 0, world = 1, rank = 0;
  ckpt::SaveId id;  // format 3
  uint64_t desc_sum = 0;
  char name[ZOPT_NAME_LEN + 1] = {0};
  LossScaler scaler;
  uint64_t seed = 0;
  bool has_seed = false;
  std::vector<GroupRec> groups;
  std::vector<TensorRec> tensors;
  std::vector<KindRec> kinds;
  std::vector<PieceRec> pieces;
  uint64_t size = 0;
  // Format 1 keeps its data in memory (it was read whole to check it).
  std::vector<unsigned char> v1_data;
  int fd = -1;
  ~File() {
    if (fd >= 0) ::close(fd);
  }
};

zopt_status ck_fail(const std::string &path, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
zopt_status ck_fail(const std::string &path, const char *fmt, ...) {
  char m[768];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(m, sizeof m, fmt, ap);
  va_end(ap);
  return fail(ZOPT_ERR_CHECKPOINT, "checkpoint '%s': %s", path.c_str(), m);
}

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

bool valid_scaler(const LossScaler &ls) {
  const zopt_loss_scaler_config &c = ls.cfg;
  return std::isfinite(ls.scale) && ls.scale > 0 && ls.good_steps >= 0 && std::isfinite(c.init_scale) &&
         c.init_scale > 0 && (c.dynamic == 0 || c.dynamic == 1) &&
         (!c.dynamic || (c.growth_factor >= 1 && std::isfinite(c.growth_factor) && c.backoff_factor > 0 &&
                         c.backoff_factor < 1 && c.growth_interval >= 1 && c.min_scale > 0 &&
                         std::isfinite(c.min_scale)));
}

// ---- reading ---------------------------------------------------------------

zopt_status read_header(File &f, const std::string &path) {
  f.path = path;
  f.fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (f.fd < 0) return fail(ZOPT_ERR_IO, "cannot open checkpoint '%s': %s", path.c_str(), strerror(errno));
  struct stat st;
  if (fstat(f.fd, &st) != 0 || !S_ISREG(st.st_mode))
    return fail(ZOPT_ERR_IO, "checkpoint '%s' is not a regular file", path.c_str());
  f.size = (uint64_t)st.st_size;
  unsigned char fixed[24];
  if (f.size < sizeof fixed || !read_at(f.fd, fixed, sizeof fixed, 0))
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
  if (flags != 0) return ck_fail(path, "flags 0x%x: no flags are defined (a newer writer?)", flags);
  if (hsize < 24 || hsize > f.size - 8 || hsize > (uint64_t)1 << 34)
    return ck_fail(path, "header size %llu outside the file", (unsigned long long)hsize);
  std::vector<unsigned char> h;
  try {
    h.resize((size_t)hsize + 8);
  } catch (...) {
    return fail(ZOPT_ERR_OUT_OF_MEMORY, "cannot read the header of checkpoint '%s'", path.c_str());
  }
  if (!read_at(f.fd, h.data(), h.size(), 0)) return ck_fail(path, "truncated header");
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
  ls.scale = r.get<double>();
  ls.good_steps = r.get<int64_t>();
  ls.cfg.init_scale = r.get<double>();
  ls.cfg.growth_factor = r.get<double>();
  ls.cfg.backoff_factor = r.get<double>();
  ls.cfg.growth_interval = r.get<int64_t>();
  ls.cfg.min_scale = r.get<double>();
  ls.cfg.dynamic = (int)r.get<uint32_t>();
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
      if (k.kind == ZOPT_STATE_GRAD || k.kind < ZOPT_STATE_PARAM || k.kind > ZOPT_STATE_MOMENTUM_BUFFER)
        return ck_fail(path, "state kind %u is not a state a checkpoint holds", k.kind);
      if (!dtype_size(k.dtype)) return ck_fail(path, "state %s: unknown dtype %u", state_kind_name(k.kind), k.dtype);
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
      if (p.start < 0 || p.len <= 0 || p.start > tr.numel || p.len > tr.numel - p.start)
        return ck_fail(path, "tensor %u: piece [%lld, +%lld) outside its %lld elements", p.tensor,
                       (long long)p.start, (long long)p.len, (long long)tr.numel);
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
  if (n < 16 || !read_at(f.fd, f.v1_data.data(), n, 0)) return ck_fail(path, "cannot read the file");
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
        if (kind <= ZOPT_STATE_GRAD || kind > ZOPT_STATE_MOMENTUM_BUFFER)
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

// ---- what a rank holds -----------------------------------------------------

// The runs of state si of tensor t this rank holds, for writing a
// checkpoint: each element is written by exactly one rank (a state held
// whole by every rank, stage 0, is written by the rank whose shard of the
// layout at the world size holds it).
void save_runs(const zopt_optimizer *o, int t, int si, std::vector<exec::Run> *out) {
  out->clear();
  const Tensor &x = o->tensors[t];
  if (!x.numel) return;
  if (o->world == 1) {
    out->push_back(exec::Run{0, x.numel, state_ptr(o, t, si)});
    return;
  }
  if (!exec::holds_whole(o, si)) {
    exec::runs(o, t, si, out);
    return;
  }
  // Whole on every rank: this rank writes its shard of the layout.
  const exec::Program &P = *o->prog;
  const layout::Segment &seg = P.L.tensors[t];
  char *base = (char *)state_ptr(o, t, si);
  const size_t es = dtype_size(o->d->states[si].dtype);
  for (int b = seg.bucket; b < (int)P.L.buckets.size(); ++b) {
    const layout::Bucket &k = P.L.buckets[b];
    if (k.group != seg.group || k.begin >= seg.flat + seg.numel) break;
    int64_t a, e;
    P.L.shard_range(b, o->rank, &a, &e);
    a = std::max(a, seg.flat);
    e = std::min(e, seg.flat + seg.numel);
    if (a < e) out->push_back(exec::Run{a - seg.flat, e - a, base + (size_t)(a - seg.flat) * es});
  }
}

// What a checkpoint holds: the optimizer states, and the params where the
// runtime holds them (ZeRO-3: sharded, the model has no copy of its own).
bool saved_state(const zopt_optimizer *o, uint32_t s) {
  uint32_t k = o->d->states[s].kind;
  if (is_owned_kind(k)) return true;
  return k == ZOPT_STATE_PARAM && o->prog && o->prog->buf[s] && !o->prog->pinned[s];
}

// The bytes of a run: in place for host memory, staged where the backend
// keeps the state elsewhere (a GPU step's device memory: whole tensors).
zopt_status run_bytes(const zopt_optimizer *o, int t, int si, const exec::Run &r, std::vector<unsigned char> &stage,
                      const void **out) {
  size_t bytes = (size_t)r.len * dtype_size(o->d->states[si].dtype);
  if (o->backend->host_state(o, si)) {
    *out = r.ptr;
    return ZOPT_OK;
  }
  try {
    stage.resize(bytes);
  } catch (...) {
    return fail(ZOPT_ERR_OUT_OF_MEMORY, "zopt_optimizer_save: out of host memory");
  }
  *out = stage.data();
  return o->backend->read_state(o, t, si, stage.data(), bytes);  // whole tensors (world size 1)
}

}  // namespace

extern "C" {

// ---- save ------------------------------------------------------------------

// Writes this rank's file of the set `id` to `file` (a name no other save
// uses), fsync'd; on failure the file is removed.
static zopt_status save_file(const zopt_optimizer *o, const std::string &file, const ckpt::SaveId &id,
                             ckpt::Fault fault) {
  const zopt_step_descriptor *d = o->d;
  std::vector<uint32_t> kinds;  // descriptor indices of the saved states
  for (uint32_t s = 0; s < d->num_states; ++s)
    if (saved_state(o, s)) kinds.push_back(s);
  struct P {
    uint32_t ki, t;
    exec::Run run;
  };
  std::vector<P> pieces;
  std::vector<exec::Run> runs;
  std::vector<unsigned char> stage;
  Writer w;
  try {
    for (uint32_t ki = 0; ki < kinds.size(); ++ki)
      for (size_t t = 0; t < o->tensors.size(); ++t) {
        save_runs(o, (int)t, (int)kinds[ki], &runs);
        for (const exec::Run &r : runs) pieces.push_back(P{ki, (uint32_t)t, r});
      }
    w.bytes(kMagic2, 8);
    w.put<uint32_t>(kVersion);
    w.put<uint32_t>(0);  // flags
    w.put<uint64_t>(0);  // header size, patched below
    w.put<uint64_t>(d->checksum);
    w.bytes(d->name, ZOPT_NAME_LEN);
    w.put<uint32_t>((uint32_t)o->world);
    w.put<uint32_t>((uint32_t)o->rank);
    w.bytes(id.b, ckpt::kSaveIdBytes);
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
    w.put<uint64_t>(o->seed);
    w.put<uint32_t>((uint32_t)kinds.size());
    w.put<uint32_t>(0);
    for (uint32_t s : kinds) {
      w.put<uint32_t>(d->states[s].kind);
      w.put<uint32_t>(d->states[s].dtype);
    }
    for (const Group &g : o->groups) {
      w.put<int64_t>(g.step_count);
      w.put<uint32_t>(d->num_hypers);
      w.put<uint32_t>(g.flags);
      for (uint32_t h = 0; h < d->num_hypers; ++h) {
        w.put<uint32_t>(d->hypers[h].kind);
        w.put<uint32_t>(0);
        w.put<double>(g.hypers[h]);
      }
    }
    for (const Tensor &x : o->tensors) {
      w.put<uint32_t>((uint32_t)x.group);
      w.put<uint32_t>(0);
      w.put<int64_t>(x.numel);
      w.put<int64_t>(x.steps);  // the backend's pull refreshed it
    }
    w.put<uint64_t>(pieces.size());
    const size_t table = w.buf.size();
    const uint64_t hsize = table + pieces.size() * 40 + 8;
    uint64_t off = (hsize + 8 + kDataAlign - 1) / kDataAlign * kDataAlign;
    for (const P &p : pieces) {
      uint64_t bytes = (uint64_t)p.run.len * dtype_size(d->states[kinds[p.ki]].dtype);
      const void *src = nullptr;
      if (zopt_status st = run_bytes(o, (int)p.t, (int)kinds[p.ki], p.run, stage, &src)) return st;
      w.put<uint32_t>(p.ki);
      w.put<uint32_t>(p.t);
      w.put<int64_t>(p.run.start);
      w.put<int64_t>(p.run.len);
      w.put<uint64_t>(off);
      w.put<uint64_t>(fnv1a64(src, (size_t)bytes));
      off = (off + bytes + kDataAlign - 1) / kDataAlign * kDataAlign;
    }
    // The last piece ends the file (no trailing padding).
    uint64_t data_end = hsize + 8;
    if (!pieces.empty()) {
      const P &p = pieces.back();
      uint64_t last_off;
      memcpy(&last_off, w.buf.data() + w.buf.size() - 16, 8);
      data_end = last_off + (uint64_t)p.run.len * dtype_size(d->states[kinds[p.ki]].dtype);
    }
    w.put<uint64_t>(data_end);
    if (w.buf.size() != hsize) return fail(ZOPT_ERR_INTERNAL, "checkpoint header size mismatch");
    memcpy(&w.buf[16], &hsize, 8);
    w.put<uint64_t>(fnv1a64(w.buf.data(), (size_t)hsize));
  } catch (...) {
    return fail(ZOPT_ERR_OUT_OF_MEMORY, "zopt_optimizer_save: out of memory");
  }
  int fd = ::open(file.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return fail(ZOPT_ERR_IO, "cannot create '%s': %s", file.c_str(), strerror(errno));
  auto io_fail = [&](const char *what) {
    int e = errno;
    ::close(fd);
    ::unlink(file.c_str());
    return fail(ZOPT_ERR_IO, "%s '%s': %s%s", what, file.c_str(), strerror(e),
                fault == ckpt::Fault::kWrite || fault == ckpt::Fault::kFsync ? " (ZOPT_TEST_SAVE_FAULT)" : "");
  };
  static const char zeros[kDataAlign] = {0};
  uint64_t pos = w.buf.size();
  if (!write_all(fd, w.buf.data(), w.buf.size())) return io_fail("cannot write");
  if (fault == ckpt::Fault::kWrite) {  // test fault: the header made it, the data did not
    errno = EIO;
    return io_fail("cannot write");
  }
  for (const P &p : pieces) {
    uint64_t at = (pos + kDataAlign - 1) / kDataAlign * kDataAlign;
    if (at > pos && !write_all(fd, zeros, (size_t)(at - pos))) return io_fail("cannot write");
    size_t bytes = (size_t)p.run.len * dtype_size(d->states[kinds[p.ki]].dtype);
    const void *src = nullptr;
    if (zopt_status st = run_bytes(o, (int)p.t, (int)kinds[p.ki], p.run, stage, &src)) {
      ::close(fd);
      ::unlink(file.c_str());
      return st;
    }
    if (!write_all(fd, src, bytes)) return io_fail("cannot write");
    pos = at + bytes;
  }
  if (fault == ckpt::Fault::kFsync) errno = EIO;
  if (fault == ckpt::Fault::kFsync || ::fsync(fd) != 0) return io_fail("cannot fsync");
  if (::close(fd) != 0) {
    int e = errno;
    ::unlink(file.c_str());
    return fail(ZOPT_ERR_IO, "cannot close '%s': %s", file.c_str(), strerror(e));
  }
  ckpt::fsync_dir(file);  // its name is durable before the commit
  return ZOPT_OK;
}

ZOPT_API zopt_status zopt_optimizer_save(const zopt_optimizer *co, const char *path) {
  zopt_optimizer *o = const_cast<zopt_optimizer *>(co);
  ZOPT_ENTER_CALL(o, "zopt_optimizer_save");
  if (zopt_status st = check_idle(o, "zopt_optimizer_save")) return st;
  if (!path || !*path) return fail(ZOPT_ERR_INVALID_ARGUMENT, "zopt_optimizer_save: path is NULL or empty");
  if (!o->finalized) return fail(ZOPT_ERR_BAD_STATE, "zopt_optimizer_save: call zopt_optimizer_finalize first");
  // Step counts and scaler from where the backend keeps them (the device:
  // waits for the stream).
  if (zopt_status st = o->backend->pull(o)) return st;
  // docs/CHECKPOINT.md "Saving": an identity every rank agrees on; every
  // rank writes its file under a name of that identity (the previous set
  // stays untouched) and fsyncs it; the ranks agree that all did; then one
  // rename on rank 0 commits the set (set.cpp, ckpt::commit).
  ckpt::SaveId id;
  if (zopt_status st = ckpt::agree_save_id(o, path, &id)) return st;
  const ckpt::Fault fault = ckpt::save_fault(o->rank);
  const std::string mine = ckpt::set_file(path, (uint32_t)o->rank, (uint32_t)o->world, id);
  zopt_status st = save_file(o, mine, id, fault);
  if (fault == ckpt::Fault::kDieEarly && !st) return ckpt::die(o, "before the ranks agreed");
  bool lost = false;
  if (zopt_status ag = ckpt::agree_status(o, st, "SAVE status", 0, &lost)) {
    if (!st) ::unlink(mine.c_str());
    if (lost)  // a rank failed or stopped answering: nothing was committed
      return fail(ag,
                  "zopt_optimizer_save('%s'): a rank failed or stopped answering before the commit; the previous "
                  "checkpoint there (if any) is unchanged. The communicator: %s",
                  path, std::string(zopt_last_error()).c_str());
    return ag;
  }
  return ckpt::commit(o, path, mine, fault);
}

// ---- load ------------------------------------------------------------------

// What a load changes, staged: validated completely before it is applied.
struct Staged {
  struct Dest {
    int t, si;
    int64_t start, len;
    std::vector<unsigned char> bytes;  // the state's storage dtype
  };
  std::vector<Dest> dests;
  std::vector<GroupRec> groups;
  std::vector<int64_t> tensor_steps;
  LossScaler scaler;
  uint64_t seed = 0;
  bool has_seed = false;
};

static zopt_status stage_load(zopt_optimizer *o, const char *path, uint32_t flags, Staged &out) {
  const zopt_step_descriptor *d = o->d;
  // 1. The file set: rank 0's file names the world size that wrote it.
  std::vector<std::unique_ptr<File>> files;
  files.emplace_back(new File);
  if (zopt_status st = read_header(*files[0], path)) return st;
  if (files[0]->version == 1) {
    if (zopt_status st = read_v1(*files[0])) return st;
  } else if (files[0]->rank != 0) {
    return ck_fail(path, "is rank %u's file of %u; load the set through rank 0's file", files[0]->rank,
                   files[0]->world);
  }
  const File &f0 = *files[0];
  for (uint32_t q = 1; q < f0.world; ++q) {
    files.emplace_back(new File);
    File &f = *files.back();
    const std::string fq =
        f0.version >= 3 ? ckpt::set_file(path, q, f0.world, f0.id) : ckpt::v2_file(path, q, f0.world);
    if (zopt_status st = read_header(f, fq))
      return st == ZOPT_ERR_IO ? fail(st, "%s (rank %u's file of the %u-rank checkpoint set that '%s' names)",
                                      std::string(zopt_last_error()).c_str(), q, f0.world, path)
                               : st;
    if (f.version != f0.version)
      return ck_fail(f.path, "is a format %u file, rank 0's file '%s' format %u", f.version, path, f0.version);
    if (f.id != f0.id)
      return ck_fail(f.path,
                     "belongs to another save: its save identity is %s, rank 0's file '%s' names %s (files of "
                     "two saves do not make a checkpoint)",
                     ckpt::hex(f.id).c_str(), path, ckpt::hex(f0.id).c_str());
    if (f.world != f0.world || f.rank != q || f.desc_sum != f0.desc_sum ||
        memcmp(f.name, f0.name, ZOPT_NAME_LEN) != 0 || f.kinds.size() != f0.kinds.size() ||
        f.tensors.size() != f0.tensors.size() || f.groups.size() != f0.groups.size())
      return ck_fail(f.path, "does not belong to the checkpoint set of '%s' (another save, rank or world size)", path);
    for (size_t k = 0; k < f.kinds.size(); ++k)
      if (f.kinds[k].kind != f0.kinds[k].kind || f.kinds[k].dtype != f0.kinds[k].dtype)
        return ck_fail(f.path, "stores other states than '%s'", path);
    for (size_t t = 0; t < f.tensors.size(); ++t)
      if (f.tensors[t].numel != f0.tensors[t].numel || f.tensors[t].group != f0.tensors[t].group ||
          f.tensors[t].steps != f0.tensors[t].steps)
        return ck_fail(f.path, "tensor %zu differs from rank 0's file", t);
  }
  // 2. Against this optimizer.
  if (f0.groups.size() != o->groups.size())
    return ck_fail(path, "has %zu groups, the optimizer has %zu", f0.groups.size(), o->groups.size());
  if (f0.tensors.size() != o->tensors.size())
    return ck_fail(path, "has %zu tensors, the optimizer has %zu", f0.tensors.size(), o->tensors.size());
  for (size_t t = 0; t < o->tensors.size(); ++t) {
    if (f0.tensors[t].group != (uint32_t)o->tensors[t].group)
      return ck_fail(path, "tensor %zu is in group %u, in the optimizer in group %d", t, f0.tensors[t].group,
                     o->tensors[t].group);
    if (f0.tensors[t].numel != o->tensors[t].numel)
      return ck_fail(path, "tensor %zu has %lld elements, the optimizer's has %lld", t,
                     (long long)f0.tensors[t].numel, (long long)o->tensors[t].numel);
  }
  for (size_t g = 0; g < f0.groups.size(); ++g)
    for (auto &kv : f0.groups[g].hypers) {
      int hi = hyper_index(d, kv.first);
      if (hi < 0) continue;
      const zopt_hyper_desc &hd = d->hypers[hi];
      double v = kv.second;
      bool ok = std::isfinite(v) && v >= hd.min_value && (hd.max_exclusive ? v < hd.max_value : v <= hd.max_value);
      if (!ok) return ck_fail(path, "group %zu: %s = %g out of the step's range", g, hyper_name(kv.first), v);
    }
  // The update rule's states must match: a moment the file lacks would start
  // at zero, one the step lacks would be dropped. Both change the math, so
  // they need ZOPT_LOAD_ALLOW_RULE_CHANGE. The master may be dropped (a step
  // whose params need none); a missing one needs the flag and is then made
  // from the params, as at finalize.
  const bool allow = flags & ZOPT_LOAD_ALLOW_RULE_CHANGE;
  auto file_has = [&](uint32_t kind) {
    for (const KindRec &k : f0.kinds)
      if (k.kind == kind) return true;
    return false;
  };
  std::string missing, extra;
  for (uint32_t s = 0; s < d->num_states; ++s) {
    uint32_t k = d->states[s].kind;
    if (is_owned_kind(k) && !file_has(k)) missing += std::string(missing.empty() ? "" : ", ") + state_kind_name(k);
  }
  for (const KindRec &k : f0.kinds)
    if (state_index(d, k.kind) < 0 && k.kind != ZOPT_STATE_MASTER && k.kind != ZOPT_STATE_PARAM)
      extra += std::string(extra.empty() ? "" : ", ") + state_kind_name(k.kind);
  if (!allow && (!missing.empty() || !extra.empty()))
    return ck_fail(path,
                   "was written by step '%s' with another update rule: %s%s%s%s%s. Loading it would %s; pass "
                   "ZOPT_LOAD_ALLOW_RULE_CHANGE (Python: allow_rule_change=True) to load it anyway",
                   f0.name, missing.empty() ? "" : "it lacks ", missing.c_str(),
                   (!missing.empty() && !extra.empty()) ? "; " : "", extra.empty() ? "" : "it has ", extra.c_str(),
                   !missing.empty() ? (extra.empty() ? "start those states at zero (the master from the params)"
                                                     : "start the missing states at zero and drop the others")
                                    : "drop those states");
  // 3. Stage every element this rank holds: the overlapping pieces of the
  // files, read, checked and converted.
  std::map<std::pair<size_t, size_t>, std::vector<unsigned char>> cache;  // (file, piece) -> bytes
  auto piece_bytes = [&](size_t fi, size_t pi, const std::vector<unsigned char> **out) -> zopt_status {
    auto it = cache.find({fi, pi});
    if (it == cache.end()) {
      const File &f = *files[fi];
      const PieceRec &p = f.pieces[pi];
      size_t bytes = (size_t)p.len * dtype_size(f.kinds[p.kind_index].dtype);
      std::vector<unsigned char> b;
      try {
        b.resize(bytes);
      } catch (...) {
        return fail(ZOPT_ERR_OUT_OF_MEMORY, "zopt_optimizer_load: out of memory");
      }
      if (f.version == 1) {
        memcpy(b.data(), f.v1_data.data() + p.offset, bytes);
      } else {
        if (!read_at(f.fd, b.data(), bytes, p.offset)) return ck_fail(f.path, "cannot read tensor %u's data", p.tensor);
        if (fnv1a64(b.data(), bytes) != p.fnv)
          return ck_fail(f.path, "tensor %u state %s: data checksum mismatch", p.tensor,
                         state_kind_name(f.kinds[p.kind_index].kind));
      }
      it = cache.emplace(std::make_pair(fi, pi), std::move(b)).first;
    }
    *out = &it->second;
    return ZOPT_OK;
  };
  // Pieces by (kind, tensor), over all files.
  std::map<std::pair<uint32_t, uint32_t>, std::vector<std::pair<size_t, size_t>>> index;
  for (size_t fi = 0; fi < files.size(); ++fi)
    for (size_t pi = 0; pi < files[fi]->pieces.size(); ++pi) {
      const PieceRec &p = files[fi]->pieces[pi];
      index[{files[fi]->kinds[p.kind_index].kind, p.tensor}].push_back({fi, pi});
    }
  std::vector<exec::Run> runs;
  const int pidx = o->step->param_index;
  try {
    for (uint32_t s = 0; s < d->num_states; ++s) {
      const uint32_t kind = d->states[s].kind, dt = d->states[s].dtype;
      if (!saved_state(o, s)) continue;
      const size_t es = dtype_size(dt);
      for (size_t t = 0; t < o->tensors.size(); ++t) {
        exec::runs(o, (int)t, (int)s, &runs);
        auto pit = index.find({kind, (uint32_t)t});
        for (const exec::Run &r : runs) {
          Staged::Dest dst{(int)t, (int)s, r.start, r.len, {}};
          dst.bytes.resize((size_t)r.len * es);
          if (pit == index.end() && kind == ZOPT_STATE_PARAM) {
            // A checkpoint of a step whose params the model holds: the
            // runtime's shard from the model's params, as at finalize.
            const size_t pes = dtype_size(dt);
            memcpy(dst.bytes.data(), (const char *)o->tensors[t].param + (size_t)r.start * pes, (size_t)r.len * pes);
            out.dests.push_back(std::move(dst));
            continue;
          }
          if (pit == index.end()) {
            if (kind == ZOPT_STATE_MASTER) {  // (allowed above) from the params, as at finalize
              const size_t pes = dtype_size(d->states[pidx].dtype);
              std::vector<unsigned char> p;
              const void *src = nullptr;
              if (!state_ptr(o, (int)t, pidx))
                return ck_fail(path, "cannot make the master of tensor %zu from its sharded param", t);
              if (o->backend->host_state(o, pidx)) {
                src = (const char *)state_ptr(o, (int)t, pidx) + (size_t)r.start * pes;
              } else {  // the whole param, from where the backend keeps it
                p.resize((size_t)o->tensors[t].numel * pes);
                if (zopt_status st = o->backend->read_state(o, (int)t, pidx, p.data(), p.size())) return st;
                src = p.data() + (size_t)r.start * pes;
              }
              convert(src, d->states[pidx].dtype, dst.bytes.data(), dt, r.len);
            }  // else zeros (allowed above)
            out.dests.push_back(std::move(dst));
            continue;
          }
          int64_t covered = 0;
          for (auto [fi, pi] : pit->second) {
            const PieceRec &p = files[fi]->pieces[pi];
            int64_t a = std::max(r.start, p.start), e = std::min(r.start + r.len, p.start + p.len);
            if (a >= e) continue;
            const std::vector<unsigned char> *b = nullptr;
            if (zopt_status st = piece_bytes(fi, pi, &b)) return st;
            uint32_t sdt = files[fi]->kinds[p.kind_index].dtype;
            convert(b->data() + (size_t)(a - p.start) * dtype_size(sdt), sdt,
                    dst.bytes.data() + (size_t)(a - r.start) * es, dt, e - a);
            covered += e - a;
          }
          if (covered != r.len)
            return ck_fail(path, "tensor %zu state %s: the files hold %lld of elements [%lld, %lld) (a file of the "
                                 "set is missing pieces or they overlap)",
                           t, state_kind_name(kind), (long long)covered, (long long)r.start,
                           (long long)(r.start + r.len));
          out.dests.push_back(std::move(dst));
        }
      }
    }
    out.groups = f0.groups;
    for (const TensorRec &tr : f0.tensors) out.tensor_steps.push_back(tr.steps);
  } catch (...) {
    return fail(ZOPT_ERR_OUT_OF_MEMORY, "zopt_optimizer_load: out of memory");
  }
  out.scaler = f0.scaler;
  out.seed = f0.seed;
  out.has_seed = f0.has_seed;
  return ZOPT_OK;
}

ZOPT_API zopt_status zopt_optimizer_load_ex(zopt_optimizer *o, const char *path, uint32_t flags) {
  ZOPT_ENTER_CALL(o, "zopt_optimizer_load");
  if (zopt_status st = check_idle(o, "zopt_optimizer_load")) return st;
  if (!path || !*path) return fail(ZOPT_ERR_INVALID_ARGUMENT, "zopt_optimizer_load: path is NULL or empty");
  if (!o->finalized) return fail(ZOPT_ERR_BAD_STATE, "zopt_optimizer_load: call zopt_optimizer_finalize first");
  if (flags & ~(uint32_t)(ZOPT_LOAD_ALLOW_RULE_CHANGE | ZOPT_LOAD_VALIDATE_ONLY))
    return fail(ZOPT_ERR_INVALID_ARGUMENT, "zopt_optimizer_load_ex: unknown flags 0x%x", flags);
  Staged sg;
  zopt_status st = stage_load(o, path, flags, sg);
  // Nothing applied yet (kSigUnchanged): a rank at another call fails this
  // load cleanly.
  if (zopt_status ag = ckpt::agree_status(o, st, "LOAD status", kSigUnchanged)) return ag;
  if (flags & ZOPT_LOAD_VALIDATE_ONLY) return ZOPT_OK;  // every check passed; nothing applied
  // Apply: host copies cannot fail; a GPU step's copies fail only if the
  // device does (its context is then unusable anyway).
  const zopt_step_descriptor *d = o->d;
  for (const Staged::Dest &dst : sg.dests) {
    if (!o->backend->host_state(o, dst.si)) {  // whole tensors where the backend keeps them
      if (zopt_status e = o->backend->write_state(o, dst.t, dst.si, dst.bytes.data(), dst.bytes.size())) return e;
      continue;
    }
    std::vector<exec::Run> runs;
    exec::runs(o, dst.t, dst.si, &runs);
    for (const exec::Run &r : runs)
      if (r.start == dst.start && r.len == dst.len) memcpy(r.ptr, dst.bytes.data(), dst.bytes.size());
  }
  for (size_t g = 0; g < o->groups.size(); ++g) {
    o->groups[g].step_count = sg.groups[g].step_count;
    o->groups[g].flags = sg.groups[g].flags;  // format 2 and 1: 0
    for (auto &kv : sg.groups[g].hypers) {
      int hi = hyper_index(d, kv.first);
      if (hi >= 0) o->groups[g].hypers[hi] = kv.second;
    }
  }
  for (size_t t = 0; t < o->tensors.size(); ++t) o->tensors[t].steps = sg.tensor_steps[t];
  o->scaler = sg.scaler;
  if (sg.has_seed) o->seed = sg.seed;
  // Step counts, scaler and hyperparameters to where the backend keeps them.
  o->backend->hypers_changed(o);
  return o->backend->push(o);
}

ZOPT_API zopt_status zopt_optimizer_load(zopt_optimizer *o, const char *path) {
  return zopt_optimizer_load_ex(o, path, 0);
}

}  // extern "C"
