// checkpoint/checkpoint.cpp - the writer of an image and zopt_optimizer_load
// (saving is save.cpp's, the checkpoint of several parts linked.cpp's).
//
// This subsystem owns the checkpoint files (docs/CHECKPOINT.md, format 3):
// every rank writes the elements it holds, as pieces of tensors (tensor,
// first element, count), so a checkpoint does not depend on the layout that
// wrote it: saved at W ranks it loads at any other W, into another dtype or
// placement, by reading the pieces that overlap what the loading rank holds.
// Loading validates everything on every rank before anything changes, and
// the ranks agree: a load that fails on one rank fails on all. Format 2
// files (no save identity, no group flags) and format 1 files (one rank,
// written before ABI 2) are still read (format.cpp parses a file). The
// set's file names and the commit of a multi-rank save are set.h's; the
// same writer and reader serve the state in memory (image.h, memory.cpp).
#include "internal.h"

#include "checkpoint/format.h"
#include "checkpoint/image.h"
#include "checkpoint/q8.h"
#include "checkpoint/set.h"

#include "comm/comm_internal.h"
#include "backend/backend.h"
#include "exec/exec.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cmath>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <string>

using namespace zopt;
using zopt::ckpt::saved_state;

namespace {

using ckpt::File;
using ckpt::GroupRec;
using ckpt::KindRec;
using ckpt::PieceRec;
using ckpt::TensorRec;
using ckpt::ck_fail;
using ckpt::kDataAlign;
using ckpt::kMagic2;
using ckpt::kVersion;
using ckpt::read_at;
using ckpt::read_header;
using ckpt::read_v1;

struct Writer {
  std::string buf;
  template <class T>
  void put(T v) {
    buf.append((const char *)&v, sizeof v);
  }
  void bytes(const void *p, size_t n) { buf.append((const char *)p, n); }
};

// ---- what a rank holds -----------------------------------------------------

// The runs of state si of tensor t this rank holds, for writing a
// checkpoint: each element is written by exactly one rank (a state held
// whole by every rank, stage 0, is written by the rank whose shard of the
// layout at the world size holds it). A PER_BLOCK state (a q8 absmax):
// runs of blocks (exec::runs; the shards start at block boundaries).
void save_runs(const zopt_optimizer *o, int t, int si, std::vector<exec::Run> *out) {
  out->clear();
  const Tensor &x = o->tensors[t];
  if (!x.numel) return;
  if (o->world == 1) {
    out->push_back(exec::Run{0, state_numel(o->d, si, x.numel), state_ptr(o, t, si)});
    return;
  }
  if (!exec::holds_whole(o, si)) {
    exec::runs(o, t, si, out);
    return;
  }
  // Whole on every rank: this rank writes its shard of the layout.
  char *base = (char *)state_ptr(o, t, si);
  const size_t es = dtype_size(o->d->states[si].dtype);
  std::vector<exec::OwnedRange> rs;
  exec::owned_ranges(o, t, &rs);
  const int64_t q = is_per_block(o->d, si) ? ZOPT_Q8_BLOCK : 1;
  for (const exec::OwnedRange &r : rs) {
    const int64_t a = r.start / q, e = (r.start + r.len + q - 1) / q;
    out->push_back(exec::Run{a, e - a, base + (size_t)a * es});
  }
}

// The bytes of a run: in place for host memory, staged where the backend
// keeps the state elsewhere (a GPU step's device memory: whole tensors).
zopt_status run_bytes(const zopt_optimizer *o, int t, int si, const exec::Run &r, std::vector<unsigned char> &stage,
                      const void **out, const char *fn) {
  size_t bytes = (size_t)r.len * dtype_size(o->d->states[si].dtype);
  if (o->backend->host_state(o, si)) {
    *out = r.ptr;
    return ZOPT_OK;
  }
  try {
    stage.resize(bytes);
  } catch (...) {
    return fail(ZOPT_ERR_OUT_OF_MEMORY, "%s: out of host memory", fn);
  }
  *out = stage.data();
  return o->backend->read_state(o, t, si, stage.data(), bytes);  // whole tensors (world size 1)
}

// A piece of an image being written: state kinds[ki] of tensor t, its run
// (ptr NULL: gathered into the image in memory), offset and checksum.
struct Piece {
  uint32_t ki, t;
  exec::Run run;
  uint64_t off, fnv;
};

// The pieces whose bytes are host memory (`src[i]`: the state's own, or
// the image's where a gather put them) copied into the image in memory
// (`img`, else not copied) and, with `checksums`, hashed: on the
// optimizer's pool (one thread without one), the threads taking tasks in
// turn. A task is a piece when it is hashed (FNV-1a is sequential; copied
// and hashed 1 MiB at a time, each block hashed while it is in cache),
// else a 1 MiB block of one.
void copy_and_hash(const zopt_optimizer *o, std::vector<Piece> &pieces, const std::vector<size_t> &which,
                   const std::vector<const unsigned char *> &src, const std::vector<size_t> &bytes,
                   unsigned char *img, bool checksums) {
  constexpr size_t kBlock = (size_t)1 << 20;
  struct Task {
    size_t i, begin, end;  // which[i], bytes [begin, end)
  };
  std::vector<Task> tasks;
  for (size_t i = 0; i < which.size(); ++i) {
    const size_t n = bytes[i];
    if (checksums || n <= kBlock) {
      tasks.push_back(Task{i, 0, n});
    } else {
      for (size_t b = 0; b < n; b += kBlock) tasks.push_back(Task{i, b, std::min(n, b + kBlock)});
    }
  }
  std::atomic<size_t> next{0};
  auto work = [&](int) {
    for (size_t k; (k = next.fetch_add(1)) < tasks.size();) {
      const Task &tk = tasks[k];
      Piece &p = pieces[which[tk.i]];
      const unsigned char *from = src[tk.i];
      unsigned char *to = img ? img + p.off : nullptr;
      uint64_t h = kFnvBasis;
      for (size_t b = tk.begin; b < tk.end; b += kBlock) {
        const size_t n = std::min(kBlock, tk.end - b);
        if (to && to + b != from + b) memcpy(to + b, from + b, n);
        if (checksums) h = fnv1a64(to ? to + b : from + b, n, h);
      }
      if (checksums) p.fnv = h;
    }
  };
  if (o->pool && o->pool->size() > 1 && tasks.size() > 1) {
    parallel(o->pool, [&](int tid) { work(tid); });
  } else {
    work(0);
  }
}

}  // namespace

namespace zopt {
namespace ckpt {

// What a checkpoint holds: the optimizer states, and the params where the
// runtime holds them (ZeRO-3: sharded, the model has no copy of its own).
bool saved_state(const zopt_optimizer *o, uint32_t s) {
  uint32_t k = o->d->states[s].kind;
  if (is_owned_kind(k)) return true;
  return k == ZOPT_STATE_PARAM && o->prog && o->prog->buf[s] && !o->prog->pinned[s];
}

zopt_status write_image(const zopt_optimizer *o, const SaveId &id, bool whole, Sink &sink, const char *fn,
                        bool checksums, bool linked) {
  const zopt_step_descriptor *d = o->d;
  std::vector<uint32_t> kinds;  // descriptor indices of the saved states
  for (uint32_t s = 0; s < d->num_states; ++s)
    if (saved_state(o, s)) kinds.push_back(s);
  using P = Piece;
  std::vector<P> pieces;
  std::vector<exec::Run> runs;
  std::vector<unsigned char> stage;
  Writer w;
  try {
    for (uint32_t ki = 0; ki < kinds.size(); ++ki)
      for (size_t t = 0; t < o->tensors.size(); ++t) {
        const int si = (int)kinds[ki];
        if (!whole) {
          save_runs(o, (int)t, si, &runs);
          for (const exec::Run &r : runs) pieces.push_back(P{ki, (uint32_t)t, r, 0, 0});
        } else if (const int64_t n = state_numel(d, si, o->tensors[t].numel)) {
          void *p = o->world > 1 && !exec::holds_whole(o, si) ? nullptr : state_ptr(o, (int)t, si);
          pieces.push_back(P{ki, (uint32_t)t, exec::Run{0, n, p}, 0, 0});
        }
      }
    w.bytes(kMagic2, 8);
    w.put<uint32_t>(kVersion);
    w.put<uint32_t>((checksums ? 0u : ckpt::kFlagNoChecksums) | (linked ? ckpt::kFlagLinked : 0u));
    w.put<uint64_t>(0);  // header size, patched below
    w.put<uint64_t>(d->checksum);
    w.bytes(d->name, ZOPT_NAME_LEN);
    w.put<uint32_t>(whole ? 1u : (uint32_t)o->world);
    w.put<uint32_t>(whole ? 0u : (uint32_t)o->rank);
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
  } catch (...) {
    return fail(ZOPT_ERR_OUT_OF_MEMORY, "%s: out of memory", fn);
  }
  // The data: each piece at a multiple of kDataAlign after the header, the
  // last one ending the image (no trailing padding).
  const uint64_t hsize = w.buf.size() + pieces.size() * 40 + 8;
  uint64_t off = (hsize + 8 + kDataAlign - 1) / kDataAlign * kDataAlign, data_end = hsize + 8;
  for (P &p : pieces) {
    p.off = off;
    data_end = off + (uint64_t)p.run.len * dtype_size(d->states[kinds[p.ki]].dtype);
    off = (data_end + kDataAlign - 1) / kDataAlign * kDataAlign;
  }
  zopt_status begun = sink.begin(data_end);
  if (whole && o->world > 1)  // every rank has its buffer before the gathers
    begun = agree_status(const_cast<zopt_optimizer *>(o), begun, "EXPORT buffer", kSigUnchanged);
  if (begun) return begun;
  if (whole && o->world > 1) {
    // The sharded states, gathered straight into their pieces' places (a
    // collective per state: every rank writes the same image).
    unsigned char *img = sink.direct();
    if (!img) return fail(ZOPT_ERR_INTERNAL, "%s: a whole image needs a sink in memory", fn);
    std::vector<void *> dst;
    try {
      for (uint32_t ki = 0; ki < kinds.size(); ++ki) {
        if (exec::holds_whole(o, (int)kinds[ki])) continue;
        dst.assign(o->tensors.size(), nullptr);
        for (const P &p : pieces)
          if (p.ki == ki) dst[p.t] = img + p.off;
        if (zopt_status st = exec::gather_state(const_cast<zopt_optimizer *>(o), (int)kinds[ki], 0,
                                                (int)o->tensors.size(), dst.data()))
          return st;
      }
    } catch (...) {
      return fail(ZOPT_ERR_OUT_OF_MEMORY, "%s: out of memory", fn);
    }
  }
  // The data. A state the backend keeps elsewhere (a GPU step's device
  // memory) is read piece by piece, straight into an image in memory;
  // host memory is copied into an image in memory and hashed on the pool
  // (copy_and_hash), or hashed there and written piece by piece.
  unsigned char *img = sink.direct();
  std::vector<size_t> host;
  std::vector<const unsigned char *> host_src;
  std::vector<size_t> host_bytes;
  try {
    for (size_t i = 0; i < pieces.size(); ++i) {
      P &p = pieces[i];
      const int si = (int)kinds[p.ki];
      const size_t bytes = (size_t)p.run.len * dtype_size(d->states[si].dtype);
      const bool gathered = !p.run.ptr && whole && o->world > 1;  // in place already
      if (gathered || o->backend->host_state(o, si)) {
        host.push_back(i);
        host_src.push_back(gathered ? img + p.off : (const unsigned char *)p.run.ptr);
        host_bytes.push_back(bytes);
        continue;
      }
      if (img) {  // whole tensors (world size 1)
        if (zopt_status st = o->backend->read_state(o, (int)p.t, si, img + p.off, bytes)) return st;
        if (checksums) p.fnv = fnv1a64(img + p.off, bytes);
        continue;
      }
      const void *src = nullptr;
      if (zopt_status st = run_bytes(o, (int)p.t, si, p.run, stage, &src, fn)) return st;
      if (checksums) p.fnv = fnv1a64(src, bytes);
      if (zopt_status st = sink.write_at(p.off, src, bytes)) return st;
    }
    copy_and_hash(o, pieces, host, host_src, host_bytes, img, checksums);
  } catch (...) {
    return fail(ZOPT_ERR_OUT_OF_MEMORY, "%s: out of memory", fn);
  }
  if (!img)
    for (size_t i = 0; i < host.size(); ++i)
      if (zopt_status st = sink.write_at(pieces[host[i]].off, host_src[i], host_bytes[i])) return st;
  // The header, now that every piece's checksum is known.
  try {
    for (const P &p : pieces) {
      w.put<uint32_t>(p.ki);
      w.put<uint32_t>(p.t);
      w.put<int64_t>(p.run.start);
      w.put<int64_t>(p.run.len);
      w.put<uint64_t>(p.off);
      w.put<uint64_t>(p.fnv);
    }
    w.put<uint64_t>(data_end);
    if (w.buf.size() != hsize) return fail(ZOPT_ERR_INTERNAL, "checkpoint header size mismatch");
    memcpy(&w.buf[16], &hsize, 8);
    w.put<uint64_t>(fnv1a64(w.buf.data(), (size_t)hsize));
  } catch (...) {
    return fail(ZOPT_ERR_OUT_OF_MEMORY, "%s: out of memory", fn);
  }
  return sink.write_at(0, w.buf.data(), w.buf.size());
}

}  // namespace ckpt
}  // namespace zopt

// ---- load ------------------------------------------------------------------

using ckpt::Staged;
using Files = std::vector<std::unique_ptr<File>>;

// File f is a member of the set of f0 (`ref` names f0, `set` the set, in
// messages).
static zopt_status check_member(const File &f, const File &f0, const char *ref, const char *set) {
  if (f.version != f0.version) return ck_fail(f.path, "is a format %u file, %s format %u", f.version, ref, f0.version);
  if (f.id != f0.id)
    return ck_fail(f.path,
                   "belongs to another save: its save identity is %s, %s names %s (files of two saves do not make a "
                   "checkpoint)",
                   ckpt::hex(f.id).c_str(), ref, ckpt::hex(f0.id).c_str());
  if (f.world != f0.world || f.desc_sum != f0.desc_sum || memcmp(f.name, f0.name, ZOPT_NAME_LEN) != 0 ||
      f.kinds.size() != f0.kinds.size() || f.tensors.size() != f0.tensors.size() ||
      f.groups.size() != f0.groups.size())
    return ck_fail(f.path, "does not belong to the checkpoint set of %s (another save, rank or world size)", set);
  for (size_t k = 0; k < f.kinds.size(); ++k)
    if (f.kinds[k].kind != f0.kinds[k].kind || f.kinds[k].dtype != f0.kinds[k].dtype)
      return ck_fail(f.path, "stores other states than %s", set);
  for (size_t t = 0; t < f.tensors.size(); ++t)
    if (f.tensors[t].numel != f0.tensors[t].numel || f.tensors[t].group != f0.tensors[t].group ||
        f.tensors[t].steps != f0.tensors[t].steps)
      return ck_fail(f.path, "tensor %zu differs from %s", t, ref);
  return ZOPT_OK;
}

static zopt_status stage_files(zopt_optimizer *o, const Files &files, const char *path, uint32_t flags,
                               Staged &out);

namespace zopt {
namespace ckpt {

zopt_status stage_path(zopt_optimizer *o, const char *path, uint32_t flags, Staged &out, const char *file0) {
  // 1. The file set: rank 0's file names the world size that wrote it.
  Files files;
  files.emplace_back(new File);
  if (!file0) file0 = path;
  if (zopt_status st = read_header(*files[0], file0)) return st;
  if (files[0]->version == 1) {
    if (zopt_status st = read_v1(*files[0])) return st;
  } else if (files[0]->rank != 0) {
    return ck_fail(file0, "is rank %u's file of %u; load the set through rank 0's file", files[0]->rank,
                   files[0]->world);
  }
  const File &f0 = *files[0];
  const std::string ref = std::string("rank 0's file '") + file0 + "'", set = std::string("'") + path + "'";
  for (uint32_t q = 1; q < f0.world; ++q) {
    files.emplace_back(new File);
    File &f = *files.back();
    const std::string fq =
        f0.version >= 3 ? ckpt::set_file(path, q, f0.world, f0.id) : ckpt::v2_file(path, q, f0.world);
    if (zopt_status st = read_header(f, fq))
      return st == ZOPT_ERR_IO ? fail(st, "%s (rank %u's file of the %u-rank checkpoint set that '%s' names)",
                                      std::string(zopt_last_error()).c_str(), q, f0.world, file0)
                               : st;
    if (zopt_status st = check_member(f, f0, ref.c_str(), set.c_str())) return st;
    if (f.rank != q)
      return ck_fail(f.path, "does not belong to the checkpoint set of '%s' (another save, rank or world size)", path);
  }
  return stage_files(o, files, path, flags, out);
}

zopt_status stage_memory(zopt_optimizer *o, int n, const void *const *bufs, const size_t *sizes, uint32_t flags,
                         Staged &out) {
  // The images of one export: one whole image, or rank images (each rank
  // at most once) of one save identity.
  Files files;
  std::vector<uint8_t> seen;
  for (int i = 0; i < n; ++i) {
    files.emplace_back(new File);
    File &f = *files.back();
    f.mem = (const unsigned char *)bufs[i];
    f.size = sizes[i];
    const std::string label = "<in-memory state, buffer " + std::to_string(i) + ">";
    if (zopt_status st = read_header(f, label)) return st;
    if (f.version == 1)
      if (zopt_status st = read_v1(f)) return st;
    if (f.world > 1 && n > (int)f.world)
      return ck_fail(label, "is rank %u's image of %u, and %d buffers were given", f.rank, f.world, n);
    if (f.world == 1 && n > 1)
      return ck_fail(label, "holds every element (world size 1): pass it alone, not with %d other buffers", n - 1);
    if (i == 0) {
      seen.assign(f.world, 0);
    } else if (zopt_status st = check_member(f, *files[0], "buffer 0", "buffer 0")) {
      return st;
    }
    if (seen[f.rank]++)
      return ck_fail(label, "is rank %u's image of %u, as an earlier buffer (each rank's image at most once)", f.rank,
                     f.world);
  }
  return stage_files(o, files, n == 1 ? "<in-memory state>" : "<in-memory state set>", flags, out);
}

}  // namespace ckpt
}  // namespace zopt

// Checks the set against the optimizer and stages every element this rank
// holds (the overlapping pieces of the files, read, checked and converted).
static zopt_status stage_files(zopt_optimizer *o, const Files &files, const char *path, uint32_t flags,
                               Staged &out) {
  const zopt_step_descriptor *d = o->d;
  const File &f0 = *files[0];
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
  // (A q8 moment's absmax is part of its moment: the moments load between
  // q8 and wider dtypes, checkpoint/q8.h.)
  auto fdt = [&](uint32_t kind) -> uint32_t {
    for (const KindRec &k : f0.kinds)
      if (k.kind == kind) return k.dtype;
    return 0;
  };
  std::string missing, extra;
  for (uint32_t s = 0; s < d->num_states; ++s) {
    uint32_t k = d->states[s].kind;
    if (is_owned_kind(k) && !file_has(k) && !ckpt::q8_converts(k, d->states[s].dtype, fdt))
      missing += std::string(missing.empty() ? "" : ", ") + state_kind_name(k);
  }
  for (const KindRec &k : f0.kinds)
    if (state_index(d, k.kind) < 0 && k.kind != ZOPT_STATE_MASTER && k.kind != ZOPT_STATE_PARAM &&
        !ckpt::q8_absmax_of_moment(k.kind, d))
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
        if (!read_at(f, b.data(), bytes, p.offset)) return ck_fail(f.path, "cannot read tensor %u's data", p.tensor);
        if (f.checksums && fnv1a64(b.data(), bytes) != p.fnv)
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
  // Units [a, e) of the set's `kind` of tensor t in its dtype (q8 loads).
  const ckpt::ReadRange read_range = [&](uint32_t k, size_t t, int64_t a, int64_t e, std::vector<unsigned char> *b,
                                         uint32_t *sdt) -> zopt_status {
    *sdt = fdt(k);
    const size_t es = dtype_size(*sdt);
    b->assign((size_t)(e - a) * es, 0);
    int64_t covered = 0;
    auto pit = index.find({k, (uint32_t)t});
    if (pit != index.end())
      for (auto [fi, pi] : pit->second) {
        const PieceRec &p = files[fi]->pieces[pi];
        const int64_t x = std::max(a, p.start), y = std::min(e, p.start + p.len);
        if (x >= y) continue;
        const std::vector<unsigned char> *pb = nullptr;
        if (zopt_status st = piece_bytes(fi, pi, &pb)) return st;
        memcpy(b->data() + (size_t)(x - a) * es, pb->data() + (size_t)(x - p.start) * es, (size_t)(y - x) * es);
        covered += y - x;
      }
    if (covered != e - a)
      return ck_fail(path, "tensor %zu state %s: the files hold %lld of elements [%lld, %lld) (a file of the set "
                           "is missing pieces or they overlap)",
                     t, state_kind_name(k), (long long)covered, (long long)a, (long long)e);
    return ZOPT_OK;
  };
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
          if (ckpt::q8_converts(kind, dt, fdt)) {  // between q8 and wider moments
            if (zopt_status st = ckpt::q8_stage(kind, dt, t, o->tensors[t].numel, r.start, r.len, fdt, read_range,
                                                dst.bytes.data(), path))
              return st;
            out.dests.push_back(std::move(dst));
            continue;
          }
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
            } else {  // zeros (allowed above; a q8 moment: its zero code)
              memset(dst.bytes.data(), zero_byte(d, (int)s), dst.bytes.size());
            }
            out.dests.push_back(std::move(dst));
            continue;
          }
          std::vector<unsigned char> b;
          uint32_t sdt = 0;
          if (zopt_status st = read_range(kind, t, r.start, r.start + r.len, &b, &sdt)) return st;
          // A remainder master (I16) is half of a master: the other half
          // is the param, which this per-state conversion cannot see.
          if ((sdt == ZOPT_DTYPE_I16) != (dt == ZOPT_DTYPE_I16))
            return ck_fail(path, "tensor %zu: the checkpoint's %s is %s and this step's %s: converting between a "
                                 "remainder master and a %s master is not supported (load it into a step with the "
                                 "checkpoint's master layout)",
                           t, state_kind_name(kind), dtype_name(sdt), dtype_name(dt),
                           dtype_name(sdt == ZOPT_DTYPE_I16 ? dt : sdt));
          convert(b.data(), sdt, dst.bytes.data(), dt, r.len);
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
  out.id = f0.id;
  out.has_id = f0.version >= 3;
  return ZOPT_OK;
}

namespace zopt {
namespace ckpt {

zopt_status apply(zopt_optimizer *o, Staged &sg) {
  // Host copies cannot fail; a GPU step's copies fail only if the device
  // does (its context is then unusable anyway).
  const zopt_step_descriptor *d = o->d;
  std::vector<exec::Run> runs;
  for (const Staged::Dest &dst : sg.dests) {
    if (!o->backend->host_state(o, dst.si)) {  // whole tensors where the backend keeps them
      if (zopt_status e = o->backend->write_state(o, dst.t, dst.si, dst.bytes.data(), dst.bytes.size())) return e;
      continue;
    }
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

}  // namespace ckpt
}  // namespace zopt

extern "C" {

ZOPT_API zopt_status zopt_optimizer_load_ex(zopt_optimizer *o, const char *path, uint32_t flags) {
  ZOPT_ENTER_CALL(o, "zopt_optimizer_load");
  if (zopt_status st = check_idle(o, "zopt_optimizer_load")) return st;
  if (!path || !*path) return fail(ZOPT_ERR_INVALID_ARGUMENT, "zopt_optimizer_load: path is NULL or empty");
  if (!o->finalized) return fail(ZOPT_ERR_BAD_STATE, "zopt_optimizer_load: call zopt_optimizer_finalize first");
  if (flags & ~(uint32_t)(ZOPT_LOAD_ALLOW_RULE_CHANGE | ZOPT_LOAD_VALIDATE_ONLY))
    return fail(ZOPT_ERR_INVALID_ARGUMENT, "zopt_optimizer_load_ex: unknown flags 0x%x", flags);
  Staged sg;
  zopt_status st = ckpt::stage_path(o, path, flags, sg);
  // Nothing applied yet (kSigUnchanged): a rank at another call fails this
  // load cleanly.
  if (zopt_status ag = ckpt::agree_status(o, st, "LOAD status", kSigUnchanged)) return ag;
  if (zopt_status ag = ckpt::agree_staged(o, sg, "zopt_optimizer_load", "LOAD save and settings")) return ag;
  if (flags & ZOPT_LOAD_VALIDATE_ONLY) return ZOPT_OK;  // every check passed; nothing applied
  return ckpt::apply(o, sg);
}

ZOPT_API zopt_status zopt_optimizer_load(zopt_optimizer *o, const char *path) {
  return zopt_optimizer_load_ex(o, path, 0);
}

}  // extern "C"
