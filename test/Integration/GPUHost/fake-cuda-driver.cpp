//===- fake-cuda-driver.cpp - the stand-in's driver API entry points ------===//
//
// The cu* functions of libzopt-fake-cuda.so (fake-cuda.cpp says what the
// stand-in does and does not do): devices and contexts, modules and
// kernels, launches, memory, copies and memsets, streams, events, graphs.
//===----------------------------------------------------------------------===//
#include "fake-cuda.h"

#include <sys/mman.h>

using namespace fake;

API CUresult cuInit(unsigned) { log("cuInit"); return kOk; }
API CUresult cuDriverGetVersion(int *v) { log("cuDriverGetVersion"); *v = st().driver_version; return kOk; }
API CUresult cuDeviceGetCount(int *n) { log("cuDeviceGetCount"); *n = st().device_count; return kOk; }
API CUresult cuDeviceGet(int *d, int i) {
  log("cuDeviceGet");
  *d = i;
  return i >= 0 && i < st().device_count ? kOk : kInvalidValue;
}
API CUresult cuDeviceGetAttribute(int *v, int attr, int) {
  log("cuDeviceGetAttribute");
  if (attr == st().fail_attribute) return kInvalidValue;
  *v = attr == 75 ? 9 : attr == 76 ? 0 : attr == 16 ? 132 : 0;
  return kOk;
}
API CUresult cuDevicePrimaryCtxRetain(void **ctx, int dev) {
  log("cuDevicePrimaryCtxRetain");
  *ctx = (void *)(uintptr_t)(0x1000 + dev);
  return kOk;
}
API CUresult cuDevicePrimaryCtxRelease_v2(int) { log("cuDevicePrimaryCtxRelease"); return kOk; }
API CUresult cuCtxGetCurrent(void **ctx) {
  log("cuCtxGetCurrent");
  std::lock_guard<std::recursive_mutex> lk(g_mu);
  *ctx = current_ctx();
  return kOk;
}
API CUresult cuCtxSetCurrent(void *ctx) {
  log("cuCtxSetCurrent");
  std::lock_guard<std::recursive_mutex> lk(g_mu);
  auto &s = ctx_stack();
  if (!ctx) {
    if (!s.empty()) s.pop_back();
  } else if (s.empty()) {
    s.push_back(ctx);
  } else {
    s.back() = ctx;
  }
  return kOk;
}
API CUresult cuCtxPushCurrent_v2(void *ctx) {
  log("cuCtxPushCurrent");
  if (!ctx) return kInvalidContext;
  std::lock_guard<std::recursive_mutex> lk(g_mu);
  ctx_stack().push_back(ctx);
  return kOk;
}
API CUresult cuCtxPopCurrent_v2(void **ctx) {
  log("cuCtxPopCurrent");
  std::lock_guard<std::recursive_mutex> lk(g_mu);
  if (ctx_stack().empty()) return kInvalidContext;
  if (ctx) *ctx = ctx_stack().back();
  ctx_stack().pop_back();
  return kOk;
}
API CUresult cuCtxGetDevice(int *d) {
  log("cuCtxGetDevice");
  std::lock_guard<std::recursive_mutex> lk(g_mu);
  if (!current_ctx()) return kInvalidContext;
  *d = ctx_device(current_ctx());
  return kOk;
}
API CUresult cuModuleLoadData(void **mod, const void *image) {
  log("cuModuleLoadData");
  memcpy(&st().image_magic, image, 4);
  if (st().image_magic != 0xBA55ED50u) return kInvalidImage;
  std::string ptx = fatbin_ptx((const unsigned char *)image);
  st().image_ptx = !ptx.empty();
  if (ptx.empty()) return kInvalidImage;  // the stand-in needs the PTX (see the header)
  st().kernels = parse_ptx(ptx.data(), ptx.size());
  for (Kernel &k : st().kernels)
    if (!st().patch_suffix.empty() && ends_with(k.name, st().patch_suffix.c_str())) {
      if (st().patch_delta < 0 && !k.params.empty()) k.params.pop_back();
      if (st().patch_delta > 0) k.params.push_back({k.params.empty() ? 0 : k.params.back().offset + 8, 8});
    }
  *mod = (void *)0x2000;
  return kOk;
}
API CUresult cuModuleUnload(void *) { log("cuModuleUnload"); return kOk; }
API CUresult cuModuleGetFunction(void **fn, void *, const char *name) {
  log("cuModuleGetFunction");
  int k = -1;
  for (size_t i = 0; i < st().kernels.size(); ++i)
    if (st().kernels[i].name == name) k = (int)i;
  if (k < 0) return 500;  // CUDA_ERROR_NOT_FOUND
  st().functions.push_back(name);
  st().function_kernel.push_back(k);
  *fn = (void *)(uintptr_t)st().functions.size();
  return kOk;
}
API CUresult cuFuncGetAttribute(int *v, int attr, void *fn) {
  log("cuFuncGetAttribute");
  size_t i = (uintptr_t)fn;
  if (i < 1 || i > st().functions.size()) return kInvalidHandle;
  const Kernel &k = st().kernels[st().function_kernel[i - 1]];
  if (attr == 0) *v = k.reqntid[0] ? (int)(k.reqntid[0] * k.reqntid[1] * k.reqntid[2]) : 1024;  // MAX_THREADS_PER_BLOCK
  else *v = 0;
  return kOk;
}
API CUresult cuFuncGetParamInfo(void *fn, size_t index, size_t *offset, size_t *size) {
  log("cuFuncGetParamInfo");
  size_t i = (uintptr_t)fn;
  if (i < 1 || i > st().functions.size()) return kInvalidHandle;
  const Kernel &k = st().kernels[st().function_kernel[i - 1]];
  if (index >= k.params.size()) return kInvalidValue;
  *offset = k.params[index].offset;
  *size = k.params[index].size;
  return kOk;
}
API CUresult cuOccupancyMaxActiveBlocksPerMultiprocessor(int *n, void *fn, int block, size_t) {
  log("cuOccupancyMaxActiveBlocksPerMultiprocessor");
  size_t i = (uintptr_t)fn;
  if (i < 1 || i > st().functions.size() || block < 1) return kInvalidValue;
  *n = block <= 64 ? 16 : st().blocks_per_sm;
  return kOk;
}
API CUresult cuLaunchKernel(void *fn, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                            unsigned bz, unsigned shmem, void *stream, void **args, void **extra) {
  log("cuLaunchKernel");
  if (st().fail_next_launch) {
    st().fail_next_launch = 0;
    return kLaunchFailed;
  }
  size_t i = (uintptr_t)fn;
  if (i < 1 || i > st().functions.size() || !args || extra) return kInvalidValue;
  if (!current_ctx()) return kInvalidContext;
  const Kernel &k = st().kernels[st().function_kernel[i - 1]];
  if (k.reqntid[0] && (bx != k.reqntid[0] || by != k.reqntid[1] || bz != k.reqntid[2])) return kInvalidValue;
  if (!gx || !gy || !gz || gx > 0x7fffffffu || gy > 65535 || gz > 65535) return kInvalidValue;
  if (legacy_conflict(stream)) return kCaptureImplicit;
  Launch l{};
  l.name = st().functions[i - 1];
  l.grid[0] = gx, l.grid[1] = gy, l.grid[2] = gz;
  l.block[0] = bx, l.block[1] = by, l.block[2] = bz;
  l.stream = stream;
  l.ctx = current_ctx();
  l.nargs = (int)std::min<size_t>(k.params.size(), 16);
  // Exactly the declared bytes of each parameter (8-byte words here: every
  // zopt kernel parameter is a pointer or a 64-bit integer).
  for (int a = 0; a < l.nargs; ++a) {
    if (!args[a]) return kInvalidValue;
    memcpy(&l.arg[a], args[a], std::min<size_t>(k.params[a].size, 8));
  }
  (void)shmem;
  if (Graph *g = capture_of(stream)) {
    Node n{};
    n.kind = Node::kLaunch;
    n.launch = l;
    g->nodes.push_back(n);
    return kOk;
  }
  {
    std::lock_guard<std::recursive_mutex> lk(g_mu);
    st().launches.push_back(l);
  }
  if (st().emulate) enqueue(stream, [l] { run_launch(l); });
  return kOk;
}
API CUresult cuMemAlloc_v2(CUdeviceptr *p, size_t bytes) {
  log("cuMemAlloc");
  void *m = nullptr;
  bool huge = bytes > kHuge;
  if (huge) {
    m = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (m == MAP_FAILED) return kOutOfMemory;
  } else {
    m = aligned_alloc(256, (bytes + 255) / 256 * 256);
    if (!m) return kOutOfMemory;
    memset(m, 0xA5, bytes);  // garbage, as real device memory may hold
  }
  std::lock_guard<std::recursive_mutex> lk(g_mu);
  st().allocs[(uintptr_t)m] = bytes;
  st().alloc_device[(uintptr_t)m] = ctx_device(current_ctx());
  st().lazy[(uintptr_t)m] = huge;
  *p = (CUdeviceptr)(uintptr_t)m;
  return kOk;
}
API CUresult cuMemFree_v2(CUdeviceptr p) {
  log("cuMemFree");
  std::lock_guard<std::recursive_mutex> lk(g_mu);
  auto it = st().allocs.find((uintptr_t)p);
  if (it == st().allocs.end()) return kInvalidValue;
  if (st().lazy.count(it->first) && it->second > kHuge) munmap((void *)(uintptr_t)p, it->second);
  else free((void *)(uintptr_t)p);
  st().lazy.erase(it->first);
  st().alloc_device.erase(it->first);
  st().allocs.erase(it);
  return kOk;
}
API CUresult cuMemHostAlloc(void **p, size_t bytes, unsigned) {
  log("cuMemHostAlloc");
  *p = aligned_alloc(4096, (bytes + 4095) / 4096 * 4096);
  if (*p) {
    std::lock_guard<std::mutex> lk(g_pinned_mu);
    g_pinned[(uintptr_t)*p] = bytes;
  }
  return *p ? kOk : kOutOfMemory;
}
API CUresult cuMemFreeHost(void *p) {
  log("cuMemFreeHost");
  {
    std::lock_guard<std::mutex> lk(g_pinned_mu);
    g_pinned.erase((uintptr_t)p);
  }
  free(p);
  return kOk;
}
static void touch(CUdeviceptr dst) {
  std::lock_guard<std::recursive_mutex> lk(g_mu);
  auto it = find_alloc((uintptr_t)dst);
  if (it != st().allocs.end()) st().lazy[it->first] = false;
}
API CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void *src, size_t n, void *stream) {
  log("cuMemcpyHtoDAsync");
  if (bad_range("cuMemcpyHtoDAsync", dst, n)) return kInvalidValue;
  if (legacy_conflict(stream)) return kCaptureImplicit;
  if (Graph *g = capture_of(stream)) {
    if (!pinned(src, n)) return refuse_in_capture(g);
    Node node{};
    node.kind = Node::kCopyHtoD;
    node.dptr = dst, node.hptr = const_cast<void *>(src), node.n = n;
    g->nodes.push_back(node);
    return kOk;
  }
  {
    Hold &h = hold();
    std::unique_lock<std::mutex> lk(h.mu);
    if (dst < h.fail_hi && dst + n > h.fail_lo) {  // fake_cuda_fail_htod
      h.fail_lo = h.fail_hi = 0;
      return (CUresult)700;
    }
    if (dst < h.stall_hi && dst + n > h.stall_lo) {  // fake_cuda_stall_htod: the caller waits
      const uint64_t g0 = h.gen;
      h.cv.wait(lk, [&] { return h.gen != g0; });
    }
  }
  touch(dst);
  {
    std::lock_guard<std::recursive_mutex> lk(g_mu);
    st().htod_log.push_back({dst, n, stream});
  }
  bool held = false;
  uint64_t gen = 0;
  {
    Hold &h = hold();
    std::lock_guard<std::mutex> lk(h.mu);
    held = dst < h.hi && dst + n > h.lo;
    gen = h.gen;
  }
  if (held) {  // queued; runs once released (fake_cuda_hold_htod)
    std::shared_ptr<std::vector<char>> copy;
    if (!pinned(src, n)) copy.reset(new std::vector<char>((const char *)src, (const char *)src + n));
    enqueue(stream, [dst, src, n, copy, gen] {
      Hold &h = hold();
      {
        std::unique_lock<std::mutex> lk(h.mu);
        h.cv.wait(lk, [&] { return h.gen != gen; });
      }
      memcpy((void *)(uintptr_t)dst, copy ? copy->data() : src, n);
    });
    return kOk;
  }
  if (st().htod_delay_us && pinned(src, n)) {  // a DMA that takes a while
    unsigned us = st().htod_delay_us;
    enqueue(stream, [dst, src, n, us] {
      std::this_thread::sleep_for(std::chrono::microseconds(us));
      memcpy((void *)(uintptr_t)dst, src, n);
      ++g_delayed_done;
    });
    return kOk;
  }
  if ((busy(stream) || async_copies()) && pinned(src, n)) {  // read at its turn
    const unsigned us = stress_delay_us();
    enqueue(stream, [dst, src, n, us] {
      if (us) std::this_thread::sleep_for(std::chrono::microseconds(us));
      memcpy((void *)(uintptr_t)dst, src, n);
    });
    return kOk;
  }
  if (busy(stream)) {  // pageable: the source is read now
    std::shared_ptr<std::vector<char>> copy(new std::vector<char>((const char *)src, (const char *)src + n));
    enqueue(stream, [dst, copy] { memcpy((void *)(uintptr_t)dst, copy->data(), copy->size()); });
    return kOk;
  }
  memcpy((void *)(uintptr_t)dst, src, n);
  return kOk;
}
API CUresult cuMemcpyDtoHAsync_v2(void *dst, CUdeviceptr src, size_t n, void *stream) {
  log("cuMemcpyDtoHAsync");
  if (bad_range("cuMemcpyDtoHAsync", src, n)) return kInvalidValue;
  if (legacy_conflict(stream)) return kCaptureImplicit;
  if (Graph *g = capture_of(stream)) {
    if (!pinned(dst, n)) return refuse_in_capture(g);
    Node node{};
    node.kind = Node::kCopyDtoH;
    node.dptr = src, node.hptr = dst, node.n = n;
    g->nodes.push_back(node);
    return kOk;
  }
  if ((busy(stream) || async_copies()) && pinned(dst, n)) {
    const unsigned us = stress_delay_us();
    enqueue(stream, [dst, src, n, us] {
      if (us) std::this_thread::sleep_for(std::chrono::microseconds(us));
      memcpy(dst, (const void *)(uintptr_t)src, n);
    });
    return kOk;
  }
  if (busy(stream)) drain(stream);  // pageable memory: the copy is synchronous
  memcpy(dst, (const void *)(uintptr_t)src, n);
  return kOk;
}
API CUresult cuMemsetD8Async(CUdeviceptr dst, unsigned char v, size_t n, void *stream) {
  log("cuMemsetD8Async");
  if (bad_range("cuMemsetD8Async", dst, n)) return kInvalidValue;
  if (legacy_conflict(stream)) return kCaptureImplicit;
  if (Graph *g = capture_of(stream)) {
    Node node{};
    node.kind = Node::kMemset8;
    node.dptr = dst, node.value = v, node.n = n;
    g->nodes.push_back(node);
    return kOk;
  }
  if (lazy_zero(dst, v)) return kOk;
  touch(dst);
  if (busy(stream)) {
    enqueue(stream, [dst, v, n] { memset((void *)(uintptr_t)dst, v, n); });
    return kOk;
  }
  memset((void *)(uintptr_t)dst, v, n);
  return kOk;
}
static void memset32(CUdeviceptr dst, unsigned v, size_t n) {
  for (size_t i = 0; i < n; ++i) memcpy((char *)(uintptr_t)dst + 4 * i, &v, 4);
}
API CUresult cuMemsetD32Async(CUdeviceptr dst, unsigned v, size_t n, void *stream) {
  log("cuMemsetD32Async");
  if (st().fail_memset_in > 0 && --st().fail_memset_in == 0) return kInvalidValue;  // fake_cuda_fail_memset
  if (dst % 4) return kInvalidValue;
  if (bad_range("cuMemsetD32Async", dst, n * 4)) return kInvalidValue;
  if (legacy_conflict(stream)) return kCaptureImplicit;
  if (Graph *g = capture_of(stream)) {
    Node node{};
    node.kind = Node::kMemset32;
    node.dptr = dst, node.value = v, node.n = n;
    g->nodes.push_back(node);
    return kOk;
  }
  touch(dst);
  if (busy(stream)) {
    enqueue(stream, [dst, v, n] { memset32(dst, v, n); });
    return kOk;
  }
  memset32(dst, v, n);
  return kOk;
}
// Synchronous copies and device synchronisation (applications, e.g.
// zopt-gpu-check run against the stand-in).
API CUresult cuMemcpyHtoD_v2(CUdeviceptr dst, const void *src, size_t n) {
  log("cuMemcpyHtoD");
  if (bad_range("cuMemcpyHtoD", dst, n)) return kInvalidValue;
  touch(dst);
  memcpy((void *)(uintptr_t)dst, src, n);
  return kOk;
}
API CUresult cuMemcpyDtoH_v2(void *dst, CUdeviceptr src, size_t n) {
  log("cuMemcpyDtoH");
  if (bad_range("cuMemcpyDtoH", src, n)) return kInvalidValue;
  memcpy(dst, (const void *)(uintptr_t)src, n);
  return kOk;
}
API CUresult cuCtxSynchronize(void) {
  log("cuCtxSynchronize");
  std::vector<void *> streams;
  {
    std::lock_guard<std::mutex> lk(g_streams_mu);
    for (auto &s : *g_streams) streams.push_back(s.first);
  }
  for (void *s : streams) drain(s);
  return kOk;
}
API CUresult cuDeviceGetName(char *name, int len, int dev) {
  log("cuDeviceGetName");
  snprintf(name, (size_t)len, "zopt stand-in sm_90 #%d", dev);
  return kOk;
}
API CUresult cuStreamSynchronize(void *stream) {
  log("cuStreamSynchronize");
  if (Graph *g = capture_of(stream)) return refuse_in_capture(g);
  if (legacy_conflict(stream)) return kCaptureImplicit;
  drain(stream);
  return kOk;
}
// Not logged: callers poll it.
API CUresult cuStreamQuery(void *stream) { return busy(stream) ? kNotReady : kOk; }
API CUresult cuStreamIsCapturing(void *stream, int *status) {
  log("cuStreamIsCapturing");
  Graph *g = capture_of(stream);
  if (!stream && !g) {
    std::lock_guard<std::recursive_mutex> lk(g_mu);
    if (!st().capturing.empty()) return kCaptureImplicit;
  }
  *status = g ? (g->invalid ? 2 : 1) : 0;
  return kOk;
}
static std::set<Graph *> &live_graphs() {
  static auto *g = new std::set<Graph *>;  // never destroyed (see cuEventDestroy)
  return *g;
}
API CUresult cuStreamBeginCapture_v2(void *stream, int) {
  log("cuStreamBeginCapture");
  std::lock_guard<std::recursive_mutex> lk(g_mu);
  if (!stream || st().capturing.count(stream)) return kInvalidValue;
  // Every graph stays reachable from here until cuGraphDestroy (a test that
  // does not destroy its graph does not leak under LeakSanitizer).
  Graph *graph = new Graph;
  live_graphs().insert(graph);
  st().capturing[stream] = graph;
  return kOk;
}
API CUresult cuStreamEndCapture(void *stream, void **graph) {
  log("cuStreamEndCapture");
  std::lock_guard<std::recursive_mutex> lk(g_mu);
  auto it = st().capturing.find(stream);
  if (it == st().capturing.end()) return kInvalidValue;
  Graph *g = it->second;
  st().capturing.erase(it);
  if (g->invalid) {
    delete g;
    *graph = nullptr;
    return kCaptureInvalidated;
  }
  *graph = g;
  return kOk;
}
API CUresult cuGraphInstantiateWithFlags(void **exec, void *graph, unsigned long long) {
  log("cuGraphInstantiateWithFlags");
  *exec = graph;
  return graph ? kOk : kInvalidValue;
}
API CUresult cuGraphLaunch(void *exec, void *stream) {
  log("cuGraphLaunch");
  Graph *g = (Graph *)exec;
  if (!g) return kInvalidValue;
  int replay;
  {
    std::lock_guard<std::recursive_mutex> lk(g_mu);
    replay = ++st().replays;
  }
  for (const Node &n : g->nodes) {
    switch (n.kind) {
      case Node::kLaunch: {
        Launch l = n.launch;
        l.stream = stream;
        l.replay = replay;
        {
          std::lock_guard<std::recursive_mutex> lk(g_mu);
          st().launches.push_back(l);
        }
        enqueue(stream, [l] { run_launch(l); });
        break;
      }
      case Node::kCopyHtoD:
        enqueue(stream, [n] { memcpy((void *)(uintptr_t)n.dptr, n.hptr, n.n); });
        break;
      case Node::kCopyDtoH:
        enqueue(stream, [n] { memcpy(n.hptr, (const void *)(uintptr_t)n.dptr, n.n); });
        break;
      case Node::kMemset8:
        enqueue(stream, [n] { memset((void *)(uintptr_t)n.dptr, (int)n.value, n.n); });
        break;
      case Node::kMemset32:
        enqueue(stream, [n] { memset32(n.dptr, n.value, n.n); });
        break;
      case Node::kRecord: {
        Event *e = n.ev;
        uint64_t seq = record_seq(e);  // the record belongs to this launch
        enqueue(stream, [e, seq] { complete(e, seq); });
        break;
      }
      case Node::kWait: {
        Event *e = n.ev;
        uint64_t seq;
        {
          std::lock_guard<std::mutex> lk(e->mu);
          seq = e->recorded;  // as of the launch
        }
        enqueue(stream, [e, seq] { wait_for(e, seq); });
        break;
      }
    }
  }
  return kOk;
}
API CUresult cuGraphExecDestroy(void *) { log("cuGraphExecDestroy"); return kOk; }
API CUresult cuGraphDestroy(void *graph) {
  log("cuGraphDestroy");
  std::lock_guard<std::recursive_mutex> lk(g_mu);
  live_graphs().erase((Graph *)graph);
  delete (Graph *)graph;
  return kOk;
}
API CUresult cuStreamCreate(void **stream, unsigned) {
  log("cuStreamCreate");
  static std::atomic<uintptr_t> next{0x7000};
  *stream = (void *)(next += 16);
  return kOk;
}
API CUresult cuStreamDestroy_v2(void *) { log("cuStreamDestroy"); return kOk; }
API CUresult cuEventCreate(void **ev, unsigned) {
  log("cuEventCreate");
  *ev = new Event;
  return kOk;
}
API CUresult cuEventDestroy_v2(void *ev) {
  log("cuEventDestroy");
  // Queued work may still refer to it: kept until exit (a test process is
  // short), reachable so that LeakSanitizer does not report it.
  // (A pointer to a vector never destroyed: static destructors run before
  // LeakSanitizer looks.)
  static auto *graveyard = new std::vector<void *>;
  std::lock_guard<std::recursive_mutex> lk(g_mu);
  graveyard->push_back(ev);
  return kOk;
}
API CUresult cuEventRecordWithFlags(void *ev, void *stream, unsigned flags) {
  log("cuEventRecord");
  Event *e = (Event *)ev;
  if (!e) return kInvalidHandle;
  if (legacy_conflict(stream)) return kCaptureImplicit;
  if (Graph *g = capture_of(stream)) {
    if (flags & kEventRecordExternal) {
      Node node{};
      node.kind = Node::kRecord;
      node.ev = e;
      g->nodes.push_back(node);
    } else {
      std::lock_guard<std::mutex> lk(e->mu);
      e->in_capture = true;  // an internal dependency of the capture
    }
    return kOk;
  }
  if (flags & kEventRecordExternal) return kInvalidValue;  // only valid in a capture
  record_on(e, stream);
  return kOk;
}
API CUresult cuEventRecord(void *ev, void *stream) { return cuEventRecordWithFlags(ev, stream, 0); }
API CUresult cuStreamWaitEvent(void *stream, void *ev, unsigned flags) {
  log("cuStreamWaitEvent");
  Event *e = (Event *)ev;
  if (!e) return kInvalidHandle;
  if (legacy_conflict(stream)) return kCaptureImplicit;
  if (Graph *g = capture_of(stream)) {
    if (flags & kEventWaitExternal) {
      Node node{};
      node.kind = Node::kWait;
      node.ev = e;
      g->nodes.push_back(node);
      return kOk;
    }
    std::lock_guard<std::mutex> lk(e->mu);
    if (!e->in_capture && e->recorded) {  // recorded outside this capture
      g->invalid = true;
      return kCaptureIsolation;
    }
    return kOk;
  }
  if (flags & kEventWaitExternal) return kInvalidValue;  // only valid in a capture
  wait_on(e, stream);
  return kOk;
}
API CUresult cuEventSynchronize(void *ev) {
  log("cuEventSynchronize");
  Event *e = (Event *)ev;
  if (!e) return kInvalidHandle;
  uint64_t seq;
  {
    std::lock_guard<std::mutex> lk(e->mu);
    seq = e->recorded;
  }
  wait_for(e, seq);
  return kOk;
}
API CUresult cuEventQuery(void *ev) {
  Event *e = (Event *)ev;
  std::lock_guard<std::mutex> lk(e->mu);
  return e->completed >= e->recorded ? kOk : kNotReady;
}
API CUresult cuGetErrorString(CUresult r, const char **s) {
  *s = r == kLaunchFailed          ? "CUDA_ERROR_LAUNCH_FAILED (fake)"
       : r == kCaptureUnsupported  ? "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED (fake)"
       : r == kCaptureImplicit     ? "CUDA_ERROR_STREAM_CAPTURE_IMPLICIT (fake)"
       : r == kCaptureIsolation    ? "CUDA_ERROR_STREAM_CAPTURE_ISOLATION (fake)"
       : r == kInvalidContext      ? "CUDA_ERROR_INVALID_CONTEXT (fake)"
                                   : "fake CUDA error";
  return kOk;
}
API CUresult cuPointerGetAttribute(void *out, int attr, CUdeviceptr p) {
  log("cuPointerGetAttribute");
  std::lock_guard<std::recursive_mutex> lk(g_mu);
  auto it = find_alloc((uintptr_t)p);
  if (attr == 2) {  // CU_POINTER_ATTRIBUTE_MEMORY_TYPE
    unsigned type = it != st().allocs.end() ? 2 : 1;  // device : host
    memcpy(out, &type, sizeof type);
    return kOk;
  }
  if (attr == 9) {  // CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL
    if (it == st().allocs.end()) return kInvalidValue;
    int dev = st().alloc_device[it->first];
    memcpy(out, &dev, sizeof dev);
    return kOk;
  }
  if (attr == 11 || attr == 12) {  // CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, _RANGE_SIZE: the allocation
    if (it == st().allocs.end()) return kInvalidValue;
    if (attr == 11) {
      CUdeviceptr start = (CUdeviceptr)it->first;
      memcpy(out, &start, sizeof start);
    } else {
      size_t size = it->second;
      memcpy(out, &size, sizeof size);
    }
    return kOk;
  }
  return kInvalidValue;
}
