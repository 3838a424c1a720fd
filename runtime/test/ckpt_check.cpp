// zopt-ckpt-check: multi-rank checkpoint saves that fail part-way, and sets
// that mix two saves (docs/CHECKPOINT.md "Saving"; issue 16 items 2, 3).
//
//   zopt-ckpt-check STEP.so --world=W --dir=DIR
//
// W ranks as loopback threads; each run builds the same model (tensors of
// awkward sizes in two groups, spanning buckets: states sharded under
// ZeRO-2/3) with deterministic random params and per-rank gradients. Every
// state is read back whole (a collective gather; ZeRO-3 params through
// gather_params) with the step counts: a snapshot, compared bit for bit.
//
//  1. A save that fails on rank r at each stage of the commit
//     (ZOPT_TEST_SAVE_FAULT: write, fsync, rename on rank 0, a rank that
//     dies before the ranks agree, or after every file is durable and they
//     agreed): every surviving rank returns the
//     same status and message; the set at the path afterwards loads and is
//     bit-identical to the previous save (or, when a rank other than 0
//     dies after rank 0 committed, to this save: it is whole); the next
//     save succeeds, loads bit-identically and leaves exactly the set's W
//     files.
//  2. Two saves at the same step count (other gradients): a set with one
//     rank's file taken from the other save (renamed to the identity rank
//     0's file names) is refused on every rank with ZOPT_ERR_CHECKPOINT
//     naming the file and both identities, nothing changed.
//  3. The set rewritten in format 2 (the files an older runtime wrote)
//     loads bit-identically.
//  4. Ranks that pass different paths are refused alike, nothing written.
#include "ckpt_rank_util.h"
#include "ckpt_test_util.h"

#include "zopt/comm.h"
#include "zopt/zopt.h"

#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

using namespace ckr;

namespace {

const std::vector<int64_t> kSizes = {3, 1000, 70001, 5, 33333, 0, 130000};
const std::vector<int> kGroups = {0, 1, 0, 1, 0, 1, 1};

std::string g_step;

// One rank's optimizer over its own copy of the model.
struct Rank {
  int rank = 0;
  zopt_step *step = nullptr;
  zopt_optimizer *o = nullptr;
  const zopt_step_descriptor *d = nullptr;
  uint32_t pdt = ZOPT_DTYPE_F32, gdt = ZOPT_DTYPE_F32;
  bool zero3 = false;
  std::vector<std::vector<unsigned char>> p, g;
  ~Rank() {
    zopt_optimizer_free(o);
    zopt_step_free(step);
  }
  size_t es(uint32_t dt) const { return rtu::dtype_size(dt); }
  bool build(zopt_comm *comm) {
    rank = zopt_comm_rank(comm);
    if (zopt_step_load(g_step.c_str(), &step) || zopt_optimizer_create(step, &o)) return false;
    d = zopt_step_get_descriptor(step);
    rtu::tensor_types(d, &pdt, &gdt, &zero3);
    int id;
    if (zopt_optimizer_add_group(o, &id) || zopt_optimizer_add_group(o, &id)) return false;
    p.resize(kSizes.size());
    g.resize(kSizes.size());
    for (size_t t = 0; t < kSizes.size(); ++t) {
      p[t].assign((size_t)kSizes[t] * es(pdt) + 1, 0);
      g[t].assign((size_t)kSizes[t] * es(gdt) + 1, 0);
      for (int64_t i = 0; i < kSizes[t]; ++i) rtu::store(p[t].data(), pdt, (size_t)i, rtu::value(1, t, (uint64_t)i, 1.0));
      if (zopt_optimizer_add_tensor(o, kGroups[t], p[t].data(), g[t].data(), kSizes[t], (zopt_dtype)pdt, &id))
        return false;
    }
    return !zopt_optimizer_set_comm(o, comm) && !zopt_optimizer_set_bucket_elems(o, 65536) &&
           !zopt_optimizer_set_hyper(o, 1, "lr", 3e-3) && !zopt_optimizer_set_seed(o, 42) &&
           !zopt_optimizer_finalize(o);
  }
  // Steps [k0, k0 + n) with this rank's gradients of run `run`.
  bool steps(int run, int k0, int n) {
    for (int k = k0; k < k0 + n; ++k) {
      for (size_t t = 0; t < g.size(); ++t)
        for (int64_t i = 0; i < kSizes[t]; ++i)
          rtu::store(g[t].data(), gdt, (size_t)i, rtu::value(2 + 100 * (uint64_t)run, (uint64_t)k * 64 + (uint64_t)rank * 8 + t,
                                                 (uint64_t)i, 0.05));
      if (zopt_optimizer_step(o, nullptr)) return false;
    }
    return true;
  }
  // Everything the optimizer holds, whole (collective); false on an error.
  bool snapshot(std::vector<unsigned char> *out) {
    out->clear();
    auto add = [&](const void *x, size_t n) { out->insert(out->end(), (const char *)x, (const char *)x + n); };
    for (size_t t = 0; t < kSizes.size(); ++t) {
      for (uint32_t s = 0; s < d->num_states; ++s) {
        uint32_t kind = d->states[s].kind;
        std::vector<unsigned char> b((size_t)kSizes[t] * es(d->states[s].dtype) + 1);
        if (kind == ZOPT_STATE_PARAM && zero3) {
          void *dst[1] = {b.data()};
          if (zopt_optimizer_gather_params(o, (int)t, 1, dst)) return false;
        } else if (kind != ZOPT_STATE_PARAM && kind != ZOPT_STATE_GRAD) {
          if (zopt_optimizer_read_state_raw(o, (int)t, (zopt_state_kind)kind, b.data(), b.size() - 1)) return false;
        }
        add(b.data(), b.size());
      }
      int64_t c = 0;
      if (zopt_optimizer_get_tensor_step(o, (int)t, &c)) return false;
      add(&c, sizeof c);
    }
    for (int gi = 0; gi < 2; ++gi) {
      int64_t c = 0;
      if (zopt_optimizer_get_step_count(o, gi, &c)) return false;
      add(&c, sizeof c);
    }
    return true;
  }
};

// A fresh run loads `path` and compares the snapshot with `want`, then
// (`resave`) saves, reloads and checks again and that exactly the set's W
// files remain.
void check_loads(const std::string &dir, const std::string &path, const std::vector<unsigned char> &want,
                 const char *what, bool resave) {
  on_ranks([&](int r, zopt_comm *c) {
    Rank R;
    RANK_CK(R.build(c));
    RANK_CK(zopt_optimizer_load(R.o, path.c_str()) == ZOPT_OK);
    std::vector<unsigned char> s;
    RANK_CK(R.snapshot(&s));
    if (r == 0) report(s == want, "%s: the set at the path loads, bit-identical to what was saved", what);
    if (!resave) return;
    RANK_CK(R.steps(9, 20, 1) && R.snapshot(&s));
    RANK_CK(zopt_optimizer_save(R.o, path.c_str()) == ZOPT_OK);
    std::vector<unsigned char> s2;
    RANK_CK(zopt_optimizer_load(R.o, path.c_str()) == ZOPT_OK && R.snapshot(&s2));
    if (r == 0) {
      size_t slash = path.rfind('/');
      size_t n = files_of(dir, path.substr(slash + 1)).size();
      report(s2 == s && n == (size_t)g_world,
             "%s: the next save succeeds, loads bit-identically and leaves %zu file(s) (the set's %d)", what, n,
             g_world);
    }
  });
}

void test_faults(const std::string &dir) {
  const std::string path = dir + "/faults.ck";
  // The previous set: 2 steps, saved.
  std::vector<unsigned char> prev;
  on_ranks([&](int r, zopt_comm *c) {
    Rank R;
    RANK_CK(R.build(c) && R.steps(0, 0, 2));
    RANK_CK(zopt_optimizer_save(R.o, path.c_str()) == ZOPT_OK);
    std::vector<unsigned char> s;
    RANK_CK(R.snapshot(&s));
    if (r == 0) prev = s;
  });
  struct Case {
    const char *stage;
    int rank;
  };
  std::vector<Case> cases;
  for (int q = 0; q < g_world; ++q) cases.push_back({"write", q});
  for (int q = 0; q < g_world; ++q) cases.push_back({"fsync", q});
  cases.push_back({"rename", 0});
  cases.push_back({"die-early", g_world - 1});
  cases.push_back({"die", 0});
  cases.push_back({"die", g_world - 1});
  for (const Case &k : cases) {
    char fault[64], what[96];
    snprintf(fault, sizeof fault, "%d:%s", k.rank, k.stage);
    snprintf(what, sizeof what, "W=%d, rank %d fails at '%s'", g_world, k.rank, k.stage);
    const bool die = strncmp(k.stage, "die", 3) == 0;
    std::vector<Outcome> out((size_t)g_world);
    std::vector<unsigned char> next;
    const std::vector<std::string> before = files_of(dir, "faults.ck");
    setenv("ZOPT_TEST_SAVE_FAULT", fault, 1);  // the rank threads are not running
    on_ranks([&](int r, zopt_comm *c) {
      Rank R;
      RANK_CK(R.build(c));
      RANK_CK(zopt_optimizer_load(R.o, path.c_str()) == ZOPT_OK && R.steps(0, 2, 1));
      std::vector<unsigned char> s;
      RANK_CK(R.snapshot(&s));
      if (r == 0) next = s;
      out[(size_t)r].st = zopt_optimizer_save(R.o, path.c_str());
      out[(size_t)r].msg = zopt_last_error();
    });
    unsetenv("ZOPT_TEST_SAVE_FAULT");
    // (a) every surviving rank: the same error (for a dead rank, the same up
    // to the communicator's own words, which name the observing rank).
    bool same = true;
    int first = -1;
    auto core = [&](const std::string &m) { return die ? m.substr(0, m.find("The communicator:")) : m; };
    for (int q = 0; q < g_world; ++q) {
      if (die && q == k.rank) continue;
      const Outcome &o = out[(size_t)q];
      if (first < 0) first = q;
      same = same && o.st != ZOPT_OK && o.st == out[(size_t)first].st &&
             core(o.msg) == core(out[(size_t)first].msg);
    }
    report(same, "%s: every surviving rank returns the same error (%d: %s)", what, (int)out[(size_t)first].st,
           out[(size_t)first].msg.c_str());
    if (!same)
      for (int q = 0; q < g_world; ++q)
        printf("  rank %d -> %d: %s\n", q, (int)out[(size_t)q].st, out[(size_t)q].msg.c_str());
    // The failed save's files are gone (a dead rank's commit leaves files
    // that the next save removes).
    if (!die) {
      std::vector<std::string> after = files_of(dir, "faults.ck");
      report(after == before, "%s: the failed save left no file (%zu files, as before)", what, after.size());
    }
    // (b) the set at the path is whole: the previous one, or (a rank other
    // than 0 died after rank 0 committed) this save's; (d) the next save works.
    const bool committed = strcmp(k.stage, "die") == 0 && k.rank != 0;
    check_loads(dir, path, committed ? next : prev, what, true);
    // The next case starts from a known previous set again.
    on_ranks([&](int r, zopt_comm *c) {
      Rank R;
      RANK_CK(R.build(c) && R.steps(0, 0, 2));
      RANK_CK(zopt_optimizer_save(R.o, path.c_str()) == ZOPT_OK);
    });
  }
}

void test_mixed_sets(const std::string &dir) {
  const std::string a = dir + "/runA.ck", b = dir + "/runB.ck";
  std::vector<unsigned char> snap_a;
  for (int run = 0; run < 2; ++run)
    on_ranks([&](int r, zopt_comm *c) {
      Rank R;
      RANK_CK(R.build(c) && R.steps(run, 0, 2));  // the same step count, other gradients
      RANK_CK(zopt_optimizer_save(R.o, (run ? b : a).c_str()) == ZOPT_OK);
      std::vector<unsigned char> s;
      RANK_CK(R.snapshot(&s));
      if (r == 0 && run == 0) snap_a = s;
    });
  // Rank q's file of A replaced by B's (renamed to A's identity): refused.
  const std::vector<std::string> fa = files_of(dir, "runA.ck."), fb = files_of(dir, "runB.ck.");
  if (fa.size() != (size_t)g_world - 1 || fb.size() != fa.size()) {
    report(false, "W=%d: %zu and %zu rank files", g_world, fa.size(), fb.size());
    return;
  }
  for (size_t i = 0; i < fa.size(); ++i) {
    const std::string victim = dir + "/" + fa[i];
    const std::vector<unsigned char> keep = ckt::slurp(victim);
    ckt::spit(victim, ckt::slurp(dir + "/" + fb[i]));
    std::vector<Outcome> out((size_t)g_world);
    std::atomic<bool> unchanged{true};
    on_ranks([&](int r, zopt_comm *c) {
      Rank R;
      std::vector<unsigned char> s0, s1;
      RANK_CK(R.build(c) && R.steps(7, 0, 1) && R.snapshot(&s0));
      out[(size_t)r].st = zopt_optimizer_load(R.o, a.c_str());
      out[(size_t)r].msg = zopt_last_error();
      RANK_CK(R.snapshot(&s1));
      if (s0 != s1) unchanged = false;
    });
    const std::string ida = fa[i].substr(fa[i].rfind('.') + 1), idb = fb[i].substr(fb[i].rfind('.') + 1);
    bool ok = unchanged;
    for (const Outcome &o : out)
      ok = ok && o.st == ZOPT_ERR_CHECKPOINT && o.msg == out[0].msg && o.msg.find(fa[i]) != std::string::npos &&
           o.msg.find(ida) != std::string::npos && o.msg.find(idb) != std::string::npos;
    report(ok, "W=%d: a set with %s of another save at the same step count is refused on every rank, "
               "naming the file and both identities, nothing changed (%s)",
           g_world, fa[i].c_str(), out[0].msg.c_str());
    ckt::spit(victim, keep);
  }
  check_loads(dir, a, snap_a, "the unmixed set", false);
  // The same save in format 2 (path, path.<r>-of-<W>): loads bit-identically.
  const std::string v2 = dir + "/v2.ck";
  ckt::spit(v2, ckt::to_format2(ckt::slurp(a)));
  for (size_t i = 0; i < fa.size(); ++i) {
    std::string tail = fa[i].substr(std::string("runA.ck").size());  // .<r>-of-<W>.<id>
    ckt::spit(v2 + tail.substr(0, tail.rfind('.')), ckt::to_format2(ckt::slurp(dir + "/" + fa[i])));
  }
  check_loads(dir, v2, snap_a, "the set rewritten in format 2", false);
  // Ranks passing different paths: refused on every rank, nothing written.
  std::vector<Outcome> out((size_t)g_world);
  on_ranks([&](int r, zopt_comm *c) {
    Rank R;
    RANK_CK(R.build(c));
    out[(size_t)r].st = zopt_optimizer_save(R.o, (dir + (r == g_world - 1 ? "/other.ck" : "/same.ck")).c_str());
    out[(size_t)r].msg = zopt_last_error();
    RANK_CK(zopt_optimizer_save(R.o, (dir + "/same.ck").c_str()) == ZOPT_OK);  // the ranks are still in step
  });
  bool ok = files_of(dir, "other.ck").empty() && files_of(dir, "same.ck").size() == (size_t)g_world;
  for (const Outcome &o : out)
    ok = ok && o.st == ZOPT_ERR_INVALID_ARGUMENT && o.msg == out[0].msg && o.msg.find("same path") != std::string::npos;
  report(ok, "W=%d: ranks passing different paths are refused on every rank before anything is written (%s)", g_world,
         out[0].msg.c_str());
}

}  // namespace

int main(int argc, char **argv) {
  std::string dir;
  if (!parse_args(argc, argv, "zopt-ckpt-check", "STEP.so", &g_step, 1, &dir)) return 2;
  test_faults(dir);
  test_mixed_sets(dir);
  return summary();
}
