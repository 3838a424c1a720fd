//===- fake-cuda-control.cpp - what zopt-gpu-host-check asks the stand-in --===//
//
// fake_cuda_*: the calls and launches recorded, the kernels' parameter
// lists, failures to inject, the emulation's switches and what it saw.
//===----------------------------------------------------------------------===//
#include "fake-cuda.h"

using namespace fake;

API int fake_cuda_num_calls(void) {
  std::lock_guard<std::recursive_mutex> lk(g_mu);
  return (int)st().calls.size();
}
API const char *fake_cuda_call(int i) {
  std::lock_guard<std::recursive_mutex> lk(g_mu);
  return st().calls[(size_t)i].c_str();
}
API int fake_cuda_num_launches(void) {
  std::lock_guard<std::recursive_mutex> lk(g_mu);
  return (int)st().launches.size();
}
// Launch i: its kernel's name, shape, stream and first 12 parameters.
API const char *fake_cuda_launch(int i, unsigned grid[3], unsigned block[3], void **stream,
                                 unsigned long long args[12]) {
  std::lock_guard<std::recursive_mutex> lk(g_mu);
  const Launch &l = st().launches[(size_t)i];
  memcpy(grid, l.grid, sizeof l.grid);
  memcpy(block, l.block, sizeof l.block);
  *stream = l.stream;
  memcpy(args, l.arg, 12 * sizeof(unsigned long long));
  return l.name.c_str();
}
// The context current at launch i, its parameter count (from the PTX) and
// its replay number (0: not a graph replay).
API void *fake_cuda_launch_context(int i) { return st().launches[(size_t)i].ctx; }
API int fake_cuda_launch_nargs(int i) { return st().launches[(size_t)i].nargs; }
API int fake_cuda_launch_replay(int i) { return st().launches[(size_t)i].replay; }
API int fake_cuda_num_allocs(void) {
  std::lock_guard<std::recursive_mutex> lk(g_mu);
  return (int)st().allocs.size();
}
API void fake_cuda_fail_next_launch(void) { st().fail_next_launch = 1; }
API void fake_cuda_fail_memset(int n) { st().fail_memset_in = n; }
API void fake_cuda_set_update_nargs(int) {}  // the parameter lists come from the PTX now
API unsigned fake_cuda_image_magic(void) { return st().image_magic; }
API int fake_cuda_image_has_ptx(void) { return st().image_ptx; }
// The .param list of kernel `name` of the last image: count, and sizes[i].
API int fake_cuda_kernel_params(const char *name, size_t sizes[16]) {
  for (const Kernel &k : st().kernels)
    if (k.name == name) {
      for (size_t i = 0; i < k.params.size() && i < 16; ++i) sizes[i] = k.params[i].size;
      return (int)k.params.size();
    }
  return -1;
}
API void fake_cuda_set_device_count(int n) { st().device_count = n; }
API void fake_cuda_set_driver_version(int v) { st().driver_version = v; }
API void fake_cuda_fail_attribute(int attr) { st().fail_attribute = attr; }
API void fake_cuda_set_blocks_per_sm(int n) { st().blocks_per_sm = n; }
// Emulation (see the header): kernels queued and delayed by `delay_us`.
API void fake_cuda_set_emulation(int on, unsigned delay_us) {
  st().emulate = on != 0;
  st().delay_us = delay_us;
}
API int fake_cuda_num_prepares(void) {
  std::lock_guard<std::recursive_mutex> lk(g_mu);
  return (int)st().prepare_hypers.size();
}
// The hyperparameter table executed PREPARE i read: copies up to n values.
API int fake_cuda_prepare_hypers(int i, double *out, int n) {
  std::lock_guard<std::recursive_mutex> lk(g_mu);
  const auto &v = st().prepare_hypers[(size_t)i];
  int m = std::min<int>(n, (int)v.size());
  memcpy(out, v.data(), (size_t)m * 8);
  return m;
}
// The next images' kernels whose name ends with `suffix` get one parameter
// less (delta < 0) or more (delta > 0) than their PTX says: a step compiled
// for another signature. "" stops it.
API void fake_cuda_patch_params(const char *suffix, int delta) {
  st().patch_suffix = suffix ? suffix : "";
  st().patch_delta = delta;
}
// Copies from pinned host memory to the device take `us` microseconds and
// run in stream order (0: at once, the default).
API void fake_cuda_set_htod_delay(unsigned us) { st().htod_delay_us = us; }
// How many of those delayed copies have finished.
API int fake_cuda_num_delayed_done(void) { return g_delayed_done.load(); }
// For other stand-in libraries (the stand-in NCCL): runs fn(arg) on the
// stream's worker thread after the stream's earlier queued work.
API int fake_cuda_stream_enqueue(void *stream, void (*fn)(void *), void *arg) {
  enqueue(stream, [fn, arg] { fn(arg); });
  return 0;
}
// Copies and memsets refused because their device range was not inside one
// allocation: count, and the i-th as "api(address, bytes)".
API int fake_cuda_num_bad_ranges(void) {
  std::lock_guard<std::recursive_mutex> lk(g_mu);
  return (int)st().bad_ranges.size();
}
API const char *fake_cuda_bad_range(int i) {
  std::lock_guard<std::recursive_mutex> lk(g_mu);
  return st().bad_ranges[(size_t)i].c_str();
}
// Whether [p, p + n) lies inside one live allocation of cuMemAlloc.
API int fake_cuda_in_alloc(unsigned long long p, size_t n) {
  std::lock_guard<std::recursive_mutex> lk(g_mu);
  return find_alloc((uintptr_t)p, n ? n : 1) != st().allocs.end();
}
// Waits until every stream's queued work ran.
API void fake_cuda_drain_all(void) {
  std::vector<void *> streams;
  {
    std::lock_guard<std::mutex> lk(g_streams_mu);
    for (auto &s : *g_streams) streams.push_back(s.first);
  }
  for (void *s : streams) drain(s);
}
// Host-to-device copies issued outside captures: count, and the i-th's
// destination, bytes and stream (call order: the order of each stream's).
API int fake_cuda_num_htod(void) {
  std::lock_guard<std::recursive_mutex> lk(g_mu);
  return (int)st().htod_log.size();
}
API void fake_cuda_htod(int i, unsigned long long *dst, size_t *n, void **stream) {
  std::lock_guard<std::recursive_mutex> lk(g_mu);
  const State::HtoD &c = st().htod_log[(size_t)i];
  *dst = c.dst;
  *n = c.n;
  *stream = c.stream;
}
// Host-to-device copies into [lo, hi) issued from now on are queued on
// their stream and wait at their turn (so does the stream's later work)
// until fake_cuda_release_htod, which lets every held copy run.
API void fake_cuda_hold_htod(unsigned long long lo, unsigned long long hi) {
  Hold &h = hold();
  std::lock_guard<std::mutex> lk(h.mu);
  h.lo = lo;
  h.hi = hi;
}
// A host-to-device copy into [lo, hi) issued from now on blocks its caller
// (in the call) until fake_cuda_release_htod.
API void fake_cuda_stall_htod(unsigned long long lo, unsigned long long hi) {
  Hold &h = hold();
  std::lock_guard<std::mutex> lk(h.mu);
  h.stall_lo = lo;
  h.stall_hi = hi;
}
// The next host-to-device copy into [lo, hi) fails (700, an illegal
// address), once; nothing is copied.
API void fake_cuda_fail_htod(unsigned long long lo, unsigned long long hi) {
  Hold &h = hold();
  std::lock_guard<std::mutex> lk(h.mu);
  h.fail_lo = lo;
  h.fail_hi = hi;
}
API void fake_cuda_release_htod(void) {
  Hold &h = hold();
  std::lock_guard<std::mutex> lk(h.mu);
  h.lo = h.hi = h.stall_lo = h.stall_hi = 0;
  ++h.gen;
  h.cv.notify_all();
}
