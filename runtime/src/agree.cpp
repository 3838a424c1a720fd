// agree.cpp - what the ranks agree on at finalize and at every step, and
// the messages naming the setting that differs (agree.h).
#include "agree.h"

#include "backend/backend.h"

#include "comm/comm_internal.h"
#include "layout/layout.h"

#include <cinttypes>
#include <cmath>
#include <cstdio>

namespace zopt {

// ---- Settings ----------------------------------------------------------------

void Settings::push(std::string name, Kind k, const uint64_t *w, size_t n) {
  fields_.push_back(Field{std::move(name), k, words_.size(), n});
  words_.insert(words_.end(), w, w + n);
}

void Settings::add_int(std::string name, int64_t v) {
  uint64_t w;
  memcpy(&w, &v, 8);
  push(std::move(name), INT, &w, 1);
}

void Settings::add_real(std::string name, double v) {
  uint64_t w;
  memcpy(&w, &v, 8);
  push(std::move(name), REAL, &w, 1);
}

void Settings::add_clip(std::string name, double v) {
  uint64_t w;
  memcpy(&w, &v, 8);
  push(std::move(name), CLIP, &w, 1);
}

void Settings::add_bool(std::string name, bool v) {
  uint64_t w = v ? 1 : 0;
  push(std::move(name), BOOL, &w, 1);
}

void Settings::add_hex(std::string name, uint64_t v) { push(std::move(name), HEX, &v, 1); }

void Settings::add_text(std::string name, const char *s, int words) {
  std::vector<uint64_t> w((size_t)words, 0);
  if (s) strncpy((char *)w.data(), s, (size_t)words * 8 - 1);
  push(std::move(name), TEXT, w.data(), w.size());
}

const Settings::Field *Settings::find(const std::string &name) const {
  for (const Field &f : fields_)
    if (f.name == name) return &f;
  return nullptr;
}

std::string Settings::value(const Field &f, const uint64_t *w) const {
  char buf[96];
  switch (f.kind) {
    case INT: {
      int64_t v;
      memcpy(&v, w, 8);
      snprintf(buf, sizeof buf, "%" PRId64, v);
      break;
    }
    case REAL:
    case CLIP: {
      double v;
      memcpy(&v, w, 8);
      if (f.kind == CLIP && v == 0) return "off";
      snprintf(buf, sizeof buf, "%.17g", v);
      break;
    }
    case BOOL: return *w ? "on" : "off";
    case HEX: snprintf(buf, sizeof buf, "0x%016" PRIx64, *w); break;
    case TEXT: {
      std::string s((const char *)w, strnlen((const char *)w, f.n * 8));
      for (char &c : s)
        if ((unsigned char)c < 32) c = '?';
      return "'" + s + "'";
    }
  }
  return buf;
}

std::vector<int> Settings::ranks_differing(const uint64_t *all, int world, const std::string &name) const {
  std::vector<int> out;
  const Field *f = find(name);
  if (!f) return out;
  const size_t per = words_.size();
  for (int q = 1; q < world; ++q)
    if (memcmp(all + (size_t)q * per + f->at, all + f->at, f->n * 8) != 0) out.push_back(q);
  return out;
}

std::string Settings::diff(const uint64_t *all, int world, size_t max_fields, const std::vector<std::string> &skip,
                           std::vector<std::string> *differs) const {
  const size_t per = words_.size();
  std::string out;
  size_t shown = 0, more = 0;
  for (const Field &f : fields_) {
    std::vector<int> odd = ranks_differing(all, world, f.name);
    if (odd.empty()) continue;
    if (differs) differs->push_back(f.name);
    bool hidden = false;
    for (const std::string &s : skip) hidden = hidden || s == f.name;
    if (hidden) continue;
    if (shown == max_fields) {
      ++more;
      continue;
    }
    ++shown;
    std::string v0 = value(f, all + f.at);
    std::string s = f.name + ": rank 0 has " + v0;
    // Each rank that differs with its value; ranks sharing one value are
    // listed together ("ranks 1, 3 have 0.5").
    std::vector<bool> done(odd.size(), false);
    size_t groups = 0;
    for (size_t i = 0; i < odd.size(); ++i) {
      if (done[i]) continue;
      const uint64_t *wi = all + (size_t)odd[i] * per + f.at;
      std::vector<int> same;
      for (size_t j = i; j < odd.size(); ++j)
        if (!done[j] && memcmp(all + (size_t)odd[j] * per + f.at, wi, f.n * 8) == 0) same.push_back(odd[j]), done[j] = true;
      if (++groups > 3) {
        s += ", ...";
        break;
      }
      s += ", " + comm_rank_list(same) + (same.size() == 1 ? " has " : " have ") + value(f, wi);
    }
    out += (out.empty() ? "" : "; ") + s;
  }
  if (more) out += "; and " + std::to_string(more) + " more setting" + (more == 1 ? "" : "s");
  return out;
}

// ---- finalize ------------------------------------------------------------------

namespace {

// Eight bytes at a time (a pass at memory speed over every param).
uint64_t mix(const void *p, size_t n, uint64_t h) {
  const unsigned char *c = (const unsigned char *)p;
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    uint64_t w;
    memcpy(&w, c + i, 8);
    h = (h ^ w) * 0x100000001B3ull;
    h ^= h >> 29;
  }
  return fnv1a64(c + i, n - i, h);
}

const char *const kTensors = "tensor sizes and groups";
const char *const kParams = "param values";

}  // namespace

zopt_status agree_at_finalize(zopt_optimizer *o) {
  const zopt_step_descriptor *d = o->d;
  Settings s;
  s.add_text("step", d->name, 6);
  s.add_hex("step description (checksum)", d->checksum);
  s.add_int("ZeRO stage", d->zero_stage);
  s.add_clip("clip max_norm", (d->flags & ZOPT_FLAG_CLIP) ? d->max_norm : 0);
  s.add_bool("loss scaling", d->flags & ZOPT_FLAG_LOSS_SCALE);
  s.add_int("bucket size (elements; 0: the default)", o->bucket_elems);
  s.add_bool("gradient streaming", o->stream_grads);
  s.add_int("group count", (int64_t)o->groups.size());
  s.add_int("tensor count", (int64_t)o->tensors.size());
  uint64_t h = kFnvBasis;
  for (const Tensor &x : o->tensors) {
    int64_t v[2] = {x.group, x.numel};
    h = fnv1a64(v, sizeof v, h);
  }
  s.add_hex(kTensors, h);
  // The params as this rank sees them (user memory, or the offload staging).
  const int pi = o->step->param_index;
  const size_t es = dtype_size(d->states[pi].dtype);
  uint64_t ph = kFnvBasis;
  for (size_t t = 0; t < o->tensors.size(); ++t) {
    const Tensor &x = o->tensors[t];
    if (!x.numel) continue;
    const void *p = o->backend->param_on_host(o, (int)t);
    ph = mix(p, (size_t)x.numel * es, ph);
  }
  s.add_hex(kParams, ph);
  const int W = o->world;
  std::vector<uint64_t> all(s.size() * (size_t)W);
  if (zopt_status st = comm_all_gather(o->comm, s.words().data(), all.data(), s.size() * 8,
                                       "FINALIZE layout and param check", kSigUnchanged))
    return st;
  std::vector<std::string> differs;
  std::string msg = s.diff(all.data(), W, 4, {kTensors, kParams}, &differs);
  const char *const tail =
      "every rank must build the same optimizer: the same step, bucket size, groups and tensors in the same order";
  if (!msg.empty())
    return fail(ZOPT_ERR_INVALID_ARGUMENT, "zopt_optimizer_finalize: the ranks' optimizers differ: %s: %s",
                msg.c_str(), tail);
  bool tensors_differ = false;
  for (const std::string &f : differs) tensors_differ = tensors_differ || f == kTensors;
  if (tensors_differ) {
    // Same counts, other sizes or groups: every rank saw the same hashes,
    // so every rank makes this second exchange, naming the tensors.
    Settings t;
    for (size_t i = 0; i < o->tensors.size(); ++i) {
      t.add_int("tensor " + std::to_string(i) + " elements", o->tensors[i].numel);
      t.add_int("tensor " + std::to_string(i) + " group", o->tensors[i].group);
    }
    std::vector<uint64_t> tall(t.size() * (size_t)W);
    if (zopt_status st = comm_all_gather(o->comm, t.words().data(), tall.data(), t.size() * 8,
                                         "FINALIZE tensor sizes and groups", kSigUnchanged))
      return st;
    msg = t.diff(tall.data(), W, 3);
    return fail(ZOPT_ERR_INVALID_ARGUMENT, "zopt_optimizer_finalize: the ranks' optimizers differ: %s: %s",
                msg.c_str(), tail);
  }
  std::vector<int> bad = s.ranks_differing(all.data(), W, kParams);
  if (!bad.empty())
    return fail(ZOPT_ERR_INVALID_ARGUMENT,
                "zopt_optimizer_finalize: the param values of %s differ from rank 0's: every rank must start from "
                "the same weights (seed the model identically or load the same checkpoint on every rank)",
                comm_rank_list(bad).c_str());
  return ZOPT_OK;
}

// ---- the step --------------------------------------------------------------------

Settings step_settings(const zopt_optimizer *o) {
  Settings s;
  s.add_hex("seed", o->seed);
  s.add_real("gradient divisor", grad_divisor(o));
  s.add_real("loss scale", loss_scale(o));
  s.add_clip("clip max_norm", (o->d->flags & ZOPT_FLAG_CLIP) ? o->max_norm : 0);
  for (size_t g = 0; g < o->groups.size(); ++g) {
    const Group &x = o->groups[g];
    const std::string p = "group " + std::to_string(g) + " ";
    s.add_int(p + "step count", x.step_count);
    s.add_int(p + "flags (bit 0: maximize)", (int64_t)x.flags);
    for (size_t i = 0; i < x.hypers.size() && i < o->d->num_hypers; ++i)
      s.add_real(p + hyper_name(o->d->hypers[i].kind), x.hypers[i]);
  }
  return s;
}

zopt_status explain_step_disagreement(zopt_optimizer *o) {
  Settings s = step_settings(o);
  const int W = o->world;
  std::vector<uint64_t> all(s.size() * (size_t)W);
  if (zopt_status st = comm_all_gather(o->comm, s.words().data(), all.data(), s.size() * 8, "STEP settings", kSigUnchanged))
    return st;
  std::string msg = s.diff(all.data(), W);
  if (msg.empty()) msg = "(the settings hashes differ but the values agree: ranks out of step)";
  return fail(ZOPT_ERR_INVALID_ARGUMENT,
              "zopt_optimizer_step: the ranks' settings differ: %s: every rank must step with the same "
              "hyperparameters, group flags, step counts, seed, gradient divisor, loss scale and max_norm",
              msg.c_str());
}

}  // namespace zopt
