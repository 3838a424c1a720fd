// bench_dispatch: the runtime's step over many small tensors against one
// tensor of the same total (issue 17: at most 1.1x).
//   usage: zopt_bench_dispatch STEP.so [repeats=15] [threads=all]
//                              [--tensors=10000] [--numel=1000]
// zopt_optimizer_step (the runtime alone, no binding) over T tensors of n
// elements, with UPDATE's adjacent chunks joined into one call
// (src/exec/coalesce.cpp) and without (ZOPT_NO_COALESCE=1 at finalize),
// for three layouts of the user's params and grads:
//   one    one tensor of T * n elements;
//   views  views of one param and one grad buffer in add order (DeepSpeed's
//          and FSDP's flat buffers; python/bench_step_overhead.py's views);
//   flat   the same in the runtime's flat order (reverse add order,
//          docs/DISTRIBUTED.md), each tensor at a multiple of the step's
//          align: where n is a multiple of it every stream of neighbours is
//          adjacent and their calls join;
//   sep    each param and each grad its own allocation (64-byte aligned,
//          as torch's CPU allocator gives): separate torch tensors.
// Every optimizer is built first; the iterations run them in turn (a busy
// machine drifts), iteration k starting at case k (mod their number): a
// case that follows one on the same arena finds it in cache, which at
// 100 elements (16 MB a case) moved it by up to 20 %; rotated, every case
// follows every other equally often. Printed per optimizer: the median ms, the median of
// per-iteration ratios to `one` (joined) of the same iteration, the
// process CPU time of a step (every pool thread's; the pool sleeps while
// idle, so on a shared host this is the work, not the wait) as its
// minimum and the ratio of minima to `one` (joined), and the median ms of
// each program op (zopt_optimizer_get_op_times) and of the ranks'
// agreement.
#include "zopt/zopt.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <string>
#include <vector>

namespace {

struct Case {
  std::string name;
  bool coalesce;
  zopt_optimizer *o = nullptr;
  std::vector<double> ms, ratio, cpu;
  std::vector<std::vector<double>> op_ms;  // per program op (and the agreement)
};

double cpu_ms() {
  timespec ts;
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return ts.tv_sec * 1e3 + ts.tv_nsec * 1e-6;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

}  // namespace

int main(int argc, char **argv) {
  const char *path = nullptr;
  int T = 10000, iters = 15, threads = 0, pos = 0;
  int64_t n = 1000;
  for (int i = 1; i < argc; ++i) {
    if (!strncmp(argv[i], "--tensors=", 10)) T = atoi(argv[i] + 10);
    else if (!strncmp(argv[i], "--numel=", 8)) n = atoll(argv[i] + 8);
    else if (pos == 0 && ++pos) path = argv[i];
    else if (pos == 1 && ++pos) iters = atoi(argv[i]);
    else if (pos == 2 && ++pos) threads = atoi(argv[i]);
  }
  if (!path || T < 1 || n < 1 || iters < 1) {
    fprintf(stderr, "usage: zopt_bench_dispatch STEP.so [repeats=15] [threads=all] [--tensors=T] [--numel=N]\n");
    return 2;
  }
  zopt_step *step = nullptr;
  if (zopt_step_load(path, &step)) {
    fprintf(stderr, "%s: %s\n", path, zopt_last_error());
    return 1;
  }
  const zopt_step_descriptor *d = zopt_step_get_descriptor(step);
  uint32_t pdt = 0, gdt = 0;
  for (uint32_t s = 0; s < d->num_states; ++s) {
    if (d->states[s].kind == ZOPT_STATE_PARAM) pdt = d->states[s].dtype;
    if (d->states[s].kind == ZOPT_STATE_GRAD) gdt = d->states[s].dtype;
  }
  for (uint32_t dt : {pdt, gdt})
    if (dt != ZOPT_DTYPE_F32 && dt != ZOPT_DTYPE_BF16) {
      fprintf(stderr, "%s: params and grads must be f32 or bf16\n", d->name);
      return 2;
    }
  const size_t pes = pdt == ZOPT_DTYPE_F32 ? 4 : 2, ges = gdt == ZOPT_DTYPE_F32 ? 4 : 2;
  const int64_t A = d->align ? d->align : 1, stride = (n + A - 1) / A * A;
  // The user's memory: one param and one grad arena per layout, shared by
  // its coalesced and uncoalesced optimizers. Values: small, never zero.
  auto arena = [&](size_t es, int64_t elems, bool grad) {
    std::vector<unsigned char> v((size_t)elems * es);
    for (int64_t i = 0; i < elems; ++i) {
      float x = (float)(((i * 2654435761u) % 1000) + 1) * (grad ? 1e-6f : 1e-3f);
      uint32_t b;
      memcpy(&b, &x, 4);
      if (es == 4) memcpy(&v[(size_t)i * 4], &b, 4);
      else { uint16_t h = (uint16_t)(b >> 16); memcpy(&v[(size_t)i * 2], &h, 2); }  // bf16
    }
    return v;
  };
  std::vector<unsigned char> Pv = arena(pes, (int64_t)T * n, false), Gv = arena(ges, (int64_t)T * n, true);
  std::vector<unsigned char> Pf = arena(pes, (int64_t)T * stride, false), Gf = arena(ges, (int64_t)T * stride, true);
  // sep: every tensor's own allocations, params first, then grads (as
  // backward creates them), freed at the end.
  std::vector<void *> Ps(T), Gs(T);
  for (int pass = 0; pass < 2; ++pass)
    for (int t = 0; t < T; ++t) {
      const size_t es = pass ? ges : pes, bytes = ((size_t)n * es + 63) / 64 * 64;
      void *m = aligned_alloc(64, bytes);
      if (!m) {
        fprintf(stderr, "out of memory\n");
        return 1;
      }
      std::vector<unsigned char> v = arena(es, n, pass == 1);
      memcpy(m, v.data(), v.size());
      (pass ? Gs : Ps)[t] = m;
    }
  std::vector<Case> cases;
  for (const char *lay : {"one", "views", "flat", "sep"})
    for (bool c : {true, false}) cases.push_back(Case{lay, c});
  for (Case &c : cases) {
    if (c.coalesce) unsetenv("ZOPT_NO_COALESCE");
    else setenv("ZOPT_NO_COALESCE", "1", 1);
    int g0;
    bool ok = zopt_optimizer_create(step, &c.o) == ZOPT_OK && zopt_optimizer_add_group(c.o, &g0) == ZOPT_OK;
    if (ok && threads > 0) ok = zopt_optimizer_set_num_threads(c.o, threads) == ZOPT_OK;
    for (int t = 0; ok && t < (c.name == "one" ? 1 : T); ++t) {
      int id;
      void *p, *g;
      int64_t numel = n;
      if (c.name == "one") {
        p = Pv.data(), g = Gv.data(), numel = (int64_t)T * n;
      } else if (c.name == "sep") {
        p = Ps[t], g = Gs[t];
      } else if (c.name == "views") {
        p = &Pv[(size_t)t * n * pes], g = &Gv[(size_t)t * n * ges];
      } else {  // tensor t at slot T-1-t: the runtime's flat order
        p = &Pf[(size_t)(T - 1 - t) * stride * pes], g = &Gf[(size_t)(T - 1 - t) * stride * ges];
      }
      ok = zopt_optimizer_add_tensor(c.o, 0, p, g, numel, (zopt_dtype)pdt, &id) == ZOPT_OK;
    }
    ok = ok && zopt_optimizer_finalize(c.o) == ZOPT_OK;
    if (ok && (d->flags & ZOPT_FLAG_LOSS_SCALE)) {
      zopt_loss_scaler_config ls = {1, 2, 0.5, 1000000000, 1, 0};  // static S = 1
      ok = zopt_optimizer_configure_loss_scaler(c.o, &ls) == ZOPT_OK;
    }
    ok = ok && zopt_optimizer_step(c.o, nullptr) == ZOPT_OK;
    unsetenv("ZOPT_NO_COALESCE");
    if (!ok) {
      fprintf(stderr, "%s: %s\n", c.name.c_str(), zopt_last_error());
      return 1;
    }
  }
  using clock = std::chrono::steady_clock;
  for (int k = 0; k < iters; ++k) {
    for (size_t j = 0; j < cases.size(); ++j) {
      Case &c = cases[(j + (size_t)k) % cases.size()];
      const double c0 = cpu_ms();
      auto t0 = clock::now();
      if (zopt_optimizer_step(c.o, nullptr)) {
        fprintf(stderr, "step: %s\n", zopt_last_error());
        return 1;
      }
      c.ms.push_back(std::chrono::duration<double, std::milli>(clock::now() - t0).count());
      c.cpu.push_back(cpu_ms() - c0);
      std::vector<double> sec(d->num_program + 1, 0.0);
      zopt_optimizer_get_op_times(c.o, sec.data(), (int)sec.size());
      c.op_ms.resize(sec.size());
      for (size_t i = 0; i < sec.size(); ++i) c.op_ms[i].push_back(sec[i] * 1e3);
    }
    for (Case &c : cases) c.ratio.push_back(c.ms.back() / cases[0].ms.back());
  }
  printf("%s: %d tensors x %lld elements (align %lld) and 1 tensor of %lld, median of %d\n", d->name, T,
         (long long)n, (long long)A, (long long)T * n, iters);
  static const char *op_names[] = {"?", "COPY", "RS", "AG", "NORMP", "NORM", "PREP", "UPDATE", "FINISH"};
  const double cpu1 = *std::min_element(cases[0].cpu.begin(), cases[0].cpu.end());
  printf("%-6s %-11s %8s %8s %8s %8s   ms per op:", "layout", "calls", "ms", "/1", "cpu min", "/1");
  for (uint32_t i = 0; i < d->num_program; ++i)
    printf(" %7s", d->program[i].code < 9 ? op_names[d->program[i].code] : "?");
  printf(" %7s\n", "agree");
  for (Case &c : cases) {
    const double cmin = *std::min_element(c.cpu.begin(), c.cpu.end());
    printf("%-6s %-11s %8.2f %8.2f %8.3f %8.2f              ", c.name.c_str(), c.coalesce ? "joined" : "per chunk",
           median(c.ms), median(c.ratio), cmin, cmin / cpu1);
    for (auto &v : c.op_ms) printf(" %7.3f", median(v));
    printf("\n");
  }
  printf("ratio many/one     : %8.3f  (views, joined; target < 1.10)\n", median(cases[2].ratio));
  for (Case &c : cases) zopt_optimizer_free(c.o);
  for (int t = 0; t < T; ++t) free(Ps[t]), free(Gs[t]);
  zopt_step_free(step);
  return 0;
}
