// zopt-ckpt-linked-check: the checkpoint of an optimizer of two parts (two
// parameter classes, each its own step.so) is ONE save with one commit
// point, and a mixed set never loads (docs/CHECKPOINT.md "Linked saves").
//
//   zopt-ckpt-linked-check PART0.so PART1.so --world=W --dir=DIR
//
// W ranks as loopback threads; each builds both parts over deterministic
// random params, steps them with per-rank gradients and reads every state
// back whole (with the step counts, the loss scaler and the seed of both
// parts): a snapshot, compared bit for bit.
//
//  0. Bad arguments (NULL or repeated parts or paths, unknown flags, a rank
//     passing another path) are refused before anything is written.
//  1. Save A, step, save B failing in part 1 (its write on each rank, its
//     fsync) or at rank 0's commit rename: every rank returns the same
//     error, naming part 1 for its faults; no file is left or changed;
//     load_linked gives A for both parts.
//  2. Save B with rank 0 dying after its commit, before part 1's rename
//     (`after-commit`): load_linked gives B for both parts (part 1 read
//     under its set name); the next save leaves exactly the 2 W files.
//  3. Part 1's file replaced by another save's (same step count): refused
//     on every rank (ZOPT_ERR_CHECKPOINT naming part 1, its path and both
//     identities), nothing changed on either part; the same with the parts
//     saved one by one (zopt_optimizer_save: what the Python binding did
//     before linked saves) and part 1's file of another such save: such a
//     part 0 cannot be checked, so load_linked loads it, but a linked part
//     1 beside an unlinked part 0 is refused.
#include "ckpt_rank_util.h"
#include "ckpt_test_util.h"

#include "zopt/comm.h"
#include "zopt/zopt.h"

#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <string>
#include <vector>

using namespace ckr;

namespace {

const std::vector<int64_t> kSizes[2] = {{3, 1000, 70001, 5}, {33333, 7, 40000}};

std::string g_steps[2];

// One part (a parameter class) of one rank's optimizer.
struct Part {
  int k = 0, rank = 0;
  zopt_step *step = nullptr;
  zopt_optimizer *o = nullptr;
  const zopt_step_descriptor *d = nullptr;
  uint32_t pdt = ZOPT_DTYPE_F32, gdt = ZOPT_DTYPE_F32;
  bool zero3 = false;
  std::vector<std::vector<unsigned char>> p, g;
  ~Part() {
    zopt_optimizer_free(o);
    zopt_step_free(step);
  }
  const std::vector<int64_t> &sizes() const { return kSizes[k]; }
  bool build(int part, zopt_comm *comm) {
    k = part;
    rank = zopt_comm_rank(comm);
    if (zopt_step_load(g_steps[k].c_str(), &step) || zopt_optimizer_create(step, &o)) return false;
    d = zopt_step_get_descriptor(step);
    rtu::tensor_types(d, &pdt, &gdt, &zero3);
    int id;
    if (zopt_optimizer_add_group(o, &id)) return false;
    p.resize(sizes().size());
    g.resize(sizes().size());
    for (size_t t = 0; t < sizes().size(); ++t) {
      p[t].assign((size_t)sizes()[t] * rtu::dtype_size(pdt) + 1, 0);
      g[t].assign((size_t)sizes()[t] * rtu::dtype_size(gdt) + 1, 0);
      for (int64_t i = 0; i < sizes()[t]; ++i)
        rtu::store(p[t].data(), pdt, (size_t)i, rtu::value(1 + 10 * (uint64_t)k, t, (uint64_t)i, 1.0));
      if (zopt_optimizer_add_tensor(o, 0, p[t].data(), g[t].data(), sizes()[t], (zopt_dtype)pdt, &id)) return false;
    }
    return !zopt_optimizer_set_comm(o, comm) && !zopt_optimizer_set_bucket_elems(o, 65536) &&
           !zopt_optimizer_set_hyper(o, 0, "lr", 3e-3) && !zopt_optimizer_set_seed(o, 42 + (uint64_t)k) &&
           !zopt_optimizer_finalize(o);
  }
  bool step_once(int run, int s) {
    for (size_t t = 0; t < g.size(); ++t)
      for (int64_t i = 0; i < sizes()[t]; ++i)
        rtu::store(g[t].data(), gdt, (size_t)i,
                   rtu::value(2 + 100 * (uint64_t)run + 10 * (uint64_t)k, (uint64_t)s * 64 + (uint64_t)rank * 8 + t,
                              (uint64_t)i, 0.05));
    return zopt_optimizer_step(o, nullptr) == ZOPT_OK;
  }
  // Every state whole (collective), the step counts, the scaler and the seed.
  bool snapshot(std::vector<unsigned char> *out) {
    auto add = [&](const void *x, size_t n) { out->insert(out->end(), (const char *)x, (const char *)x + n); };
    for (size_t t = 0; t < sizes().size(); ++t) {
      for (uint32_t s = 0; s < d->num_states; ++s) {
        const uint32_t kind = d->states[s].kind;
        if (kind == ZOPT_STATE_PARAM || kind == ZOPT_STATE_GRAD) continue;
        std::vector<unsigned char> b((size_t)sizes()[t] * rtu::dtype_size(d->states[s].dtype));
        if (zopt_optimizer_read_state_raw(o, (int)t, (zopt_state_kind)kind, b.data(), b.size())) return false;
        add(b.data(), b.size());
      }
      int64_t c = 0;
      if (zopt_optimizer_get_tensor_step(o, (int)t, &c)) return false;
      add(&c, sizeof c);
    }
    int64_t c = 0, good = 0;
    double scale = 0;
    uint64_t seed = 0;
    if (zopt_optimizer_get_step_count(o, 0, &c) || zopt_optimizer_get_loss_scaler_state(o, &scale, &good) ||
        zopt_optimizer_get_seed(o, &seed))
      return false;
    add(&c, sizeof c);
    add(&scale, sizeof scale);
    add(&good, sizeof good);
    add(&seed, sizeof seed);
    return true;
  }
};

// One rank: both parts.
struct Opt {
  Part a, b;
  zopt_optimizer *parts[2] = {nullptr, nullptr};
  bool build(zopt_comm *c) {
    if (!a.build(0, c) || !b.build(1, c)) return false;
    parts[0] = a.o;
    parts[1] = b.o;
    return true;
  }
  // Steps [s0, s0 + n) of run `run`.
  bool steps(int run, int s0, int n) {
    for (int s = s0; s < s0 + n; ++s)
      if (!a.step_once(run, s) || !b.step_once(run, s)) return false;
    return true;
  }
  bool snapshot(std::vector<unsigned char> *out) {
    out->clear();
    return a.snapshot(out) && b.snapshot(out);
  }
  zopt_status save(const std::string &path) {
    const std::string p1 = path + ".p1";
    const char *paths[2] = {path.c_str(), p1.c_str()};
    return zopt_optimizer_save_linked(parts, 2, paths);
  }
  zopt_status load(const std::string &path) {
    const std::string p1 = path + ".p1";
    const char *paths[2] = {path.c_str(), p1.c_str()};
    return zopt_optimizer_load_linked(parts, 2, paths, 0);
  }
};

// Every file named base* in dir, with its bytes.
std::vector<std::pair<std::string, std::vector<unsigned char>>> contents(const std::string &dir,
                                                                        const std::string &base) {
  std::vector<std::pair<std::string, std::vector<unsigned char>>> out;
  for (const std::string &f : files_of(dir, base)) out.push_back({f, ckt::slurp(dir + "/" + f)});
  return out;
}

// Fresh ranks load `path` (linked) and compare the snapshot with `want`.
bool loads_as(const std::string &path, const std::vector<unsigned char> &want, std::string *why) {
  std::atomic<int> good{0};  // ranks that loaded `want`
  on_ranks([&](int r, zopt_comm *c) {
    Opt R;
    RANK_CK(R.build(c));
    std::vector<unsigned char> s;
    if (R.load(path) != ZOPT_OK) {
      if (r == 0) *why = zopt_last_error();
      return;
    }
    RANK_CK(R.snapshot(&s));
    if (s == want) ++good;
  });
  return good == g_world;
}

// The state after save A (2 steps of run 0) at `path`; returns A's snapshot.
std::vector<unsigned char> save_a(const std::string &path, int run = 0) {
  std::vector<unsigned char> snap;
  on_ranks([&](int r, zopt_comm *c) {
    Opt R;
    RANK_CK(R.build(c) && R.steps(run, 0, 2));
    RANK_CK(R.save(path) == ZOPT_OK);
    std::vector<unsigned char> s;
    RANK_CK(R.snapshot(&s));
    if (r == 0) snap = s;
  });
  return snap;
}

// Loads A at `path`, steps once more and saves with ZOPT_TEST_SAVE_FAULT =
// `fault`: every rank's outcome and B's snapshot.
std::vector<Outcome> save_b(const std::string &path, const char *fault, std::vector<unsigned char> *snap_b) {
  std::vector<Outcome> out((size_t)g_world);
  setenv("ZOPT_TEST_SAVE_FAULT", fault, 1);  // (the rank threads are not running)
  on_ranks([&](int r, zopt_comm *c) {
    Opt R;
    RANK_CK(R.build(c));
    RANK_CK(R.load(path) == ZOPT_OK && R.steps(0, 2, 1));
    std::vector<unsigned char> s;
    RANK_CK(R.snapshot(&s));
    if (r == 0) *snap_b = s;
    out[(size_t)r].st = R.save(path);
    out[(size_t)r].msg = zopt_last_error();
  });
  unsetenv("ZOPT_TEST_SAVE_FAULT");
  return out;
}

void test_faults(const std::string &dir) {
  const std::string path = dir + "/f.ck";
  const std::vector<unsigned char> a = save_a(path);
  struct Case {
    std::string fault;
    bool names_part1;
  };
  std::vector<Case> cases;
  for (int q = 0; q < g_world; ++q) cases.push_back({std::to_string(q) + ":write:1", true});
  cases.push_back({std::to_string(g_world - 1) + ":fsync:1", true});
  cases.push_back({"0:rename", false});
  for (const Case &k : cases) {
    const auto before = contents(dir, "f.ck");
    std::vector<unsigned char> b;
    const std::vector<Outcome> out = save_b(path, k.fault.c_str(), &b);
    bool same = true;
    for (const Outcome &o : out)
      same = same && o.st != ZOPT_OK && o.st == out[0].st && o.msg == out[0].msg &&
             (!k.names_part1 || o.msg.find("part 1 ('" + path + ".p1')") != std::string::npos);
    report(same, "W=%d, fault %s: every rank returns the same error%s (%d: %s)", g_world, k.fault.c_str(),
           k.names_part1 ? ", naming part 1" : "", (int)out[0].st, out[0].msg.c_str());
    report(contents(dir, "f.ck") == before, "W=%d, fault %s: the failed save left no file and changed none",
           g_world, k.fault.c_str());
    std::string why;
    report(b != a && loads_as(path, a, &why),
           "W=%d, fault %s: load_linked gives the previous save's states, bit for bit, for both parts %s", g_world,
           k.fault.c_str(), why.c_str());
  }
  // Rank 0 dies after its commit, before part 1's rename.
  std::vector<unsigned char> b;
  const std::vector<Outcome> out = save_b(path, "0:after-commit", &b);
  bool failed = true;
  for (const Outcome &o : out) failed = failed && o.st == ZOPT_ERR_COMM;
  report(failed, "W=%d, fault 0:after-commit: every rank returns ZOPT_ERR_COMM (%s)", g_world,
         out[g_world - 1].msg.c_str());
  const auto stray = files_of(dir, "f.ck.p1.0-of-");
  std::string why;
  report(stray.size() == 1 && loads_as(path, b, &why),
         "W=%d, fault 0:after-commit: load_linked gives this save's states, bit for bit, for both parts (part 1 "
         "read as %s) %s",
         g_world, stray.empty() ? "?" : stray[0].c_str(), why.c_str());
  // The next save works and leaves exactly each part's set.
  std::vector<unsigned char> c;
  const std::vector<Outcome> next = save_b(path, "", &c);
  bool ok = true;
  for (const Outcome &o : next) ok = ok && o.st == ZOPT_OK;
  const size_t n = files_of(dir, "f.ck").size();
  report(ok && n == 2 * (size_t)g_world && loads_as(path, c, &why),
         "W=%d: the next save succeeds, loads bit for bit and leaves %zu files (2 parts x %d) %s", g_world, n,
         g_world, why.c_str());
}

// Every rank loads `path` into an optimizer of other states: refused alike
// (ZOPT_ERR_CHECKPOINT, message containing every `needles`), nothing changed.
void expect_refused(const std::string &path, const std::vector<std::string> &needles, const char *what) {
  std::vector<Outcome> out((size_t)g_world);
  std::atomic<int> unchanged{0};
  on_ranks([&](int r, zopt_comm *c) {
    Opt R;
    std::vector<unsigned char> s0, s1;
    RANK_CK(R.build(c) && R.steps(7, 0, 1) && R.snapshot(&s0));
    out[(size_t)r].st = R.load(path);
    out[(size_t)r].msg = zopt_last_error();
    RANK_CK(R.snapshot(&s1));
    if (s0 == s1) ++unchanged;
  });
  bool ok = unchanged == g_world;
  for (const Outcome &o : out) {
    ok = ok && o.st == ZOPT_ERR_CHECKPOINT && o.msg == out[0].msg;
    for (const std::string &n : needles) ok = ok && o.msg.find(n) != std::string::npos;
  }
  report(ok, "W=%d: %s: refused on every rank (ZOPT_ERR_CHECKPOINT naming the part, its path and the "
             "identities), nothing changed on either part (%d: %s)",
         g_world, what, (int)out[0].st, out[0].msg.c_str());
}

std::string id_of(const std::string &file) {
  const std::vector<unsigned char> b = ckt::slurp(file);
  std::string s;
  static const char *hexd = "0123456789abcdef";
  for (size_t i = 0; i < 16 && ckt::kIdAt + i < b.size(); ++i) {
    s += hexd[b[ckt::kIdAt + i] >> 4];
    s += hexd[b[ckt::kIdAt + i] & 15];
  }
  return s;
}

void test_mixed(const std::string &dir) {
  const std::string a = dir + "/a.ck", b = dir + "/b.ck";
  const std::vector<unsigned char> snap_a = save_a(a, 0);
  save_a(b, 1);  // the same step count, other gradients
  const std::string ida = id_of(a), idb = id_of(b + ".p1");
  const std::vector<unsigned char> keep = ckt::slurp(a + ".p1");
  ckt::spit(a + ".p1", ckt::slurp(b + ".p1"));
  expect_refused(a, {"part 1", a + ".p1", ida, idb, "belongs to another save"},
                 "part 1's file replaced by another linked save's");
  ckt::spit(a + ".p1", keep);
  std::string why;
  report(loads_as(a, snap_a, &why), "W=%d: the unmixed linked set loads bit for bit %s", g_world, why.c_str());
  // Parts saved one by one (zopt_optimizer_save: unflagged, as before
  // linked saves): loads; a linked part 1 beside it is refused.
  const std::string o = dir + "/old.ck";
  std::vector<unsigned char> snap_o;
  on_ranks([&](int r, zopt_comm *c) {
    Opt R;
    RANK_CK(R.build(c) && R.steps(0, 0, 2));
    RANK_CK(zopt_optimizer_save(R.a.o, o.c_str()) == ZOPT_OK);
    RANK_CK(zopt_optimizer_save(R.b.o, (o + ".p1").c_str()) == ZOPT_OK);
    std::vector<unsigned char> s;
    RANK_CK(R.snapshot(&s));
    if (r == 0) snap_o = s;
  });
  report(loads_as(o, snap_o, &why), "W=%d: parts saved one by one (unlinked) load bit for bit %s", g_world,
         why.c_str());
  const std::vector<unsigned char> keep_o = ckt::slurp(o + ".p1");
  ckt::spit(o + ".p1", ckt::slurp(b + ".p1"));
  expect_refused(o, {"part 1", o + ".p1", id_of(o), idb, "belongs to another save"},
                 "a linked save's part 1 beside an unlinked part 0");
  ckt::spit(o + ".p1", keep_o);
}

// Bad arguments: refused before anything is written (every rank alike).
void test_arguments(const std::string &dir) {
  std::vector<Outcome> out((size_t)g_world);
  std::atomic<int> ok{0};
  on_ranks([&](int r, zopt_comm *c) {
    Opt R;
    RANK_CK(R.build(c));
    const std::string p0 = dir + "/args.ck", p1 = p0 + ".p1", other = dir + "/args.other";
    const char *paths[2] = {p0.c_str(), p1.c_str()}, *same[2] = {p0.c_str(), p0.c_str()},
               *empty[2] = {p0.c_str(), ""};
    zopt_optimizer *twice[2] = {R.a.o, R.a.o}, *null1[2] = {R.a.o, nullptr};
    bool all = true;
    std::string why;
    // Each call's status and message, checked right after it.
    auto expect = [&](zopt_status got, zopt_status want, const char *needle) {
      const std::string m = zopt_last_error();
      if (got != want || m.find(needle) == std::string::npos) {
        all = false;
        if (why.empty()) why = std::to_string((int)got) + ": " + m;
      }
    };
    expect(zopt_optimizer_save_linked(nullptr, 2, paths), ZOPT_ERR_INVALID_ARGUMENT, "parts is NULL");
    expect(zopt_optimizer_save_linked(R.parts, 0, paths), ZOPT_ERR_INVALID_ARGUMENT, "n must be");
    expect(zopt_optimizer_save_linked(R.parts, 2, nullptr), ZOPT_ERR_INVALID_ARGUMENT, "paths is NULL");
    expect(zopt_optimizer_save_linked(null1, 2, paths), ZOPT_ERR_INVALID_ARGUMENT, "part 1 is NULL");
    expect(zopt_optimizer_save_linked(twice, 2, paths), ZOPT_ERR_INVALID_ARGUMENT, "the same optimizer");
    expect(zopt_optimizer_save_linked(R.parts, 2, same), ZOPT_ERR_INVALID_ARGUMENT, "the same path");
    expect(zopt_optimizer_save_linked(R.parts, 2, empty), ZOPT_ERR_INVALID_ARGUMENT, "path 1 is NULL or empty");
    expect(zopt_optimizer_load_linked(R.parts, 2, paths, 0x100), ZOPT_ERR_INVALID_ARGUMENT, "unknown flags");
    expect(zopt_optimizer_load_linked(R.parts, 2, paths, 0), ZOPT_ERR_IO, "args.ck");
    // A rank passing another part-1 path: refused on every rank, nothing
    // written, the ranks still in step.
    if (g_world > 1) {
      const char *mine[2] = {p0.c_str(), (r == g_world - 1 ? other : p1).c_str()};
      expect(zopt_optimizer_save_linked(R.parts, 2, mine), ZOPT_ERR_INVALID_ARGUMENT, "same path");
    }
    all = all && files_of(dir, "args.").empty();
    if (!all) report(false, "rank %d: %s", r, why.c_str());
    RANK_CK(R.save(p0) == ZOPT_OK);  // the ranks are still in step
    if (all) ++ok;
  });
  report(ok == g_world && files_of(dir, "args.").size() == 2 * (size_t)g_world,
         "W=%d: bad arguments (NULL or repeated parts, NULL, empty or repeated paths, unknown flags, a rank "
         "passing another path) are refused before anything is written",
         g_world);
}

}  // namespace

int main(int argc, char **argv) {
  std::string dir;
  if (!parse_args(argc, argv, "zopt-ckpt-linked-check", "PART0.so PART1.so", g_steps, 2, &dir)) return 2;
  test_arguments(dir);
  test_faults(dir);
  test_mixed(dir);
  return summary();
}
