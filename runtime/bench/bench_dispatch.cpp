// bench_dispatch: is step() dispatch-bound on many small tensors?
// Times zopt_optimizer_step() for 10,000 tensors x 1,000 elements against
// one tensor of 10,000,000 elements (same bytes), median of repeats.
//   usage: zopt_bench_dispatch STEP.so [repeats=15] [threads=all]
// Target: ratio (many / one) < 1.10.
#include "zopt/zopt.h"

#include <cstdint>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

static size_t esize(uint32_t dt) { return dt == ZOPT_DTYPE_F32 ? 4 : 2; }

struct Setup {
  std::vector<unsigned char> p, g;
  zopt_optimizer *o = nullptr;
  double bytes = 0;  // state traffic per step
  std::vector<double> ts;
};

static void setup(const zopt_step *step, int ntensors, int64_t numel, int threads, Setup &su) {
  const zopt_step_descriptor *d = zopt_step_get_descriptor(step);
  uint32_t pdt = 0, gdt = 0;
  double bytes_per_elem = 0;
  for (uint32_t i = 0; i < d->num_states; ++i) {
    const zopt_state_desc &s = d->states[i];
    if (s.kind == ZOPT_STATE_PARAM) pdt = s.dtype;
    if (s.kind == ZOPT_STATE_GRAD) gdt = s.dtype;
    bytes_per_elem += (double)esize(s.dtype) * (((s.access & ZOPT_ACCESS_READ) ? 1 : 0) +
                                                ((s.access & ZOPT_ACCESS_WRITE) ? 1 : 0));
  }
  size_t total = (size_t)ntensors * (size_t)numel;
  std::vector<unsigned char> &p = su.p, &g = su.g;
  p.resize(total * esize(pdt));
  g.resize(total * esize(gdt));
  // small finite values: 0x3c00 (f16 1.0) / bf16 ~ 0.0; f32 0.001
  if (pdt == ZOPT_DTYPE_F32) std::fill((float *)p.data(), (float *)p.data() + total, 0.5f);
  else std::fill((uint16_t *)p.data(), (uint16_t *)p.data() + total, pdt == ZOPT_DTYPE_BF16 ? 0x3f00 : 0x3800);
  if (gdt == ZOPT_DTYPE_F32) std::fill((float *)g.data(), (float *)g.data() + total, 1e-3f);
  else std::fill((uint16_t *)g.data(), (uint16_t *)g.data() + total, gdt == ZOPT_DTYPE_BF16 ? 0x3a83 : 0x1419);
  zopt_optimizer *o = nullptr;
  if (zopt_optimizer_create(step, &o)) {
    fprintf(stderr, "create: %s\n", zopt_last_error());
    exit(1);
  }
  if (threads > 0) zopt_optimizer_set_num_threads(o, threads);
  int gid, tid;
  zopt_optimizer_add_group(o, &gid);
  for (int t = 0; t < ntensors; ++t) {
    size_t off = (size_t)t * (size_t)numel;
    if (zopt_optimizer_add_tensor(o, gid, p.data() + off * esize(pdt), g.data() + off * esize(gdt), numel,
                                  (zopt_dtype)pdt, &tid)) {
      fprintf(stderr, "add_tensor: %s\n", zopt_last_error());
      exit(1);
    }
  }
  if (zopt_optimizer_finalize(o)) {
    fprintf(stderr, "finalize: %s\n", zopt_last_error());
    exit(1);
  }
  if (d->flags & ZOPT_FLAG_LOSS_SCALE) {
    zopt_loss_scaler_config c = {1, 2, 0.5, 1000000000, 1, 0};  // static S = 1
    zopt_optimizer_configure_loss_scaler(o, &c);
  }
  su.o = o;
  su.bytes = bytes_per_elem * (double)total;
}

static void time_step(Setup &su, bool record) {
  auto t0 = std::chrono::steady_clock::now();
  zopt_step_result res;
  if (zopt_optimizer_step(su.o, &res)) {
    fprintf(stderr, "step: %s\n", zopt_last_error());
    exit(1);
  }
  auto t1 = std::chrono::steady_clock::now();
  if (record) su.ts.push_back(std::chrono::duration<double>(t1 - t0).count());
}

static double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

int main(int argc, char **argv) {
  if (argc < 2) {
    fprintf(stderr, "usage: %s STEP.so [repeats=15] [threads=all]\n", argv[0]);
    return 2;
  }
  int repeats = argc > 2 ? atoi(argv[2]) : 15;
  int threads = argc > 3 ? atoi(argv[3]) : 0;
  if (repeats < 1) repeats = 1;
  zopt_step *step = nullptr;
  if (zopt_step_load(argv[1], &step)) {
    fprintf(stderr, "load: %s\n", zopt_last_error());
    return 1;
  }
  printf("step %s (%s), update isa %d, median of %d\n", argv[1], zopt_step_get_descriptor(step)->name,
         (int)zopt_step_isa(step), repeats);
  // Both layouts live side by side; their steps alternate so that machine
  // noise hits both alike.
  Setup one, many;
  setup(step, 1, 10000000, threads, one);
  setup(step, 10000, 1000, threads, many);
  for (int r = 0; r < repeats + 2; ++r) {
    time_step(one, r >= 2);
    time_step(many, r >= 2);
  }
  double t1 = median(one.ts), tm = median(many.ts);
  printf("1 x 10,000,000     : %8.3f ms  (%.1f GB/s of state traffic)\n", t1 * 1e3, one.bytes / t1 / 1e9);
  printf("10,000 x 1,000     : %8.3f ms  (%.1f GB/s of state traffic)\n", tm * 1e3, many.bytes / tm / 1e9);
  printf("ratio many/one     : %8.3f  (target < 1.10)\n", tm / t1);
  zopt_optimizer_free(one.o);
  zopt_optimizer_free(many.o);
  zopt_step_free(step);
  return 0;
}
