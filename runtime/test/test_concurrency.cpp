// Concurrency stress test (run under ThreadSanitizer by scripts/sanitize.sh):
// several optimizers, each used by its own thread, step at the same time
// over their own pools of worker threads, while one of them saves and
// reloads checkpoints and another provokes errors; every optimizer must end
// bit-identical to the same run done alone, and every thread must read its
// own error messages (they are per thread).
// Steps: argv[1..] (files or directories of *.so); skipped (77) without.
#include "test_util.h"

#include <atomic>
#include <cmath>
#include <string>
#include <thread>
#include <unistd.h>
#include <vector>

namespace {

size_t esize(uint32_t dt) { return dt == ZOPT_DTYPE_F32 ? 4 : 2; }

struct Run {
  std::vector<std::vector<unsigned char>> p, g;
  std::vector<unsigned char> result;  // params + every state after the steps
  bool ok = true;
  std::string why;
};

void fill(std::vector<unsigned char> &b, uint32_t dt, uint64_t seed) {
  size_t n = b.size() / esize(dt);
  for (size_t i = 0; i < n; ++i) {
    uint64_t h = (seed + i) * 0x9E3779B97F4A7C15ull;
    h ^= h >> 29;
    float v = ((float)(h & 0xffff) / 65536.0f - 0.5f) * 0.01f;
    if (dt == ZOPT_DTYPE_F32) {
      memcpy(&b[4 * i], &v, 4);
    } else {
      uint32_t u;
      memcpy(&u, &v, 4);
      uint16_t x = dt == ZOPT_DTYPE_BF16 ? (uint16_t)(u >> 16) : (uint16_t)0x2000;  // small f16
      memcpy(&b[2 * i], &x, 2);
    }
  }
}

// One optimizer's run: `steps` steps; with `ckpt`, save + load after every
// step (the load must restore exactly what was saved); with `errors`,
// provoke and check errors between steps.
void run(const char *path, int id, int steps, int threads, const char *ckpt, bool errors, Run *out) {
  auto bad = [&](const std::string &w) {
    if (out->ok) out->why = w + ": " + zopt_last_error();
    out->ok = false;
  };
  zopt_step *s = nullptr;
  if (zopt_step_load(path, &s) != ZOPT_OK) return bad("load");
  const zopt_step_descriptor *d = zopt_step_get_descriptor(s);
  uint32_t pdt = 0, gdt = 0;
  for (uint32_t i = 0; i < d->num_states; ++i) {
    if (d->states[i].kind == ZOPT_STATE_PARAM) pdt = d->states[i].dtype;
    if (d->states[i].kind == ZOPT_STATE_GRAD) gdt = d->states[i].dtype;
  }
  zopt_optimizer *o = nullptr;
  if (zopt_optimizer_create(s, &o) != ZOPT_OK) return bad("create");
  zopt_optimizer_set_num_threads(o, threads);
  int gid, tid;
  zopt_optimizer_add_group(o, &gid);
  const int64_t sizes[] = {70001, 513, 131072, 9};
  for (int t = 0; t < 4; ++t) {
    out->p.emplace_back((size_t)sizes[t] * esize(pdt));
    out->g.emplace_back((size_t)sizes[t] * esize(gdt));
    fill(out->p[t], pdt, 1000 * id + t);
    if (zopt_optimizer_add_tensor(o, gid, out->p[t].data(), out->g[t].data(), sizes[t], (zopt_dtype)pdt, &tid))
      return bad("add_tensor");
  }
  if (zopt_optimizer_finalize(o) != ZOPT_OK) return bad("finalize");
  for (int k = 0; k < steps && out->ok; ++k) {
    for (int t = 0; t < 4; ++t) fill(out->g[t], gdt, 77 * k + t + 100 * id);
    zopt_step_result r;
    if (zopt_optimizer_step(o, &r) != ZOPT_OK) return bad("step");
    if (ckpt) {
      if (zopt_optimizer_save(o, ckpt) != ZOPT_OK) return bad("save");
      if (zopt_optimizer_load(o, ckpt) != ZOPT_OK) return bad("load");
    }
    if (errors) {
      // Errors are per thread: this thread's message, whatever the others do.
      if (zopt_optimizer_set_hyper(o, gid, "no_such_hyper", 1.0) != ZOPT_ERR_INVALID_ARGUMENT ||
          !strstr(zopt_last_error(), "no_such_hyper"))
        return bad("error message of this thread");
      usleep(100);
      if (!strstr(zopt_last_error(), "no_such_hyper")) return bad("error message kept");
    }
  }
  for (auto &b : out->p) out->result.insert(out->result.end(), b.begin(), b.end());
  for (uint32_t i = 0; i < d->num_states; ++i) {
    uint32_t kind = d->states[i].kind;
    if (kind == ZOPT_STATE_PARAM || kind == ZOPT_STATE_GRAD) continue;
    for (int t = 0; t < 4; ++t) {
      std::vector<unsigned char> b((size_t)sizes[t] * esize(d->states[i].dtype));
      if (zopt_optimizer_read_state_raw(o, t, (zopt_state_kind)kind, b.data(), b.size())) return bad("read_state");
      out->result.insert(out->result.end(), b.begin(), b.end());
    }
  }
  zopt_optimizer_free(o);
  zopt_step_free(s);
}

}  // namespace

int main(int argc, char **argv) {
  static char paths[64][4096];
  int n = zt_collect_steps(argc, argv, paths, 64);
  std::vector<std::string> cpu;
  for (int i = 0; i < n; ++i) {
    zopt_step *s = nullptr;
    if (zopt_step_load(paths[i], &s) != ZOPT_OK) continue;
    bool gpu = false;
    const zopt_step_descriptor *d = zopt_step_get_descriptor(s);
    for (uint32_t k = 0; k < d->num_states; ++k) gpu |= d->states[k].placement == ZOPT_PLACE_GPU;
    if (!gpu) cpu.push_back(paths[i]);
    zopt_step_free(s);
  }
  if (cpu.empty()) {
    printf("test_concurrency: no CPU steps (skipped)\n");
    return ZT_SKIP;
  }
  const int kOpt = 4, kSteps = 6;
  char ckpt[] = "/tmp/zopt_conc_XXXXXX";
  int fd = mkstemp(ckpt);
  close(fd);
  // Alone, one after the other: the reference results.
  std::vector<Run> alone(kOpt), together(kOpt);
  for (int i = 0; i < kOpt; ++i)
    run(cpu[i % cpu.size()].c_str(), i, kSteps, 2, i == 0 ? ckpt : nullptr, i == 1, &alone[i]);
  // Together: every optimizer on its own thread, each with 2 pool threads.
  for (int rep = 0; rep < 3; ++rep) {
    std::vector<std::thread> th;
    for (int i = 0; i < kOpt; ++i)
      th.emplace_back([&, i] {
        together[i] = Run();
        run(cpu[i % cpu.size()].c_str(), i, kSteps, 2, i == 0 ? ckpt : nullptr, i == 1, &together[i]);
      });
    for (auto &t : th) t.join();
    for (int i = 0; i < kOpt; ++i) {
      if (!alone[i].ok || !together[i].ok) {
        fprintf(stderr, "optimizer %d failed: %s%s\n", i, alone[i].why.c_str(), together[i].why.c_str());
        zt_failures++;
      }
      ZT_CHECK(alone[i].result == together[i].result);
    }
  }
  unlink(ckpt);
  unlink((std::string(ckpt) + ".tmp").c_str());
  // One step shared by threads that create and free optimizers of it at
  // once (loopback ranks do this): the step's reference count is atomic, and
  // the step outlives the last optimizer.
  {
    zopt_step *shared = nullptr;
    ZT_CHECK(zopt_step_load(cpu[0].c_str(), &shared) == ZOPT_OK);
    std::vector<std::thread> th;
    std::atomic<int> bad{0};
    for (int i = 0; i < 4; ++i)
      th.emplace_back([&] {
        for (int k = 0; k < 200; ++k) {
          zopt_optimizer *o = nullptr;
          if (zopt_optimizer_create(shared, &o) != ZOPT_OK) bad++;
          zopt_optimizer_free(o);
        }
      });
    for (auto &t : th) t.join();
    ZT_CHECK(bad.load() == 0);
    // Still usable after 800 optimizers came and went.
    ZT_CHECK(zopt_step_get_descriptor(shared) != nullptr);
    zopt_optimizer *o = nullptr;
    ZT_CHECK(zopt_optimizer_create(shared, &o) == ZOPT_OK);
    zopt_step_free(shared);  // the optimizer keeps it alive
    zopt_optimizer_free(o);
  }
  if (zt_failures) {
    fprintf(stderr, "test_concurrency: %d failure(s)\n", zt_failures);
    return 1;
  }
  printf("test_concurrency: %d optimizers x 3 rounds on their own threads (one saving and loading every step, one "
         "provoking errors): bit-identical to running alone\n",
         kOpt);
  return 0;
}
