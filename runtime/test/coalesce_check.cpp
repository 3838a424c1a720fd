// zopt-coalesce-check: the host executor's UPDATE with adjacent chunks
// joined into one kernel call (runtime/src/exec/coalesce.cpp) against the
// same run with every chunk its own call (ZOPT_NO_COALESCE=1 at finalize),
// every byte.
//
// Each rank of W (loopback threads; none at W = 1) builds ~30 small tensors
// in two groups (different lr) whose params and grads are views of one
// param arena and one grad arena laid out in the runtime's flat order:
// most sizes multiples of the step's align (so that every state of
// neighbours is adjacent and their update calls join), some not (an align
// gap in the runtime's states), some with an extra gap in the user's
// memory only; one tensor of 70,000 elements (two chunks of one tensor:
// with stochastic rounding only those join). Small buckets, so tensors
// span buckets and shards. Steps change the mask (per rank: counts
// diverge, so one group has two coefficient rows), and one tensor's grad
// moves out of the arena and back (zopt_optimizer_set_tensor_memory: the
// work lists are rebuilt); at steps 5 and 6 the grads of two neighbours do
// (zopt_optimizer_set_grad_memory: only their chunks' pointers are
// patched, the joins made again), the arena's copy poisoned with NaN. After
// every step the param and grad memory, the moved buffers, the result and
// the state image (zopt_optimizer_export_state: every state, count, the
// scaler, the seed) must be the same bytes in both runs and in a third,
// coalesced, that moves those two grads with set_tensor_memory instead (the
// lists rebuilt), on every rank; the params must have moved.
//
//   zopt-coalesce-check STEP.so|DIR ... [--world=W] [--threads=T] [--steps=N]
#include "rank_test_util.h"
#include "test_util.h"

#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

namespace {

struct Options {
  int world = 1, threads = 1, steps = 6;
};

std::mutex g_mu;
int g_fail = 0;

void report(bool ok, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void report(bool ok, const char *fmt, ...) {
  if (ok) return;
  char m[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(m, sizeof m, fmt, ap);
  va_end(ap);
  std::lock_guard<std::mutex> lk(g_mu);
  printf("FAIL %s\n", m);
  fflush(stdout);
  ++g_fail;
}

// Tensor t's size, in units of the step's align A (a negative entry: that
// many elements, not a multiple of A), group, and whether the user's
// memory leaves a gap of A elements after it.
struct Spec {
  int64_t n;
  int group;
  bool user_gap;
};
std::vector<Spec> specs(int64_t A) {
  std::vector<Spec> s;
  const int64_t units[] = {3, 1, 5, 2, -37, 4, 1, 1, 6, 2, 3, -70000, 2, 1, 7, 3, 2, -5,
                           1, 4, 2, 8, 1, 3, 2, 1, -100, 3, 5, 2};
  int i = 0;
  for (int64_t u : units) {
    int64_t n = u < 0 ? -u : u * A;
    if (u == -70000) n = (70000 + A - 1) / A * A;  // whole align units, > one 65536 chunk
    s.push_back(Spec{n, (i / 4) % 2, i == 9 || i == 20});
    ++i;
  }
  return s;
}

struct Snap {
  std::vector<unsigned char> bytes;  // params, grads, moved grad, result, image
};

// One rank's run; `snaps[k]` after step k + 1.
// `rebuild`: steps 5 and 6 move the two grads with set_tensor_memory.
void run_rank(int r, zopt_comm *comm, const zopt_step *step, const Options &opt, bool rebuild,
              std::vector<Snap> *snaps) {
  const zopt_step_descriptor *d = zopt_step_get_descriptor(step);
  uint32_t pdt = 0, gdt = 0;
  for (uint32_t i = 0; i < d->num_states; ++i) {
    if (d->states[i].kind == ZOPT_STATE_PARAM) pdt = d->states[i].dtype;
    if (d->states[i].kind == ZOPT_STATE_GRAD) gdt = d->states[i].dtype;
  }
  const size_t pes = rtu::dtype_size(pdt), ges = rtu::dtype_size(gdt);
  const int64_t A = d->align ? d->align : 1;
  bool zero3 = false;
  for (uint32_t i = 0; i < d->num_states; ++i)
    zero3 |= d->states[i].kind == ZOPT_STATE_PARAM && (d->states[i].flags & ZOPT_STATE_PARTITIONED);
  const std::vector<Spec> sp = specs(A);
  const int T = (int)sp.size();
  // The arenas in the runtime's flat order: per group, reverse add order.
  std::vector<int64_t> off(T);
  int64_t total = 0;
  for (int g = 0; g < 2; ++g)
    for (int t = T - 1; t >= 0; --t) {
      if (sp[t].group != g) continue;
      off[t] = total;
      total += (sp[t].n + A - 1) / A * A + (sp[t].user_gap ? A : 0);
    }
  std::vector<unsigned char> P((size_t)total * pes), G((size_t)total * ges), moved, moved2;
  for (int t = 0; t < T; ++t)
    for (int64_t i = 0; i < sp[t].n; ++i) rtu::store(P.data(), pdt, (size_t)(off[t] + i), rtu::value(1, t, i, 1.0));
  zopt_optimizer *o = nullptr;
  auto ck = [&](zopt_status st, const char *what) {
    report(st == ZOPT_OK, "rank %d: %s -> %d: %s", r, what, (int)st, zopt_last_error());
    return st == ZOPT_OK;
  };
  if (!ck(zopt_optimizer_create(step, &o), "create")) return;
  int g1 = 0;
  bool ok = ck(zopt_optimizer_add_group(o, &g1), "add_group") && ck(zopt_optimizer_add_group(o, &g1), "add_group");
  for (int t = 0; ok && t < T; ++t) {
    int id;
    ok = ck(zopt_optimizer_add_tensor(o, sp[t].group, P.data() + off[t] * pes, G.data() + off[t] * ges, sp[t].n,
                                      (zopt_dtype)pdt, &id),
            "add_tensor");
  }
  if (ok && comm) ok = ck(zopt_optimizer_set_comm(o, comm), "set_comm");
  ok = ok && ck(zopt_optimizer_set_bucket_elems(o, 4096), "set_bucket_elems");
  ok = ok && ck(zopt_optimizer_set_num_threads(o, opt.threads), "set_num_threads");
  ok = ok && ck(zopt_optimizer_set_hyper(o, 1, "lr", 3e-3), "set_hyper");
  ok = ok && ck(zopt_optimizer_set_seed(o, 1234567), "set_seed");
  ok = ok && ck(zopt_optimizer_finalize(o), "finalize");
  const int mover = 13;  // its grad leaves the arena at step 3, comes back at step 4
  for (int k = 1; ok && k <= opt.steps; ++k) {
    double S = 1;
    zopt_optimizer_get_loss_scale(o, &S);
    for (int t = 0; t < T; ++t)
      for (int64_t i = 0; i < sp[t].n; ++i)
        rtu::store(G.data(), gdt, (size_t)(off[t] + i), (float)(rtu::value(2 + k, t * 8 + r, i, 0.05) * S));
    if (k == 3) {
      moved.assign(G.begin() + off[mover] * ges, G.begin() + (off[mover] + sp[mover].n) * ges);
      memset(G.data() + off[mover] * ges, 0x7f, (size_t)sp[mover].n * ges);  // must not be read
      ok = ck(zopt_optimizer_set_tensor_memory(o, mover, P.data() + off[mover] * pes, moved.data()), "move");
    } else if (k == 4) {
      ok = ck(zopt_optimizer_set_tensor_memory(o, mover, P.data() + off[mover] * pes, G.data() + off[mover] * ges),
              "move back");
    }
    // Tensors 15 and 14 (side by side in the arena, 15 first): their grads
    // leave the arena together at step 5 (the arena's copy NaN: must not be
    // read) and come back at step 6.
    if (ok && (k == 5 || k == 6)) {
      const int32_t pair[2] = {15, 14};
      const int64_t lo = off[15], hi = off[14] + sp[14].n;
      if (k == 5) {
        moved2.assign(G.begin() + lo * ges, G.begin() + hi * ges);
        memset(G.data() + lo * ges, 0xff, (size_t)(hi - lo) * ges);
      }
      void *to[2];
      for (int i = 0; i < 2; ++i)
        to[i] = k == 5 ? (void *)(moved2.data() + (off[pair[i]] - lo) * ges) : (void *)(G.data() + off[pair[i]] * ges);
      if (rebuild)
        for (int i = 0; ok && i < 2; ++i)
          ok = ck(zopt_optimizer_set_tensor_memory(o, pair[i], P.data() + off[pair[i]] * pes, to[i]), "move pair");
      else
        ok = ck(zopt_optimizer_set_grad_memory(o, 2, pair, to), "move pair's grads");
    }
    // Tensor 6 inactive from step 2 (every rank); tensor 2 on rank 0 only
    // at step 3; tensor 22 nowhere at step 2 (its group's counts diverge).
    std::vector<uint8_t> act(T, 1);
    if (k >= 2) act[6] = 0;
    if (k == 3 && r != 0) act[2] = 0;
    if (k == 2) act[22] = 0;
    ok = ok && ck(zopt_optimizer_set_active(o, act.data(), T), "set_active");
    zopt_step_result res{};
    ok = ok && ck(zopt_optimizer_step(o, &res), "step");
    // ZeRO-3: the params are held sharded; into the user's memory (collective).
    if (ok && zero3) ok = ck(zopt_optimizer_gather_params(o, 0, T, nullptr), "gather_params");
    if (!ok) break;
    Snap s;
    auto put = [&](const void *p, size_t n) {
      s.bytes.insert(s.bytes.end(), (const unsigned char *)p, (const unsigned char *)p + n);
    };
    put(P.data(), P.size());
    put(G.data(), G.size());
    put(moved.data(), moved.size());
    put(moved2.data(), moved2.size());
    put(&res.grad_norm, sizeof res.grad_norm);
    put(&res.skipped, sizeof res.skipped);
    void *img = nullptr;
    size_t n = 0;
    ok = ck(zopt_optimizer_export_state(o, &img, &n, 0), "export_state");
    if (ok && n >= 128) {
      // Not the save identity (random: docs/CHECKPOINT.md, at offset 104)
      // nor the header checksum over it (at offset H, the u64 at 16).
      uint64_t H;
      memcpy(&H, (char *)img + 16, 8);
      memset((char *)img + 104, 0, 16);
      if (H + 8 <= n) memset((char *)img + H, 0, 8);
      put(img, n);
    }
    zopt_state_buffer_free(img);
    snaps->push_back(std::move(s));
  }
  // The params moved (the runs compare something).
  size_t same = 0;
  for (int t = 0; t < T; ++t)
    for (int64_t i = 0; i < sp[t].n; ++i)
      same += rtu::load(P.data(), pdt, (size_t)(off[t] + i)) == rtu::value(1, t, i, 1.0) ? 1 : 0;
  report(same < (size_t)total / 2, "rank %d: %zu params never changed", r, same);
  zopt_optimizer_free(o);
}

// Every rank's snapshots of one run.
bool run(const zopt_step *step, const Options &opt, bool coalesce, bool rebuild, std::vector<std::vector<Snap>> *out) {
  if (coalesce)
    unsetenv("ZOPT_NO_COALESCE");
  else
    setenv("ZOPT_NO_COALESCE", "1", 1);  // read at finalize
  out->assign((size_t)opt.world, {});
  bool ok = rtu::on_ranks(opt.world, 20.0, true,
                          [&](int r, zopt_comm *c) { run_rank(r, c, step, opt, rebuild, &(*out)[(size_t)r]); });
  unsetenv("ZOPT_NO_COALESCE");
  report(ok, "cannot make %d loopback ranks: %s", opt.world, zopt_last_error());
  return ok;
}

}  // namespace

int main(int argc, char **argv) {
  Options opt;
  std::vector<char *> rest = {argv[0]};
  for (int i = 1; i < argc; ++i) {
    if (!strncmp(argv[i], "--world=", 8)) opt.world = atoi(argv[i] + 8);
    else if (!strncmp(argv[i], "--threads=", 10)) opt.threads = atoi(argv[i] + 10);
    else if (!strncmp(argv[i], "--steps=", 8)) opt.steps = atoi(argv[i] + 8);
    else rest.push_back(argv[i]);
  }
  static char paths[64][4096];
  int n = zt_collect_steps((int)rest.size(), rest.data(), paths, 64);
  if (n == 0) {
    printf("SKIPPED: no step (.so path or directory argument, or $ZOPT_TEST_STEP)\n");
    return ZT_SKIP;
  }
  int ran = 0;
  for (int i = 0; i < n; ++i) {
    zopt_step *step = nullptr;
    if (zopt_step_load(paths[i], &step) != ZOPT_OK) {
      report(false, "%s: %s", paths[i], zopt_last_error());
      continue;
    }
    const zopt_step_descriptor *d = zopt_step_get_descriptor(step);
    bool cpu = true;  // this checks the host executor: CPU-placed params
    for (uint32_t s = 0; s < d->num_states; ++s) cpu = cpu && d->states[s].placement == ZOPT_PLACE_CPU;
    if (!cpu) {
      printf("skip %s (not a CPU step)\n", d->name);
      zopt_step_free(step);
      continue;
    }
    const int before = g_fail;
    std::vector<std::vector<Snap>> a, b, c;
    auto compare = [&](const std::vector<std::vector<Snap>> &y, const char *what) {
      for (int r = 0; r < opt.world; ++r) {
        report(a[r].size() == (size_t)opt.steps && y[r].size() == (size_t)opt.steps,
               "%s rank %d: %zu and %zu of %d steps ran", d->name, r, a[r].size(), y[r].size(), opt.steps);
        for (size_t k = 0; k < std::min(a[r].size(), y[r].size()); ++k) {
          const auto &u = a[r][k].bytes, &v = y[r][k].bytes;
          size_t at = 0;
          while (at < std::min(u.size(), v.size()) && u[at] == v[at]) ++at;
          report(u.size() == v.size() && at == u.size(), "%s rank %d step %zu: %s differ at byte %zu of %zu (%zu)",
                 d->name, r, k + 1, what, at, u.size(), v.size());
        }
      }
    };
    if (run(step, opt, true, false, &a)) {
      if (run(step, opt, false, false, &b)) compare(b, "coalesced and not");
      if (run(step, opt, true, true, &c)) compare(c, "grads patched and lists rebuilt");
    }
    if (g_fail == before)
      printf("PASS %s at %d rank(s), %d thread(s), %d steps: coalesced == not == rebuilt, every byte\n", d->name,
             opt.world, opt.threads, opt.steps);
    ++ran;
    zopt_step_free(step);
  }
  printf("%d step(s), %d failure(s)\n", ran, g_fail);
  return g_fail ? 1 : 0;
}
