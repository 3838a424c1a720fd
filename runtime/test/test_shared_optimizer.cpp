// One optimizer used from several threads at once (misuse; run under
// ThreadSanitizer by scripts/sanitize.sh). zopt.h "Threading": every call on
// one optimizer either runs alone or, while another thread's call runs on
// it, is refused with ZOPT_ERR_BAD_STATE naming that call; a refused call
// changes nothing; zopt_optimizer_free waits for a running call.
//   1. two threads step one optimizer (one of them also reads states and
//      step counts) many times: every call succeeds or is refused, and the
//      result is bit-identical to the successful number of steps run
//      serially;
//   2. zopt_optimizer_free while a step runs on another thread: the free
//      waits, the step completes (bit-identical to one step alone), nothing
//      crashes;
//   3. the state calls (export, the staged import, add_tensors) beside a
//      stepping thread: alone or refused, the steps' state unchanged by
//      them, the last export a whole state.
// Steps: argv[1..] (files or directories of *.so; the first CPU step of
// kind param f32 is used); skipped (77) without one. Bounded by alarm().
#include "test_util.h"

#include <atomic>
#include <chrono>
#include <string>
#include <thread>
#include <unistd.h>
#include <vector>

namespace {

const char *kRefusal = "is running on this optimizer on another thread";

struct Model {
  zopt_optimizer *o = nullptr;
  std::vector<std::vector<float>> p, g;
};

// Every state of every tensor (params included), as raw bytes.
std::vector<unsigned char> snapshot(const Model &m, const zopt_step_descriptor *d) {
  std::vector<unsigned char> out;
  for (const auto &p : m.p) out.insert(out.end(), (const unsigned char *)p.data(), (const unsigned char *)(p.data() + p.size()));
  for (uint32_t i = 0; i < d->num_states; ++i) {
    uint32_t k = d->states[i].kind;
    if (k == ZOPT_STATE_PARAM || k == ZOPT_STATE_GRAD) continue;
    for (size_t t = 0; t < m.p.size(); ++t) {
      std::vector<float> b(m.p[t].size());
      ZT_OK(zopt_optimizer_read_state_f32(m.o, (int)t, (zopt_state_kind)k, b.data(), (int64_t)b.size()));
      out.insert(out.end(), (const unsigned char *)b.data(), (const unsigned char *)(b.data() + b.size()));
    }
  }
  return out;
}

float value(uint64_t seed, size_t i) {
  uint64_t h = (seed + i) * 0x9E3779B97F4A7C15ull;
  h ^= h >> 29;
  return ((float)(h & 0xffff) / 65536.0f - 0.5f) * 0.01f;
}

bool build(zopt_step *s, const std::vector<int64_t> &sizes, int threads, Model *m) {
  if (zopt_optimizer_create(s, &m->o) != ZOPT_OK) return false;
  ZT_OK(zopt_optimizer_set_num_threads(m->o, threads));
  int gid, tid;
  ZT_OK(zopt_optimizer_add_group(m->o, &gid));
  ZT_OK(zopt_optimizer_set_hyper(m->o, gid, "lr", 1e-2));
  for (size_t t = 0; t < sizes.size(); ++t) {
    m->p.emplace_back((size_t)sizes[t]);
    m->g.emplace_back((size_t)sizes[t]);
    for (size_t i = 0; i < (size_t)sizes[t]; ++i) {
      m->p[t][i] = value(1000 + t, i);
      m->g[t][i] = value(2000 + t, i) + 0.001f;  // never zero
    }
    ZT_OK(zopt_optimizer_add_tensor(m->o, gid, m->p[t].data(), m->g[t].data(), sizes[t], ZOPT_DTYPE_F32, &tid));
  }
  return zopt_optimizer_finalize(m->o) == ZOPT_OK;
}

// A refusal's status and message: BAD_STATE, naming the calling function and
// the running one.
bool refused_as_documented(zopt_status st, const char *fn) {
  const char *m = zopt_last_error();
  if (st != ZOPT_ERR_BAD_STATE || !strstr(m, kRefusal) || strncmp(m, fn, strlen(fn)) != 0 ||
      !strstr(m, "another call (zopt_")) {  // zopt_optimizer_*, zopt_state_import_*
    fprintf(stderr, "%s -> %d: '%s' (want BAD_STATE '%s: another call (...) %s')\n", fn, (int)st, m, fn, kRefusal);
    return false;
  }
  return true;
}

// 1. Two threads stepping one optimizer.
void two_threads_step(zopt_step *s, const zopt_step_descriptor *d) {
  const std::vector<int64_t> sizes = {70001, 513, 131072, 9};
  Model m;
  ZT_CHECK(build(s, sizes, 2, &m));
  const int kCalls = 150;
  std::atomic<int> ok{0}, refused{0}, bad{0};
  std::atomic<bool> go{false};
  auto stepper = [&](bool reader) {
    while (!go.load()) std::this_thread::yield();
    unsigned rng = reader ? 12345u : 777u;
    for (int k = 0; k < kCalls; ++k) {
      rng = rng * 1103515245u + 12345u;
      usleep((rng >> 16) % 300);  // varied interleavings: both threads get steps in
      zopt_step_result r;
      zopt_status st = zopt_optimizer_step(m.o, &r);
      if (st == ZOPT_OK) ok++;
      else if (refused_as_documented(st, "zopt_optimizer_step")) refused++;
      else bad++;
      if (reader) {  // reads race the other thread's steps: refused or consistent
        int64_t c = 0;
        st = zopt_optimizer_get_step_count(m.o, 0, &c);
        if (st != ZOPT_OK && !refused_as_documented(st, "zopt_optimizer_get_step_count")) bad++;
        std::vector<float> b((size_t)sizes[3]);
        st = zopt_optimizer_read_state_f32(m.o, 3, ZOPT_STATE_EXP_AVG, b.data(), sizes[3]);
        if (st != ZOPT_OK && st != ZOPT_ERR_INVALID_ARGUMENT &&  // INVALID: a step without exp_avg
            !refused_as_documented(st, "zopt_optimizer_read_state_f32"))
          bad++;
      }
    }
  };
  std::thread a(stepper, false), b(stepper, true);
  go = true;
  a.join();
  b.join();
  ZT_CHECK(bad.load() == 0);
  ZT_CHECK(ok.load() + refused.load() == 2 * kCalls);
  int64_t count = -1;
  ZT_OK(zopt_optimizer_get_step_count(m.o, 0, &count));
  ZT_CHECK(count == ok.load());
  // The same number of steps, serially, from the same start.
  Model ref;
  ZT_CHECK(build(s, sizes, 2, &ref));
  for (int k = 0; k < ok.load(); ++k) {
    zopt_step_result r;
    ZT_OK(zopt_optimizer_step(ref.o, &r));
  }
  ZT_CHECK(snapshot(m, d) == snapshot(ref, d));
  printf("  two threads, one optimizer: %d steps ran, %d refused (BAD_STATE naming the running call); "
         "bit-identical to %d serial steps\n",
         ok.load(), refused.load(), ok.load());
  zopt_optimizer_free(m.o);
  zopt_optimizer_free(ref.o);
}

// 2. zopt_optimizer_free while another thread steps.
void free_during_step(zopt_step *s) {
  const std::vector<int64_t> sizes = {1 << 22, 4097};
  Model ref;
  ZT_CHECK(build(s, sizes, 2, &ref));
  zopt_step_result r0;
  ZT_OK(zopt_optimizer_step(ref.o, &r0));
  std::vector<unsigned char> want;
  for (const auto &p : ref.p) want.insert(want.end(), (const unsigned char *)p.data(), (const unsigned char *)(p.data() + p.size()));
  bool overlapped = false;
  for (int attempt = 0; attempt < 20 && !overlapped; ++attempt) {
    Model m;
    ZT_CHECK(build(s, sizes, 2, &m));
    std::atomic<int> started{0};
    std::atomic<int> status{-1};
    std::thread a([&] {
      started = 1;
      zopt_step_result r;
      // The main thread's zopt_optimizer_get_seed may hold the optimizer
      // when the step arrives: the step is then refused, changing nothing
      // (BAD_STATE naming that call, as documented), and is called again.
      zopt_status st;
      while ((st = zopt_optimizer_step(m.o, &r)) == ZOPT_ERR_BAD_STATE &&
             strstr(zopt_last_error(), "zopt_optimizer_get_seed"))
        std::this_thread::yield();
      status = (int)st;
    });
    while (!started.load()) std::this_thread::yield();
    // Until the step is seen running (a call on the optimizer is refused
    // naming it), or it is over.
    uint64_t seed;
    for (;;) {
      zopt_status st = zopt_optimizer_get_seed(m.o, &seed);
      if (st == ZOPT_ERR_BAD_STATE && strstr(zopt_last_error(), "another call (zopt_optimizer_step)")) {
        overlapped = true;
        break;
      }
      if (status.load() >= 0) break;
    }
    zopt_optimizer_free(m.o);  // waits for the step
    a.join();
    ZT_CHECK(status.load() == ZOPT_OK);
    std::vector<unsigned char> got;
    for (const auto &p : m.p) got.insert(got.end(), (const unsigned char *)p.data(), (const unsigned char *)(p.data() + p.size()));
    ZT_CHECK(got == want);
  }
  ZT_CHECK(overlapped);
  printf("  free during a step on another thread: waited for it; the step completed bit-identical to one step alone\n");
  zopt_optimizer_free(ref.o);
}

// 3. The state calls (export, import, the staged import, add_tensors) under
// the same rules, while another thread steps: each runs alone or is refused
// as documented; the state afterwards is the steps' alone, and the last
// exported image is a whole state (imported into a fresh optimizer it is
// the state after as many serial steps as it counts).
void state_calls_race(zopt_step *s, const zopt_step_descriptor *d) {
  const std::vector<int64_t> sizes = {70001, 513, 9};
  Model m;
  ZT_CHECK(build(s, sizes, 2, &m));
  const int kCalls = 60;
  std::atomic<int> ok{0}, bad{0}, exported{0};
  std::atomic<bool> go{false};
  std::vector<unsigned char> image;
  uint32_t k1 = 0;  // an optimizer state of the step
  for (uint32_t k = d->num_states; k-- > 0;)
    if (d->states[k].kind != ZOPT_STATE_PARAM && d->states[k].kind != ZOPT_STATE_GRAD) k1 = d->states[k].kind;
  auto expect = [&](zopt_status st, zopt_status want, const char *fn) {
    if (st != want && !refused_as_documented(st, fn)) bad++;
  };
  std::thread a([&] {
    while (!go.load()) std::this_thread::yield();
    for (int k = 0; k < kCalls; ++k) {
      usleep(50 + (k * 37) % 200);
      zopt_step_result r;
      zopt_status st = zopt_optimizer_step(m.o, &r);
      if (st == ZOPT_OK) ok++;
      else if (!refused_as_documented(st, "zopt_optimizer_step")) bad++;
    }
  });
  std::thread b([&] {
    while (!go.load()) std::this_thread::yield();
    std::vector<float> f((size_t)sizes[2], 0.25f);
    float p = 1.0f, g = 1.0f;
    void *pp = &p, *gp = &g;
    int grp = 0;
    int64_t one = 1;
    for (int k = 0; k < kCalls; ++k) {
      void *buf = nullptr;
      size_t n = 0;
      zopt_status st = zopt_optimizer_export_state(m.o, &buf, &n, ZOPT_EXPORT_WHOLE);
      expect(st, ZOPT_OK, "zopt_optimizer_export_state");
      if (st == ZOPT_OK) {
        image.assign((unsigned char *)buf, (unsigned char *)buf + n);
        zopt_state_buffer_free(buf);
        exported++;
      }
      zopt_state_import *imp = nullptr;
      st = zopt_optimizer_import_begin(m.o, &imp);
      expect(st, ZOPT_OK, "zopt_optimizer_import_begin");
      if (imp) {
        expect(zopt_state_import_put(imp, 2, (zopt_state_kind)k1, ZOPT_DTYPE_F32, f.data(), sizes[2]), ZOPT_OK,
               "zopt_state_import_put");
        zopt_state_import_abort(imp);  // nothing applied
      }
      // A refused addition (another dtype): changes nothing.
      expect(zopt_optimizer_add_tensors(m.o, 0, 1, &grp, &pp, &gp, &one, ZOPT_DTYPE_BF16, nullptr, nullptr),
             ZOPT_ERR_INVALID_ARGUMENT, "zopt_optimizer_add_tensors");
      usleep(30 + (k * 53) % 150);
    }
  });
  go = true;
  a.join();
  b.join();
  ZT_CHECK(bad.load() == 0);
  Model ref;
  ZT_CHECK(build(s, sizes, 2, &ref));
  for (int k = 0; k < ok.load(); ++k) {
    zopt_step_result r;
    ZT_OK(zopt_optimizer_step(ref.o, &r));
  }
  ZT_CHECK(snapshot(m, d) == snapshot(ref, d));
  // The last image: the state after `c` serial steps (its params: theirs).
  Model at;
  ZT_CHECK(build(s, sizes, 2, &at));
  ZT_CHECK(exported.load() > 0);
  ZT_OK(zopt_optimizer_import_state(at.o, image.data(), image.size(), 0));
  int64_t c = -1;
  ZT_OK(zopt_optimizer_get_step_count(at.o, 0, &c));
  Model serial;
  ZT_CHECK(build(s, sizes, 2, &serial));
  for (int64_t k = 0; k < c; ++k) {
    zopt_step_result r;
    ZT_OK(zopt_optimizer_step(serial.o, &r));
  }
  for (size_t t = 0; t < at.p.size(); ++t) at.p[t] = serial.p[t];  // the model's params are not in the image
  ZT_CHECK(c >= 0 && c <= ok.load() && snapshot(at, d) == snapshot(serial, d));
  printf("  state calls beside steps on another thread: %d steps ran, %d whole exports, every call alone or "
         "refused; the last image is the state after %lld serial steps\n",
         ok.load(), exported.load(), (long long)c);
  for (Model *x : {&m, &ref, &at, &serial}) zopt_optimizer_free(x->o);
}

}  // namespace

int main(int argc, char **argv) {
  alarm(240);  // a deadlock fails the test (SIGALRM) instead of hanging it
  static char paths[64][4096];
  int n = zt_collect_steps(argc, argv, paths, 64);
  zopt_step *s = nullptr;
  for (int i = 0; i < n && !s; ++i) {
    if (zopt_step_load(paths[i], &s) != ZOPT_OK) continue;
    const zopt_step_descriptor *d = zopt_step_get_descriptor(s);
    bool ok = d->zero_stage == 0;
    for (uint32_t k = 0; k < d->num_states; ++k) {
      ok = ok && d->states[k].placement == ZOPT_PLACE_CPU;
      if (d->states[k].kind == ZOPT_STATE_PARAM) ok = ok && d->states[k].dtype == ZOPT_DTYPE_F32;
    }
    if (!ok) {
      zopt_step_free(s);
      s = nullptr;
    }
  }
  if (!s) {
    printf("test_shared_optimizer: no CPU step with f32 params (skipped)\n");
    return ZT_SKIP;
  }
  const zopt_step_descriptor *d = zopt_step_get_descriptor(s);
  printf("test_shared_optimizer: step '%s'\n", d->name);
  two_threads_step(s, d);
  free_during_step(s);
  state_calls_race(s, d);
  zopt_step_free(s);
  if (zt_failures) {
    fprintf(stderr, "test_shared_optimizer: %d failure(s)\n", zt_failures);
    return 1;
  }
  printf("test_shared_optimizer: passed\n");
  return 0;
}
