// checkpoint/memory.cpp - the optimizer's state in memory (zopt.h "the state
// in memory"; docs/CHECKPOINT.md "In memory"): export and import of images
// of the checkpoint format through the files' writer and reader (image.h),
// and the staged import that builds a load's staged form piece by piece
// (a binding's load_state_dict in one transaction).
#include "internal.h"

#include "backend/backend.h"
#include "checkpoint/image.h"
#include "checkpoint/set.h"
#include "comm/comm_internal.h"
#include "optimizer/api.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <memory>
#include <new>
#include <unordered_map>

using namespace zopt;

namespace {

// An image in one malloc'd buffer (zopt_state_buffer_free).
class MemSink : public ckpt::Sink {
 public:
  ~MemSink() override { free(buf_); }
  zopt_status begin(uint64_t size) override {
    if (size > (uint64_t)SIZE_MAX / 2 || !(buf_ = (unsigned char *)calloc((size_t)std::max<uint64_t>(size, 1), 1)))
      return fail(ZOPT_ERR_OUT_OF_MEMORY, "zopt_optimizer_export_state: cannot allocate %llu bytes for the image",
                  (unsigned long long)size);
    size_ = size;
    return ZOPT_OK;
  }
  zopt_status write_at(uint64_t off, const void *p, size_t n) override {
    if (off > size_ || n > size_ - off) return fail(ZOPT_ERR_INTERNAL, "image write outside its %llu bytes",
                                                    (unsigned long long)size_);
    if (n) memcpy(buf_ + off, p, n);
    return ZOPT_OK;
  }
  unsigned char *direct() override { return buf_; }
  void release(void **buf, size_t *size) {
    *buf = buf_;
    *size = (size_t)size_;
    buf_ = nullptr;
  }

 private:
  unsigned char *buf_ = nullptr;
  uint64_t size_ = 0;
};

zopt_status check_load_flags(uint32_t flags, const char *fn) {
  if (flags & ~(uint32_t)(ZOPT_LOAD_ALLOW_RULE_CHANGE | ZOPT_LOAD_VALIDATE_ONLY))
    return fail(ZOPT_ERR_INVALID_ARGUMENT, "%s: unknown flags 0x%x", fn, flags);
  return ZOPT_OK;
}

}  // namespace

// The staged import: a load's staged form, built by the calls.
struct zopt_state_import {
  zopt_optimizer *o = nullptr;
  uint64_t generation = 0;
  ckpt::Staged sg;
  std::vector<uint8_t> put;  // per (tensor, descriptor state): given
};

namespace {

// A staged import's calls: the import, its optimizer's call gate, its
// generation.
#define ZOPT_ENTER_IMPORT(imp, fn)                                                              \
  if (!(imp)) return fail(ZOPT_ERR_INVALID_ARGUMENT, "%s: import is NULL", fn);                 \
  ZOPT_ENTER_CALL((imp)->o, fn);                                                                \
  if (zopt_status st_ = check_idle((imp)->o, fn)) return st_;                                   \
  if ((imp)->generation != (imp)->o->generation)                                                \
    return fail(ZOPT_ERR_BAD_STATE, "%s: tensors were added to the optimizer since "            \
                "zopt_optimizer_import_begin: begin the import again", fn)

// Every (tensor, state) not put: as at finalize. ZeRO-3's held params from
// the user's params; a master from the PARAM put into the import, else from
// the user's params as the host sees them (a staging backend's, offload,
// fetched into its staging first; a device backend's, cuda, read from
// where it keeps them); moments zero.
zopt_status complete(zopt_state_import *imp, const char *fn) {
  zopt_optimizer *o = imp->o;
  Backend *be = o->backend;
  const zopt_step_descriptor *d = o->d;
  const int pi = o->step->param_index;
  const uint32_t pdt = d->states[pi].dtype;
  const size_t T = o->tensors.size(), S = d->num_states;
  bool fetched = false;
  std::vector<exec::Run> runs;
  std::vector<unsigned char> tmp;
  std::vector<ckpt::Staged::Dest> added;
  try {
    // The PARAM runs put into the import (ZeRO-3), by tensor.
    std::unordered_map<int, std::vector<const ckpt::Staged::Dest *>> params;
    for (const ckpt::Staged::Dest &x : imp->sg.dests)
      if (x.si == pi) params[x.t].push_back(&x);
    auto held_param = [&](int t, const exec::Run &r) -> const ckpt::Staged::Dest * {
      auto it = params.find(t);
      if (it != params.end())
        for (const ckpt::Staged::Dest *x : it->second)
          if (x->start == r.start && x->len == r.len) return x;
      return nullptr;
    };
    for (uint32_t s = 0; s < S; ++s) {
      if (!ckpt::saved_state(o, s)) continue;
      const uint32_t kind = d->states[s].kind, dt = d->states[s].dtype;
      for (size_t t = 0; t < T; ++t) {
        if (imp->put[t * S + s]) continue;
        exec::runs(o, (int)t, (int)s, &runs);
        const bool from_param = kind == ZOPT_STATE_PARAM || d->states[s].init == ZOPT_INIT_FROM_PARAM;
        for (const exec::Run &r : runs) {
          ckpt::Staged::Dest dst{(int)t, (int)s, r.start, r.len, {}};
          dst.bytes.assign((size_t)r.len * dtype_size(dt), zero_byte(d, (int)s));  // q8: the zero code
          if (from_param) {
            const ckpt::Staged::Dest *held = kind == ZOPT_STATE_PARAM ? nullptr : held_param((int)t, r);
            const void *src = nullptr;
            if (held) {
              src = held->bytes.data();
            } else if (!be->stages() && !be->host_state(o, pi)) {  // the whole param, from the backend
              tmp.resize((size_t)o->tensors[t].numel * dtype_size(pdt));
              if (zopt_status st = be->read_state(o, (int)t, pi, tmp.data(), tmp.size())) return st;
              src = tmp.data() + (size_t)r.start * dtype_size(pdt);
            } else {
              if (be->stages() && !fetched) {  // the params from the user's memory into the staging
                if (zopt_status st = be->copy_staged(o, pi, false, true)) return st;
                fetched = true;
              }
              src = (const char *)be->param_on_host(o, (int)t) + (size_t)r.start * dtype_size(pdt);
            }
            convert(src, pdt, dst.bytes.data(), dt, r.len);
          }
          added.push_back(std::move(dst));
        }
      }
    }
    for (ckpt::Staged::Dest &x : added) imp->sg.dests.push_back(std::move(x));
  } catch (...) {
    return fail(ZOPT_ERR_OUT_OF_MEMORY, "%s: out of memory", fn);
  }
  return ZOPT_OK;
}

// With several ranks: every rank imports the same counts and settings.
zopt_status agree_import(zopt_state_import *imp, zopt_status st, const char *fn) {
  zopt_optimizer *o = imp->o;
  if (zopt_status ag = ckpt::agree_status(o, st, "IMPORT status", kSigUnchanged)) return ag;
  if (o->world == 1) return ZOPT_OK;
  const uint64_t h = ckpt::staged_hash(imp->sg);
  std::vector<uint64_t> all((size_t)o->world);
  if (zopt_status cs = comm_all_gather(o->comm, &h, all.data(), sizeof h, "IMPORT counts and settings", kSigUnchanged))
    return cs;
  std::vector<int> bad;
  for (int q = 1; q < o->world; ++q)
    if (all[(size_t)q] != all[0]) bad.push_back(q);
  if (!bad.empty())
    return fail(ZOPT_ERR_INVALID_ARGUMENT,
                "%s: %s imported other step counts, hyperparameters, group flags, loss scaler or seed than rank 0: "
                "every rank imports the same (nothing changed)",
                fn, comm_rank_list(bad).c_str());
  return ZOPT_OK;
}

// The runs this rank holds of state si of tensor t, from `src` (the
// state's dtype, every unit of the tensor), into `add`.
void stage_runs(zopt_state_import *imp, int t, int si, const unsigned char *src,
                std::vector<ckpt::Staged::Dest> *add) {
  zopt_optimizer *o = imp->o;
  const size_t es = dtype_size(o->d->states[si].dtype);
  std::vector<exec::Run> runs;
  exec::runs(o, t, si, &runs);
  for (const exec::Run &r : runs) {
    ckpt::Staged::Dest dst{t, si, r.start, r.len, {}};
    dst.bytes.assign(src + (size_t)r.start * es, src + (size_t)(r.start + r.len) * es);
    add->push_back(std::move(dst));
  }
}

// A q8 moment or its absmax put (abi.h "q8 moments"): the codes as they are
// (dtype Q8, numel of them) with the absmax put as f32 (one per block), or
// the moment as f32 / bf16 / f16 values, encoded here by the canonical rule
// (per block the absmax max |x|, NaN if any x is; zopt_q8_encode): codes
// and absmax both put.
zopt_status put_q8(zopt_state_import *imp, int tensor, int si, uint32_t dt, const void *data, int64_t numel,
                   const char *fn) {
  zopt_optimizer *o = imp->o;
  const zopt_step_descriptor *d = o->d;
  const uint32_t k = d->states[si].kind;
  const bool absmax = is_per_block(d, si);
  const int64_t n = o->tensors[tensor].numel, want = state_numel(d, si, n);
  // (wide: a moment's values, to encode)
  const bool wide = !absmax && (dt == ZOPT_DTYPE_F32 || dt == ZOPT_DTYPE_BF16 || dt == ZOPT_DTYPE_F16);
  if (absmax ? dt != ZOPT_DTYPE_F32 : !(wide || dt == ZOPT_DTYPE_Q8))
    return fail(ZOPT_ERR_INVALID_ARGUMENT, "%s: dtype %u for a q8 %s (%s)", fn, dt, absmax ? "absmax" : "moment",
                absmax ? "f32, one per 256 elements" : "f32, bf16 or f16 values, or its q8 codes");
  if (numel != want)
    return fail(ZOPT_ERR_INVALID_ARGUMENT, "%s: numel %lld != %lld (tensor %d's %s%s)", fn, (long long)numel,
                (long long)want, tensor, state_kind_name(k), absmax ? ": one per block of 256 elements" : "");
  if (numel && !data) return fail(ZOPT_ERR_INVALID_ARGUMENT, "%s: data is NULL", fn);
  const size_t S = d->num_states;
  const int ai = absmax ? -1
                        : state_index(d, k == ZOPT_STATE_EXP_AVG ? ZOPT_STATE_EXP_AVG_ABSMAX
                                                                 : ZOPT_STATE_EXP_AVG_SQ_ABSMAX);
  uint8_t &mine = imp->put[(size_t)tensor * S + (size_t)si];
  if (mine || (wide && imp->put[(size_t)tensor * S + (size_t)ai]))
    return fail(ZOPT_ERR_INVALID_ARGUMENT, "%s: tensor %d's %s was put already", fn, tensor,
                state_kind_name(mine ? k : d->states[ai].kind));
  std::vector<ckpt::Staged::Dest> add;
  try {
    if (!wide) {  // as they are
      stage_runs(imp, tensor, si, (const unsigned char *)data, &add);
    } else {
      std::vector<float> x((size_t)n), a((size_t)want);
      std::vector<unsigned char> codes((size_t)n);
      convert(data, dt, x.data(), ZOPT_DTYPE_F32, n);
      q8_encode_n(x.data(), n, k == ZOPT_STATE_EXP_AVG_SQ, codes.data(), a.data());
      stage_runs(imp, tensor, si, codes.data(), &add);
      stage_runs(imp, tensor, ai, (const unsigned char *)a.data(), &add);
    }
    imp->sg.dests.reserve(imp->sg.dests.size() + add.size());
  } catch (...) {
    return fail(ZOPT_ERR_OUT_OF_MEMORY, "%s: out of memory", fn);
  }
  for (ckpt::Staged::Dest &x : add) imp->sg.dests.push_back(std::move(x));
  mine = 1;
  if (wide) imp->put[(size_t)tensor * S + (size_t)ai] = 1;
  return ZOPT_OK;
}

// Codes put without their absmax (or the other way) would decode with
// another block's scale: refused at commit.
zopt_status q8_pairs_put(zopt_state_import *imp, const char *fn) {
  const zopt_step_descriptor *d = imp->o->d;
  const size_t S = d->num_states, T = imp->o->tensors.size();
  for (uint32_t s = 0; s < S; ++s) {
    if (d->states[s].dtype != ZOPT_DTYPE_Q8) continue;
    const int ai = state_index(d, d->states[s].kind == ZOPT_STATE_EXP_AVG ? ZOPT_STATE_EXP_AVG_ABSMAX
                                                                          : ZOPT_STATE_EXP_AVG_SQ_ABSMAX);
    for (size_t t = 0; t < T; ++t)
      if (imp->put[t * S + s] != imp->put[t * S + (size_t)ai])
        return fail(ZOPT_ERR_INVALID_ARGUMENT,
                    "%s: tensor %zu's %s was put without its %s (q8 codes and their per-block absmax go together: "
                    "put both, or the moment's f32 values alone)",
                    fn, t, state_kind_name(d->states[imp->put[t * S + s] ? s : (uint32_t)ai].kind),
                    state_kind_name(d->states[imp->put[t * S + s] ? (uint32_t)ai : s].kind));
  }
  return ZOPT_OK;
}

}  // namespace

extern "C" {

ZOPT_API zopt_status zopt_optimizer_export_state(const zopt_optimizer *co, void **buf, size_t *size, uint32_t flags) {
  const char *fn = "zopt_optimizer_export_state";
  zopt_optimizer *o = const_cast<zopt_optimizer *>(co);
  ZOPT_ENTER_CALL(o, fn);
  if (zopt_status st = check_idle(o, fn)) return st;
  if (!buf || !size) return fail(ZOPT_ERR_INVALID_ARGUMENT, "%s: buf or size is NULL", fn);
  *buf = nullptr;
  *size = 0;
  if (flags & ~(uint32_t)(ZOPT_EXPORT_WHOLE | ZOPT_EXPORT_NO_CHECKSUMS))
    return fail(ZOPT_ERR_INVALID_ARGUMENT,
                "%s: unknown flags 0x%x (known: ZOPT_EXPORT_WHOLE, ZOPT_EXPORT_NO_CHECKSUMS)", fn, flags);
  if (!o->finalized) return fail(ZOPT_ERR_BAD_STATE, "%s: call zopt_optimizer_finalize first", fn);
  // Step counts and scaler from where the backend keeps them (the device:
  // waits for the stream).
  if (zopt_status st = o->backend->pull(o)) return st;
  // The identity of the set (a collective at W > 1), as a save's.
  ckpt::SaveId id;
  if (zopt_status st = ckpt::agree_save_id(o, "(export)", &id, "EXPORT identity")) return st;
  MemSink sink;
  const bool whole = flags & ZOPT_EXPORT_WHOLE;
  zopt_status st = ckpt::write_image(o, id, whole, sink, fn, !(flags & ZOPT_EXPORT_NO_CHECKSUMS));
  // The same outcome on every rank (a whole image gathered: its
  // collectives' failures are already every rank's).
  if (!whole)
    if (zopt_status ag = ckpt::agree_status(o, st, "EXPORT status", kSigUnchanged)) return ag;
  if (st) return st;
  sink.release(buf, size);
  return ZOPT_OK;
}

ZOPT_API void zopt_state_buffer_free(void *buf) { free(buf); }

ZOPT_API zopt_status zopt_optimizer_import_state_set(zopt_optimizer *o, int n, const void *const *bufs,
                                                     const size_t *sizes, uint32_t flags) {
  const char *fn = "zopt_optimizer_import_state";
  ZOPT_ENTER_CALL(o, fn);
  if (zopt_status st = check_idle(o, fn)) return st;
  if (n < 1 || n > (1 << 20) || !bufs || !sizes)
    return fail(ZOPT_ERR_INVALID_ARGUMENT, "%s: n = %d buffers (1 .. 2^20) with %s", fn, n,
                !bufs || !sizes ? "a NULL array" : "their sizes");
  for (int i = 0; i < n; ++i)
    if (!bufs[i]) return fail(ZOPT_ERR_INVALID_ARGUMENT, "%s: buffer %d is NULL", fn, i);
  if (zopt_status st = check_load_flags(flags, fn)) return st;
  if (!o->finalized) return fail(ZOPT_ERR_BAD_STATE, "%s: call zopt_optimizer_finalize first", fn);
  ckpt::Staged sg;
  zopt_status st = ckpt::stage_memory(o, n, bufs, sizes, flags, sg);
  // Nothing applied yet (kSigUnchanged): a rank at another call fails this
  // import cleanly.
  if (zopt_status ag = ckpt::agree_status(o, st, "IMPORT status", kSigUnchanged)) return ag;
  if (zopt_status ag = ckpt::agree_staged(o, sg, fn, "IMPORT counts and settings")) return ag;
  if (flags & ZOPT_LOAD_VALIDATE_ONLY) return ZOPT_OK;
  return ckpt::apply(o, sg);
}

ZOPT_API zopt_status zopt_optimizer_import_state(zopt_optimizer *o, const void *buf, size_t size, uint32_t flags) {
  return zopt_optimizer_import_state_set(o, 1, &buf, &size, flags);
}

// ---- the staged import --------------------------------------------------------

ZOPT_API zopt_status zopt_optimizer_import_begin(zopt_optimizer *o, zopt_state_import **out) {
  const char *fn = "zopt_optimizer_import_begin";
  ZOPT_ENTER_CALL(o, fn);
  if (zopt_status st = check_idle(o, fn)) return st;
  if (!out) return fail(ZOPT_ERR_INVALID_ARGUMENT, "%s: out is NULL", fn);
  *out = nullptr;
  if (!o->finalized) return fail(ZOPT_ERR_BAD_STATE, "%s: call zopt_optimizer_finalize first", fn);
  // The scaler's current state from where the backend keeps it.
  if (zopt_status st = o->backend->pull(o)) return st;
  zopt_state_import *imp = new (std::nothrow) zopt_state_import;
  if (!imp) return fail(ZOPT_ERR_OUT_OF_MEMORY, "%s: out of memory", fn);
  try {
    imp->o = o;
    imp->generation = o->generation;
    imp->put.assign(o->tensors.size() * o->d->num_states, 0);
    imp->sg.tensor_steps.assign(o->tensors.size(), 0);
    for (const Group &g : o->groups) {
      ckpt::GroupRec r;
      r.flags = g.flags;
      for (uint32_t h = 0; h < o->d->num_hypers; ++h) r.hypers.emplace_back(o->d->hypers[h].kind, g.hypers[h]);
      imp->sg.groups.push_back(std::move(r));
    }
  } catch (...) {
    delete imp;
    return fail(ZOPT_ERR_OUT_OF_MEMORY, "%s: out of memory", fn);
  }
  imp->sg.scaler = o->scaler;
  imp->sg.seed = o->seed;
  imp->sg.has_seed = true;
  *out = imp;
  return ZOPT_OK;
}

ZOPT_API zopt_status zopt_state_import_put(zopt_state_import *imp, int tensor, zopt_state_kind kind, zopt_dtype dtype,
                                           const void *data, int64_t numel) {
  const char *fn = "zopt_state_import_put";
  ZOPT_ENTER_IMPORT(imp, fn);
  zopt_optimizer *o = imp->o;
  const zopt_step_descriptor *d = o->d;
  if (zopt_status st = check_tensor(o, tensor, fn)) return st;
  const uint32_t k = raw_enum(kind), dt = raw_enum(dtype);
  const int si = state_index(d, k);
  if (si < 0 || !ckpt::saved_state(o, (uint32_t)si))
    return fail(ZOPT_ERR_INVALID_ARGUMENT,
                "%s: step '%s' holds no %s state of its own (kind %u; the optimizer states%s)", fn, d->name,
                k >= 1 && k <= 7 ? state_kind_name(k) : "such", k,
                k == ZOPT_STATE_PARAM ? ": the params are the model's, not the optimizer's, except under ZeRO-3" : "");
  const bool rem = d->states[si].dtype == ZOPT_DTYPE_I16;  // a remainder master (abi.h)
  const bool q8 = d->states[si].dtype == ZOPT_DTYPE_Q8, absmax = is_per_block(d, si);  // abi.h "q8 moments"
  if (q8 || absmax) return put_q8(imp, tensor, si, dt, data, numel, fn);
  if (dt != ZOPT_DTYPE_F32 && dt != ZOPT_DTYPE_BF16 && dt != ZOPT_DTYPE_F16 && !(rem && dt == ZOPT_DTYPE_I16))
    return fail(ZOPT_ERR_INVALID_ARGUMENT, "%s: dtype %u (f32, bf16 or f16; i16 for a remainder master)", fn, dt);
  if (rem != (dt == ZOPT_DTYPE_I16))
    return fail(ZOPT_ERR_UNSUPPORTED,
                "%s: step '%s' keeps its master as a remainder beside the param (abi.h \"Remainder masters\"): "
                "put its int16 low halves as i16 (with the params they belong to), or leave it out and it starts "
                "from the params",
                fn, d->name);
  const Tensor &x = o->tensors[tensor];
  if (numel != x.numel)
    return fail(ZOPT_ERR_INVALID_ARGUMENT, "%s: numel %lld != tensor %d's %lld", fn, (long long)numel, tensor,
                (long long)x.numel);
  if (numel && !data) return fail(ZOPT_ERR_INVALID_ARGUMENT, "%s: data is NULL", fn);
  const size_t S = d->num_states;
  if (imp->put[(size_t)tensor * S + (size_t)si])
    return fail(ZOPT_ERR_INVALID_ARGUMENT, "%s: tensor %d's %s was put already", fn, tensor, state_kind_name(k));
  const uint32_t sdt = d->states[si].dtype;
  std::vector<exec::Run> runs;
  try {
    exec::runs(o, tensor, si, &runs);
    std::vector<ckpt::Staged::Dest> add;
    for (const exec::Run &r : runs) {
      ckpt::Staged::Dest dst{tensor, si, r.start, r.len, {}};
      dst.bytes.resize((size_t)r.len * dtype_size(sdt));
      convert((const char *)data + (size_t)r.start * dtype_size(dt), dt, dst.bytes.data(), sdt, r.len);
      add.push_back(std::move(dst));
    }
    imp->sg.dests.reserve(imp->sg.dests.size() + add.size());
    for (ckpt::Staged::Dest &x2 : add) imp->sg.dests.push_back(std::move(x2));
  } catch (...) {
    return fail(ZOPT_ERR_OUT_OF_MEMORY, "%s: out of memory", fn);
  }
  imp->put[(size_t)tensor * S + (size_t)si] = 1;
  return ZOPT_OK;
}

ZOPT_API zopt_status zopt_state_import_set_tensor_step(zopt_state_import *imp, int tensor, int64_t steps) {
  const char *fn = "zopt_state_import_set_tensor_step";
  ZOPT_ENTER_IMPORT(imp, fn);
  if (zopt_status st = check_tensor(imp->o, tensor, fn)) return st;
  if (steps < 0) return fail(ZOPT_ERR_INVALID_ARGUMENT, "%s: steps %lld < 0", fn, (long long)steps);
  imp->sg.tensor_steps[(size_t)tensor] = steps;
  return ZOPT_OK;
}

ZOPT_API zopt_status zopt_state_import_set_group(zopt_state_import *imp, int group, int64_t step_count, uint32_t flags) {
  const char *fn = "zopt_state_import_set_group";
  ZOPT_ENTER_IMPORT(imp, fn);
  if (zopt_status st = check_group(imp->o, group, fn)) return st;
  if (step_count < 0) return fail(ZOPT_ERR_INVALID_ARGUMENT, "%s: step_count %lld < 0", fn, (long long)step_count);
  if (flags & ~ZOPT_GROUP_MAXIMIZE)
    return fail(ZOPT_ERR_INVALID_ARGUMENT, "%s: flags 0x%x has unknown bits (known: ZOPT_GROUP_MAXIMIZE = 0x%x)", fn,
                flags, ZOPT_GROUP_MAXIMIZE);
  imp->sg.groups[(size_t)group].step_count = step_count;
  imp->sg.groups[(size_t)group].flags = flags;
  return ZOPT_OK;
}

ZOPT_API zopt_status zopt_state_import_set_hyper(zopt_state_import *imp, int group, const char *name, double value) {
  const char *fn = "zopt_state_import_set_hyper";
  ZOPT_ENTER_IMPORT(imp, fn);
  const zopt_step_descriptor *d = imp->o->d;
  if (zopt_status st = check_group(imp->o, group, fn)) return st;
  if (!name) return fail(ZOPT_ERR_INVALID_ARGUMENT, "%s: name is NULL", fn);
  const int kind = hyper_kind_from_name(name);
  const int hi = kind ? hyper_index(d, (uint32_t)kind) : -1;
  if (hi < 0) return fail(ZOPT_ERR_INVALID_ARGUMENT, "%s: step '%s' has no '%s' hyperparameter", fn, d->name, name);
  const zopt_hyper_desc &h = d->hypers[hi];
  if (!(std::isfinite(value) && value >= h.min_value && (h.max_exclusive ? value < h.max_value : value <= h.max_value)))
    return fail(ZOPT_ERR_INVALID_ARGUMENT, "%s: %s = %g out of range [%g, %g%c", fn, name, value, h.min_value,
                h.max_value, h.max_exclusive ? ')' : ']');
  imp->sg.groups[(size_t)group].hypers[(size_t)hi].second = value;
  return ZOPT_OK;
}

ZOPT_API zopt_status zopt_state_import_set_loss_scaler(zopt_state_import *imp, const zopt_loss_scaler_config *c,
                                                       double scale, int64_t good_steps) {
  const char *fn = "zopt_state_import_set_loss_scaler";
  ZOPT_ENTER_IMPORT(imp, fn);
  if (!(std::isfinite(scale) && scale > 0) || good_steps < 0)
    return fail(ZOPT_ERR_INVALID_ARGUMENT, "%s: scale %g must be finite and > 0, good_steps %lld >= 0", fn, scale,
                (long long)good_steps);
  if (c) {
    const bool ok = std::isfinite(c->init_scale) && c->init_scale > 0 && (c->dynamic == 0 || c->dynamic == 1) &&
                    (!c->dynamic || (std::isfinite(c->growth_factor) && c->growth_factor >= 1 &&
                                     c->backoff_factor > 0 && c->backoff_factor < 1 && c->growth_interval >= 1 &&
                                     std::isfinite(c->min_scale) && c->min_scale > 0 &&
                                     c->min_scale <= c->init_scale));
    if (!ok)
      return fail(ZOPT_ERR_INVALID_ARGUMENT,
                  "%s: invalid configuration (init_scale %g, growth_factor %g, backoff_factor %g, growth_interval "
                  "%lld, min_scale %g, dynamic %d; zopt_optimizer_configure_loss_scaler's ranges)",
                  fn, c->init_scale, c->growth_factor, c->backoff_factor, (long long)c->growth_interval,
                  c->min_scale, c->dynamic);
    imp->sg.scaler.cfg = *c;
  }
  imp->sg.scaler.scale = scale;
  imp->sg.scaler.good_steps = good_steps;
  return ZOPT_OK;
}

ZOPT_API zopt_status zopt_state_import_set_seed(zopt_state_import *imp, uint64_t seed) {
  ZOPT_ENTER_IMPORT(imp, "zopt_state_import_set_seed");
  imp->sg.seed = seed;
  return ZOPT_OK;
}

ZOPT_API zopt_status zopt_state_import_commit(zopt_state_import *imp) {
  const char *fn = "zopt_state_import_commit";
  std::unique_ptr<zopt_state_import> hold(imp);  // commit frees the import, whatever happens
  ZOPT_ENTER_IMPORT(imp, fn);
  zopt_status st = q8_pairs_put(imp, fn);
  if (!st) st = complete(imp, fn);
  if (zopt_status ag = agree_import(imp, st, fn)) return ag;
  return ckpt::apply(imp->o, imp->sg);
}

ZOPT_API void zopt_state_import_abort(zopt_state_import *imp) { delete imp; }

}  // extern "C"

namespace zopt {
namespace ckpt {

uint64_t staged_hash(const Staged &sg) {
  uint64_t h = fnv1a64(sg.tensor_steps.data(), sg.tensor_steps.size() * sizeof(int64_t));
  for (const GroupRec &g : sg.groups) {
    h = fnv1a64(&g.step_count, sizeof g.step_count, h);
    h = fnv1a64(&g.flags, sizeof g.flags, h);
    for (auto &kv : g.hypers) h = fnv1a64(&kv.second, sizeof kv.second, h);
  }
  const LossScaler &ls = sg.scaler;
  const double sc[6] = {ls.scale, ls.cfg.init_scale, ls.cfg.growth_factor, ls.cfg.backoff_factor, ls.cfg.min_scale,
                        (double)ls.cfg.dynamic};
  const int64_t ic[2] = {ls.good_steps, ls.cfg.growth_interval};
  h = fnv1a64(sc, sizeof sc, h);
  h = fnv1a64(ic, sizeof ic, h);
  h = fnv1a64(&sg.seed, sizeof sg.seed, h);
  if (sg.has_id) h = fnv1a64(sg.id.b, kSaveIdBytes, h);
  return h;
}

zopt_status agree_staged(zopt_optimizer *o, const Staged &sg, const char *fn, const char *what) {
  if (o->world == 1) return ZOPT_OK;
  const uint64_t h = staged_hash(sg);
  std::vector<uint64_t> all((size_t)o->world);
  if (zopt_status cs = comm_all_gather(o->comm, &h, all.data(), sizeof h, what, kSigUnchanged)) return cs;
  std::vector<int> bad;
  for (int q = 1; q < o->world; ++q)
    if (all[(size_t)q] != all[0]) bad.push_back(q);
  if (!bad.empty())
    return fail(ZOPT_ERR_INVALID_ARGUMENT,
                "%s: %s %s another save, or other step counts, hyperparameters, group flags, loss scaler or seed, "
                "than rank 0: every rank must load the same checkpoint (nothing changed)",
                fn, comm_rank_list(bad).c_str(), bad.size() > 1 ? "have" : "has");
  return ZOPT_OK;
}

}  // namespace ckpt
}  // namespace zopt
