// state_check_image.cpp - zopt-state-check's tests 3 to 5 (state_check.cpp
// says what they check): the state exported and imported in memory against
// save and load, corrupt images refused, the staged import.
#include "state_test_util.h"

#include "zopt/comm.h"
#include "zopt/zopt.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <string>
#include <vector>

namespace stt {

// ---- 3, 4. export and import ----------------------------------------------------

bool all_sharded(const zopt_step_descriptor *d) {
  for (uint32_t k = 0; k < d->num_states; ++k) {
    const zopt_state_desc &sd = d->states[k];
    const bool held = is_owned(sd.kind) || (sd.kind == ZOPT_STATE_PARAM && (sd.flags & ZOPT_STATE_PARTITIONED));
    if (held && !(sd.flags & ZOPT_STATE_PARTITIONED)) return false;
  }
  return true;
}

void test_export_import() {
  std::vector<std::vector<unsigned char>> images((size_t)g_world), wholes((size_t)g_world), files((size_t)g_world);
  std::vector<Snap> want((size_t)g_world);
  std::atomic<bool> set_ok{true}, whole_ok{true}, own_ok{true}, load_ok{true}, validate_ok{true}, changed{true};
  Outcomes own;
  const bool sharded = all_sharded([] {
    zopt_step *s = nullptr;
    zopt_step_load(g_step.c_str(), &s);
    static zopt_step_descriptor d;
    d = *zopt_step_get_descriptor(s);
    zopt_step_free(s);
    return &d;
  }());
  const std::string path = g_dir.empty() ? "" : g_dir + "/" + g_name + ".w" + std::to_string(g_world) + ".ck";
  on_ranks([&](int r, zopt_comm *c) {
    Rank A;
    RANK_CK(build_old(A, c));
    RANK_CK(A.snapshot(&want[(size_t)r]));
    void *b = nullptr;
    size_t n = 0;
    RANK_CK(zopt_optimizer_export_state(A.o, &b, &n, 0) == ZOPT_OK);
    images[(size_t)r] = to_vec(b, n);
    RANK_CK(zopt_optimizer_export_state(A.o, &b, &n, ZOPT_EXPORT_WHOLE) == ZOPT_OK);
    wholes[(size_t)r] = to_vec(b, n);
    if (!path.empty()) RANK_CK(zopt_optimizer_save(A.o, path.c_str()) == ZOPT_OK);
    // The model's params as they were (the caller restores them before a
    // load: docs/CHECKPOINT.md), before each import.
    const std::vector<std::vector<unsigned char>> params = A.params();
    auto model_back = [&] {
      if (!A.zero3 && !A.set_params(params)) set_ok = false;
    };
    Snap s;
    auto restored = [&](std::atomic<bool> &ok) {
      if (!A.snapshot(&s) || s != want[(size_t)r]) {
        ok = false;
        fprintf(stderr, "rank %d: differs at %s\n", r, diff(s, want[(size_t)r]).c_str());
      }
    };
    auto drift = [&] {
      if (!A.steps(7, 1) || !A.snapshot(&s) || s == want[(size_t)r]) changed = false;
    };
    std::vector<const void *> bufs;
    std::vector<size_t> sizes;
    for (int q = 0; q < g_world; ++q) {  // every rank's image (the threads wrote theirs before the first drift's step)
      bufs.push_back(nullptr);
      sizes.push_back(0);
    }
    drift();  // a collective: every rank's images exist after it
    for (int q = 0; q < g_world; ++q) {
      bufs[(size_t)q] = images[(size_t)q].data();
      sizes[(size_t)q] = images[(size_t)q].size();
    }
    model_back();
    RANK_CK(zopt_optimizer_import_state_set(A.o, g_world, bufs.data(), sizes.data(), 0) == ZOPT_OK);
    restored(set_ok);
    drift();
    model_back();
    RANK_CK(zopt_optimizer_import_state(A.o, wholes[(size_t)r].data(), wholes[(size_t)r].size(), 0) == ZOPT_OK);
    restored(whole_ok);
    drift();
    model_back();
    Snap before;
    RANK_CK(A.snapshot(&before));
    RANK_CK(zopt_optimizer_import_state(A.o, wholes[0].data(), wholes[0].size(), ZOPT_LOAD_VALIDATE_ONLY) == ZOPT_OK);
    RANK_CK(A.snapshot(&s));
    if (s != before) validate_ok = false;
    own.set(r, zopt_optimizer_import_state(A.o, images[(size_t)r].data(), images[(size_t)r].size(), 0));
    if (own.st[(size_t)r] == ZOPT_OK) restored(own_ok);
    else if (!A.snapshot(&s) || s != before) own_ok = false;
    if (!path.empty()) {
      drift();
      model_back();
      RANK_CK(zopt_optimizer_load(A.o, path.c_str()) == ZOPT_OK);
      restored(load_ok);
    }
  });
  report(changed, "(a step after each import changes the state)");
  report(set_ok, "export (each rank's image) -> import of the set: bit-identical");
  report(whole_ok, "export WHOLE -> import on every rank: bit-identical");
  report(validate_ok, "import with ZOPT_LOAD_VALIDATE_ONLY: nothing changed");
  bool same_whole = true;
  for (int q = 1; q < g_world; ++q) same_whole = same_whole && wholes[(size_t)q] == wholes[0];
  report(same_whole, "every rank's WHOLE image is the same bytes");
  if (sharded || g_world == 1)
    report(own.all(ZOPT_OK) && own_ok, "a rank's own image alone imports (every saved state sharded): bit-identical");
  else
    report(own.all(ZOPT_ERR_CHECKPOINT) && own_ok,
           "a rank's own image alone is refused where a state is held whole on every rank (ZeRO-0), nothing changed "
           "(%s)",
           own.msg[0].c_str());
  if (!path.empty()) {
    report(load_ok, "save -> load of the same state: bit-identical");
    // A rank's image is its file's bytes, but the save identity (and the
    // header checksum over it).
    bool same = true;
    std::vector<unsigned char> f0 = ckt::slurp(path);
    std::string id_hex;
    for (size_t i = 0; i < 16 && f0.size() > ckt::kIdAt + 16; ++i) {
      char h[3];
      snprintf(h, sizeof h, "%02x", f0[ckt::kIdAt + i]);
      id_hex += h;
    }
    for (int q = 0; q < g_world; ++q) {
      std::vector<unsigned char> f =
          q == 0 ? f0 : ckt::slurp(path + "." + std::to_string(q) + "-of-" + std::to_string(g_world) + "." + id_hex);
      std::vector<unsigned char> img = images[(size_t)q];
      if (f.size() != img.size() || img.size() < ckt::kIdAt + 16) {
        same = false;
        continue;
      }
      memcpy(img.data() + ckt::kIdAt, f.data() + ckt::kIdAt, 16);
      ckt::reseal(img);
      same = same && img == f;
    }
    report(same, "each rank's exported image is the bytes save writes into its file (but the save identity)");
  }
  // Into one rank (W' = 1): the set and the whole image.
  if (g_world > 1) {
    const int W = g_world;
    g_world = 1;
    std::atomic<bool> one{true};
    on_ranks([&](int r, zopt_comm *c) {
      Rank A;
      RANK_CK(build_old(A, c));
      std::vector<const void *> bufs;
      std::vector<size_t> sizes;
      for (int q = W - 1; q >= 0; --q) {  // any order
        bufs.push_back(images[(size_t)q].data());
        sizes.push_back(images[(size_t)q].size());
      }
      Snap s;
      // The model as the W ranks' was (restored by the caller before a load).
      int pk = -1;
      for (uint32_t k = 0; k < A.d->num_states; ++k)
        if (A.d->states[k].kind == ZOPT_STATE_PARAM) pk = (int)k;
      std::vector<std::vector<unsigned char>> params;
      for (size_t t = 0; t < A.reg; ++t) params.push_back(want[0].st[t][(size_t)pk]);
      if (!A.zero3) RANK_CK(A.set_params(params));
      RANK_CK(zopt_optimizer_import_state_set(A.o, W, bufs.data(), sizes.data(), 0) == ZOPT_OK);
      if (!A.snapshot(&s) || diff(s, want[0]) != "") one = false;
      RANK_CK(A.steps(9, 1));
      if (!A.zero3) RANK_CK(A.set_params(params));
      RANK_CK(zopt_optimizer_import_state(A.o, wholes[0].data(), wholes[0].size(), 0) == ZOPT_OK);
      if (!A.snapshot(&s) || diff(s, want[0]) != "") one = false;
    });
    g_world = W;
    report(one, "the %d ranks' set (in reverse order) and the WHOLE image import into one rank: bit-identical", W);
  }
}

// ZOPT_EXPORT_NO_CHECKSUMS: the WHOLE image with the header flag set and the
// pieces' checksums 0 (else the same bytes), imported bit-identical; the
// same bytes in a file are refused by load; unknown export flags refused.
void test_unhashed() {
  std::vector<std::vector<unsigned char>> hashed((size_t)g_world), plain((size_t)g_world);
  std::atomic<bool> ok{true}, unchanged{true};
  Outcomes file, bad_flag;
  const std::string dir = g_dir.empty() ? (getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp") : g_dir;
  on_ranks([&](int r, zopt_comm *c) {
    Rank A;
    RANK_CK(build_old(A, c));
    Snap want, s;
    RANK_CK(A.snapshot(&want));
    void *b = nullptr;
    size_t n = 0;
    RANK_CK(zopt_optimizer_export_state(A.o, &b, &n, ZOPT_EXPORT_WHOLE) == ZOPT_OK);
    hashed[(size_t)r] = to_vec(b, n);
    RANK_CK(zopt_optimizer_export_state(A.o, &b, &n, ZOPT_EXPORT_WHOLE | ZOPT_EXPORT_NO_CHECKSUMS) == ZOPT_OK);
    plain[(size_t)r] = to_vec(b, n);
    const std::vector<std::vector<unsigned char>> params = A.params();
    RANK_CK(A.steps(3, 1));
    if (!A.zero3) RANK_CK(A.set_params(params));
    RANK_CK(zopt_optimizer_import_state(A.o, plain[(size_t)r].data(), plain[(size_t)r].size(), 0) == ZOPT_OK);
    if (!A.snapshot(&s) || s != want) ok = false;
    const std::string f = dir + "/" + g_name + ".unhashed.w" + std::to_string(g_world);  // the same bytes on every rank
    if (r == 0) RANK_CK(ckt::spit(f, plain[0]));
    RANK_CK(!c || zopt_comm_barrier(c) == ZOPT_OK);
    file.set(r, zopt_optimizer_load(A.o, f.c_str()));
    RANK_CK(!c || zopt_comm_barrier(c) == ZOPT_OK);
    if (r == 0) unlink(f.c_str());
    bad_flag.set(r, zopt_optimizer_export_state(A.o, &b, &n, ZOPT_EXPORT_WHOLE | 4u));
    if (!A.snapshot(&s) || s != want) unchanged = false;
  });
  report(ok, "export WHOLE | NO_CHECKSUMS -> import on every rank: bit-identical");
  std::vector<unsigned char> p = plain[0], h = hashed[0];
  uint64_t np = 0, nh = 0;
  const size_t at = ckt::pieces_at(p, &np), ath = ckt::pieces_at(h, &nh);
  bool same = p.size() == h.size() && at && at == ath && np == nh && p[12] == 1 && h[12] == 0;
  for (uint64_t k = 0; same && k < np; ++k) {
    uint64_t fnv;
    memcpy(&fnv, p.data() + at + 40 * k + 32, 8);
    same = fnv == 0;
    memcpy(p.data() + at + 40 * k + 32, h.data() + at + 40 * k + 32, 8);
  }
  p[12] = 0;
  if (same) memcpy(p.data() + ckt::kIdAt, h.data() + ckt::kIdAt, 16);  // each export its identity
  ckt::reseal(p);
  for (int q = 1; q < g_world; ++q) same = same && plain[(size_t)q] == plain[0];
  report(same && p == h,
         "the NO_CHECKSUMS image is the WHOLE image with flags 1 and every piece's checksum 0 (but the identity)");
  report(file.all(ZOPT_ERR_CHECKPOINT, "never from a file") && bad_flag.all(ZOPT_ERR_INVALID_ARGUMENT) && unchanged,
         "those bytes in a file: refused by load, nothing changed; export flag 4: refused (%s)", file.msg[0].c_str());
}

void test_corrupt() {
  // Each case: a function from (this rank's image, the whole image, another
  // export's images) to the buffers this rank passes.
  using Bufs = std::vector<std::vector<unsigned char>>;
  struct Case {
    const char *what;
    std::function<Bufs(int r, const Bufs &set, const Bufs &other, const std::vector<unsigned char> &whole)> make;
    zopt_status want;
  };
  auto mut = [](std::vector<unsigned char> v, const std::function<void(std::vector<unsigned char> &)> &f) {
    f(v);
    return v;
  };
  const std::vector<Case> cases = {
      {"bad magic", [&](int, const Bufs &, const Bufs &, const std::vector<unsigned char> &w) { return Bufs{mut(w, [](auto &v) { v[0] ^= 1; })}; }, ZOPT_ERR_CHECKPOINT},
      {"a flipped header byte", [&](int, const Bufs &, const Bufs &, const std::vector<unsigned char> &w) { return Bufs{mut(w, [](auto &v) { v[ckt::kNumGroupsAt + 9] ^= 4; })}; }, ZOPT_ERR_CHECKPOINT},
      {"a flipped data byte", [&](int, const Bufs &, const Bufs &, const std::vector<unsigned char> &w) { return Bufs{mut(w, [](auto &v) { v[v.size() - 3] ^= 0x10; })}; }, ZOPT_ERR_CHECKPOINT},
      {"truncated by one byte", [&](int, const Bufs &, const Bufs &, const std::vector<unsigned char> &w) { return Bufs{mut(w, [](auto &v) { v.pop_back(); })}; }, ZOPT_ERR_CHECKPOINT},
      {"truncated to half", [&](int, const Bufs &, const Bufs &, const std::vector<unsigned char> &w) { return Bufs{mut(w, [](auto &v) { v.resize(v.size() / 2); })}; }, ZOPT_ERR_CHECKPOINT},
      {"truncated to 10 bytes", [&](int, const Bufs &, const Bufs &, const std::vector<unsigned char> &w) { return Bufs{mut(w, [](auto &v) { v.resize(10); })}; }, ZOPT_ERR_CHECKPOINT},
      {"extended by one byte", [&](int, const Bufs &, const Bufs &, const std::vector<unsigned char> &w) { return Bufs{mut(w, [](auto &v) { v.push_back(0); })}; }, ZOPT_ERR_CHECKPOINT},
      {"format version 9 (resealed)", [&](int, const Bufs &, const Bufs &, const std::vector<unsigned char> &w) { return Bufs{mut(w, [](auto &v) { v[8] = 9; ckt::reseal(v); })}; }, ZOPT_ERR_CHECKPOINT},
      {"a reserved field set (resealed)", [&](int, const Bufs &, const Bufs &, const std::vector<unsigned char> &w) { return Bufs{mut(w, [](auto &v) { v[ckt::kReservedAt] = 1; ckt::reseal(v); })}; }, ZOPT_ERR_CHECKPOINT},
      {"the whole image twice", [&](int, const Bufs &, const Bufs &, const std::vector<unsigned char> &w) { return Bufs{w, w}; }, ZOPT_ERR_CHECKPOINT},
      {"only the last rank's whole image corrupt", [&](int r, const Bufs &, const Bufs &, const std::vector<unsigned char> &w) { return Bufs{r == g_world - 1 ? mut(w, [](auto &v) { v[ckt::kNumGroupsAt + 9] ^= 4; }) : w}; }, ZOPT_ERR_CHECKPOINT},
  };
  std::vector<Case> set_cases;
  if (g_world > 1) {
    set_cases.push_back({"a set with the last rank's image of another export", [&](int, const Bufs &set, const Bufs &other, const std::vector<unsigned char> &) { Bufs b = set; b.back() = other.back(); return b; }, ZOPT_ERR_CHECKPOINT});
    set_cases.push_back({"a set with rank 0's image twice", [&](int, const Bufs &set, const Bufs &, const std::vector<unsigned char> &) { Bufs b = set; b.back() = set[0]; return b; }, ZOPT_ERR_CHECKPOINT});
    set_cases.push_back({"a set without rank 0's image, a whole image with it", [&](int, const Bufs &set, const Bufs &, const std::vector<unsigned char> &w) { Bufs b = set; b[0] = w; return b; }, ZOPT_ERR_CHECKPOINT});
  }
  Bufs set((size_t)g_world), other((size_t)g_world), whole((size_t)g_world);
  std::vector<Outcomes> outs(cases.size() + set_cases.size());
  std::atomic<bool> unchanged{true};
  Outcomes empty, nul;
  on_ranks([&](int r, zopt_comm *c) {
    Rank A;
    RANK_CK(build_old(A, c));
    void *b = nullptr;
    size_t n = 0;
    RANK_CK(zopt_optimizer_export_state(A.o, &b, &n, 0) == ZOPT_OK);
    set[(size_t)r] = to_vec(b, n);
    RANK_CK(zopt_optimizer_export_state(A.o, &b, &n, ZOPT_EXPORT_WHOLE) == ZOPT_OK);
    whole[(size_t)r] = to_vec(b, n);
    RANK_CK(zopt_optimizer_export_state(A.o, &b, &n, 0) == ZOPT_OK);  // another export: another identity
    other[(size_t)r] = to_vec(b, n);
    RANK_CK(A.steps(2, 1));  // now the state differs from the images; also: every rank's images exist
    Snap s0, s;
    RANK_CK(A.snapshot(&s0));
    for (size_t i = 0; i < cases.size() + set_cases.size(); ++i) {
      const Case &k = i < cases.size() ? cases[i] : set_cases[i - cases.size()];
      Bufs mine = k.make(r, set, other, whole[(size_t)r]);
      std::vector<const void *> p;
      std::vector<size_t> sz;
      for (const auto &v : mine) {
        p.push_back(v.data());
        sz.push_back(v.size());
      }
      outs[i].set(r, zopt_optimizer_import_state_set(A.o, (int)p.size(), p.data(), sz.data(), 0));
      if (!A.snapshot(&s) || s != s0) unchanged = false;
    }
    empty.set(r, zopt_optimizer_import_state(A.o, whole[(size_t)r].data(), 0, 0));
    nul.set(r, zopt_optimizer_import_state_set(A.o, 1, nullptr, nullptr, 0));
    if (!A.snapshot(&s) || s != s0) unchanged = false;
  });
  for (size_t i = 0; i < cases.size() + set_cases.size(); ++i) {
    const Case &k = i < cases.size() ? cases[i] : set_cases[i - cases.size()];
    // A rank that found nothing wrong reports the failing rank's message.
    bool ok = true;
    for (int q = 0; q < g_world; ++q) ok = ok && outs[i].st[(size_t)q] == k.want && outs[i].msg[(size_t)q] == outs[i].msg[0];
    report(ok, "import of %s: refused on every rank alike (%s)", k.what, outs[i].msg[0].c_str());
  }
  report(empty.all(ZOPT_ERR_CHECKPOINT) && nul.all(ZOPT_ERR_INVALID_ARGUMENT),
         "an empty buffer: CHECKPOINT; NULL arrays: INVALID_ARGUMENT (%s)", empty.msg[0].c_str());
  report(unchanged, "every refused import left every state, count, hyperparameter, the scaler and the seed as they were");
}

// ---- 5. the staged import ---------------------------------------------------------

void test_staged() {
  std::atomic<bool> full{true}, partial{true}, usable{true}, aborted{true}, rebuilt{true};
  std::vector<std::string> errs;
  std::mutex mu;
  Outcomes differ, after_add;
  on_ranks([&](int r, zopt_comm *c) {
    Rank A;
    RANK_CK(build_old(A, c));
    Snap want, s;
    RANK_CK(A.snapshot(&want));
    const std::vector<std::vector<unsigned char>> params = A.params();
    RANK_CK(A.steps(2, 2));
    if (!A.zero3) RANK_CK(A.set_params(params));  // the model back
    auto put_all = [&](zopt_state_import *imp, const Snap &from, size_t only) {
      for (size_t t = 0; t < A.n.size(); ++t) {
        if (only != (size_t)-1 && t != only) continue;
        for (uint32_t k = 0; k < A.d->num_states; ++k) {
          const zopt_state_desc &sd = A.d->states[k];
          if (!is_owned(sd.kind) && !(sd.kind == ZOPT_STATE_PARAM && A.zero3)) continue;
          if (sd.dtype == ZOPT_DTYPE_I16 || is_q8_state(sd)) {
            // a remainder master: its raw low halves; q8 codes and their
            // absmax: as they are, the pair
            if (zopt_state_import_put(imp, (int)t, (zopt_state_kind)sd.kind, (zopt_dtype)sd.dtype,
                                      from.st[t][k].data(), selems(sd, A.n[t])))
              return false;
            continue;
          }
          std::vector<float> f((size_t)A.n[t] + 1);  // as f32: converted back exactly
          for (int64_t i = 0; i < A.n[t]; ++i) f[(size_t)i] = load(from.st[t][k].data(), sd.dtype, (size_t)i);
          if (zopt_state_import_put(imp, (int)t, (zopt_state_kind)sd.kind, ZOPT_DTYPE_F32, f.data(), A.n[t]))
            return false;
        }
        if (zopt_state_import_set_tensor_step(imp, (int)t, from.steps[t])) return false;
      }
      return true;
    };
    // Everything put: the snapshot again.
    zopt_state_import *imp = nullptr;
    RANK_CK(zopt_optimizer_import_begin(A.o, &imp) == ZOPT_OK);
    RANK_CK(put_all(imp, want, (size_t)-1));
    size_t hi = 0;
    for (int gi = 0; gi < A.ngroups; ++gi) {
      RANK_CK(zopt_state_import_set_group(imp, gi, want.gcounts[(size_t)gi], want.gflags[(size_t)gi]) == ZOPT_OK);
      for (const char *h : kHyperNames) {
        double v;
        if (zopt_optimizer_get_hyper(A.o, gi, h, &v) == ZOPT_OK)
          RANK_CK(zopt_state_import_set_hyper(imp, gi, h, want.hypers[hi++]) == ZOPT_OK);
      }
    }
    RANK_CK(zopt_state_import_set_loss_scaler(imp, &want.cfg, want.scale, want.good) == ZOPT_OK);
    RANK_CK(zopt_state_import_set_seed(imp, want.seed) == ZOPT_OK);
    RANK_CK(zopt_state_import_commit(imp) == ZOPT_OK);
    if (!A.snapshot(&s) || s != want) full = false;
    // Only tensor 1: the rest as at finalize (master from the params,
    // moments zero, counts zero).
    RANK_CK(A.steps(4, 1));
    RANK_CK(zopt_optimizer_import_begin(A.o, &imp) == ZOPT_OK);
    RANK_CK(put_all(imp, want, 1));
    RANK_CK(zopt_state_import_commit(imp) == ZOPT_OK);
    RANK_CK(A.snapshot(&s));
    for (uint32_t k = 0; k < A.d->num_states; ++k)
      if ((is_owned(A.d->states[k].kind) || A.zero3) && s.st[1][k] != want.st[1][k]) partial = false;
    if (s.steps[1] != want.steps[1]) partial = false;
    for (int64_t c2 : s.gcounts) partial = partial && c2 == 0;
    for (size_t t = 0; t < A.n.size(); ++t) {
      if (t == 1) continue;
      partial = partial && s.steps[t] == 0;
      int pk = -1;
      for (uint32_t k = 0; k < A.d->num_states; ++k)
        if (A.d->states[k].kind == ZOPT_STATE_PARAM) pk = (int)k;
      for (uint32_t k = 0; k < A.d->num_states; ++k) {
        const zopt_state_desc &sd = A.d->states[k];
        if (!is_owned(sd.kind)) continue;
        if (is_q8_state(sd)) {  // the zero code, absmax 0
          partial = partial && q8_fresh(sd, s.st[t][k], A.n[t]);
          continue;
        }
        for (int64_t i = 0; i < A.n[t] && partial; ++i) {
          // ZeRO-3: fresh held params from the user's params, the master from them.
          float pv = load(A.zero3 ? A.p[t] : s.st[t][(size_t)pk].data(), A.pdt, (size_t)i);
          float v = load(s.st[t][k].data(), sd.dtype, (size_t)i), w = sd.init == ZOPT_INIT_FROM_PARAM ? pv : 0.0f;
          if (sd.dtype == ZOPT_DTYPE_I16) {  // a remainder master: rebuilt from the param (abi.h)
            uint16_t hi, lo;
            memcpy(&hi, s.st[t][(size_t)pk].data() + 2 * i, 2);
            memcpy(&lo, s.st[t][k].data() + 2 * i, 2);
            const uint32_t b = zopt_remainder_join(hi, lo);
            memcpy(&v, &b, 4);
          }
          if (memcmp(&v, &w, 4)) partial = false;
        }
      }
    }
    // Bad calls leave the import usable; abort changes nothing.
    Snap before;
    RANK_CK(A.snapshot(&before));
    RANK_CK(zopt_optimizer_import_begin(A.o, &imp) == ZOPT_OK);
    std::vector<float> f((size_t)A.n[1] + 1, 0.5f);
    zopt_state_kind k1 = ZOPT_STATE_MASTER;  // an optimizer state of the step
    for (uint32_t k = A.d->num_states; k-- > 0;)  // (not a remainder master: it takes i16 only)
      if (is_owned(A.d->states[k].kind) && A.d->states[k].dtype != ZOPT_DTYPE_I16)
        k1 = (zopt_state_kind)A.d->states[k].kind;
    RANK_CK(zopt_state_import_put(imp, 1, k1, ZOPT_DTYPE_F32, f.data(), A.n[1]) == ZOPT_OK);
    struct Bad {
      const char *what;
      zopt_status st;
    };
    const Bad bad[] = {
        {"a state put twice", zopt_state_import_put(imp, 1, k1, ZOPT_DTYPE_F32, f.data(), A.n[1])},
        {"GRAD", zopt_state_import_put(imp, 1, ZOPT_STATE_GRAD, ZOPT_DTYPE_F32, f.data(), A.n[1])},
        {"another numel", zopt_state_import_put(imp, 0, k1, ZOPT_DTYPE_F32, f.data(), 2)},
        {"dtype 99", zopt_state_import_put(imp, 0, k1, (zopt_dtype)99, f.data(), A.n[0])},
        {"tensor -1", zopt_state_import_put(imp, -1, k1, ZOPT_DTYPE_F32, f.data(), A.n[0])},
        {"group flags 4", zopt_state_import_set_group(imp, 0, 1, 4)},
        {"a hyperparameter the step lacks", zopt_state_import_set_hyper(imp, 0, "nope", 1.0)},
        {"lr -1", zopt_state_import_set_hyper(imp, 0, "lr", -1.0)},
        {"scale 0", zopt_state_import_set_loss_scaler(imp, nullptr, 0.0, 0)},
        {"steps -1", zopt_state_import_set_tensor_step(imp, 0, -1)},
    };
    for (const Bad &b : bad)
      if (b.st != ZOPT_ERR_INVALID_ARGUMENT) {
        std::lock_guard<std::mutex> lk(mu);
        errs.push_back(std::string(b.what) + " -> " + std::to_string((int)b.st));
      }
    // A remainder master takes its raw i16 low halves only: f32 values
    // would need the params too (abi.h "Remainder masters").
    for (uint32_t k = 0; k < A.d->num_states; ++k)
      if (A.d->states[k].dtype == ZOPT_DTYPE_I16 &&
          zopt_state_import_put(imp, 0, (zopt_state_kind)A.d->states[k].kind, ZOPT_DTYPE_F32, f.data(), A.n[0]) !=
              ZOPT_ERR_UNSUPPORTED) {
        std::lock_guard<std::mutex> lk(mu);
        errs.push_back("an f32 remainder master -> not UNSUPPORTED");
      }
    if (zopt_state_import_put(imp, 0, k1, ZOPT_DTYPE_F32, f.data(), A.n[0]) != ZOPT_OK) usable = false;
    zopt_state_import_abort(imp);
    if (!A.snapshot(&s) || s != before) aborted = false;
    // W > 1: the last rank imports other counts: refused everywhere.
    if (g_world > 1) {
      RANK_CK(zopt_optimizer_import_begin(A.o, &imp) == ZOPT_OK);
      RANK_CK(zopt_state_import_set_tensor_step(imp, 0, r == g_world - 1 ? 9 : 8) == ZOPT_OK);
      differ.set(r, zopt_state_import_commit(imp));
      if (!A.snapshot(&s) || s != before) aborted = false;
    }
    // Tensors added between begin and commit: the commit is refused.
    RANK_CK(zopt_optimizer_import_begin(A.o, &imp) == ZOPT_OK);
    const size_t T0 = A.n.size();
    A.grow(kNew, kNewG, 5);
    RANK_CK(A.add(T0) == ZOPT_OK);
    Snap grown;
    RANK_CK(A.snapshot(&grown));
    after_add.set(r, zopt_state_import_commit(imp));
    if (!A.snapshot(&s) || s != grown) rebuilt = false;
  });
  std::string e;
  for (const std::string &x : errs) e += " [" + x + "]";
  report(full, "staged import of every state (as f32), count, hyperparameter, flag, the scaler and the seed: "
               "bit-identical to the snapshot");
  report(partial, "staged import of one tensor: the others start as at finalize (master from the params, moments "
                  "zero, counts zero)");
  report(errs.empty() && usable, "bad staged calls (put twice, GRAD, numel, dtype, tensor, flags, hyper name and "
                                 "range, scale, steps): INVALID_ARGUMENT, the import still usable%s",
         e.c_str());
  report(aborted, "an aborted (or refused) staged import changed nothing");
  if (g_world > 1)
    report(differ.all(ZOPT_ERR_INVALID_ARGUMENT, "imported other step counts"),
           "ranks importing other counts: refused on every rank alike (%s)", differ.msg[0].c_str());
  report(after_add.all(ZOPT_ERR_BAD_STATE, "tensors were added") && rebuilt,
         "a staged import committed after tensors were added: BAD_STATE, nothing changed (%s)",
         after_add.msg[0].c_str());
}

}  // namespace stt
