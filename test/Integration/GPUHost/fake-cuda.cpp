//===- fake-cuda.cpp - a CUDA driver stand-in that records what it is asked --===//
//
// libzopt-fake-cuda.so exports the driver entry points the runtime resolves
// (runtime/src/cuda_driver.h) with host semantics: "device" memory is host
// memory from malloc, copies and memsets happen at once, the device is an
// sm_90 with 132 SMs. Kernels are NOT executed: cuLaunchKernel records the
// kernel name, launch shape, stream and the first argument words. Every
// call is appended to a log that zopt-gpu-host-check reads through the
// fake_cuda_* functions below, to check the runtime's host side of a GPU step
// (tables, launch order, no host synchronisation or allocation inside
// step(), device-resident step state) on a machine without a GPU.
//
// Selected with ZOPT_CUDA_DRIVER=<path to this library>.
//
// Streams: every call acts at once unless another stand-in library (the
// stand-in NCCL, runtime/test/fake_nccl) queues work on a stream with
// fake_cuda_stream_enqueue. While a stream has queued work, a worker thread
// runs it in order, and the async copies and memsets on that stream join
// the queue (host-to-device copies read their source at the call, like
// pageable copies; device-to-host copies into pageable memory wait for the
// stream first, into cuMemHostAlloc memory they are queued);
// cuStreamSynchronize waits for the queue and cuStreamQuery reports
// CUDA_ERROR_NOT_READY (600) while it is not empty.
//===----------------------------------------------------------------------===//
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

typedef int CUresult;
typedef unsigned long long CUdeviceptr;

namespace {

constexpr CUresult kOk = 0, kInvalidValue = 1, kOutOfMemory = 2,
                   kLaunchFailed = 719;

struct Launch {
  std::string name;
  unsigned grid[3], block[3];
  void *stream;
  unsigned long long arg[12];
  int nargs;
};

struct State {
  std::vector<std::string> calls;
  std::vector<Launch> launches;
  std::map<uintptr_t, size_t> allocs;  // base -> bytes
  std::vector<std::string> functions;  // CUfunction = index + 1
  int fail_next_launch = 0;
  int update_nargs = 5;  // 7 for steps with stochastic rounding
  uint32_t image_magic = 0;
  int context_current = 0;
};

State &st() {
  static State s;
  return s;
}

// ---- stream queues (see the header) ------------------------------------------
struct StreamQueue {
  std::mutex mu;
  std::condition_variable cv;
  std::deque<std::function<void()>> work;  // the front item runs until it is popped
  bool worker = false;
};

std::mutex g_streams_mu;
std::map<void *, StreamQueue *> *g_streams = new std::map<void *, StreamQueue *>;  // never freed
std::mutex g_pinned_mu;
std::map<uintptr_t, size_t> g_pinned;  // cuMemHostAlloc'ed ranges

StreamQueue *queue_of(void *stream, bool create) {
  std::lock_guard<std::mutex> lk(g_streams_mu);
  auto it = g_streams->find(stream);
  if (it != g_streams->end()) return it->second;
  if (!create) return nullptr;
  StreamQueue *q = new StreamQueue;
  (*g_streams)[stream] = q;
  return q;
}

void run_queue(StreamQueue *q) {
  std::unique_lock<std::mutex> lk(q->mu);
  for (;;) {
    q->cv.wait(lk, [&] { return !q->work.empty(); });
    std::function<void()> fn = q->work.front();
    lk.unlock();
    fn();
    lk.lock();
    q->work.pop_front();
    q->cv.notify_all();
  }
}

// Appends fn to the stream's queue (starting its worker).
void enqueue(void *stream, std::function<void()> fn) {
  StreamQueue *q = queue_of(stream, true);
  std::lock_guard<std::mutex> lk(q->mu);
  q->work.push_back(std::move(fn));
  if (!q->worker) {
    q->worker = true;
    std::thread(run_queue, q).detach();
  }
  q->cv.notify_all();
}

bool busy(void *stream) {
  StreamQueue *q = queue_of(stream, false);
  if (!q) return false;
  std::lock_guard<std::mutex> lk(q->mu);
  return !q->work.empty();
}

void drain(void *stream) {
  StreamQueue *q = queue_of(stream, false);
  if (!q) return;
  std::unique_lock<std::mutex> lk(q->mu);
  q->cv.wait(lk, [&] { return q->work.empty(); });
}

bool pinned(const void *p, size_t n) {
  std::lock_guard<std::mutex> lk(g_pinned_mu);
  auto it = g_pinned.upper_bound((uintptr_t)p);
  if (it == g_pinned.begin()) return false;
  --it;
  return (uintptr_t)p + n <= it->first + it->second;
}

void log(const char *api) { st().calls.push_back(api); }

// Arguments of each kernel (abi.h "GPU kernels"): all 8-byte words.
int nargs_of(const std::string &name) {
  auto ends = [&](const char *suf) {
    size_t n = strlen(suf);
    return name.size() >= n && name.compare(name.size() - n, n, suf) == 0;
  };
  if (ends("_prepare_gpu")) return 4;
  if (ends("_sumsq")) return 9;
  if (ends("_update")) return st().update_nargs;
  if (ends("_finish")) return 4;
  return 0;
}

}  // namespace

#define API extern "C" __attribute__((visibility("default")))

API CUresult cuInit(unsigned) { log("cuInit"); return kOk; }
API CUresult cuDeviceGetCount(int *n) { log("cuDeviceGetCount"); *n = 1; return kOk; }
API CUresult cuDeviceGet(int *d, int i) { log("cuDeviceGet"); *d = i; return i == 0 ? kOk : kInvalidValue; }
API CUresult cuDeviceGetAttribute(int *v, int attr, int) {
  log("cuDeviceGetAttribute");
  *v = attr == 75 ? 9 : attr == 76 ? 0 : attr == 16 ? 132 : 0;
  return kOk;
}
API CUresult cuDevicePrimaryCtxRetain(void **ctx, int) {
  log("cuDevicePrimaryCtxRetain");
  *ctx = (void *)0x1000;
  return kOk;
}
API CUresult cuDevicePrimaryCtxRelease_v2(int) { log("cuDevicePrimaryCtxRelease"); return kOk; }
API CUresult cuCtxGetCurrent(void **ctx) {
  log("cuCtxGetCurrent");
  *ctx = st().context_current ? (void *)0x1000 : nullptr;
  return kOk;
}
API CUresult cuCtxSetCurrent(void *ctx) {
  log("cuCtxSetCurrent");
  st().context_current = ctx != nullptr;
  return kOk;
}
API CUresult cuCtxGetDevice(int *d) { log("cuCtxGetDevice"); *d = 0; return kOk; }
API CUresult cuModuleLoadData(void **mod, const void *image) {
  log("cuModuleLoadData");
  memcpy(&st().image_magic, image, 4);
  if (st().image_magic != 0xBA55ED50u) return 200;  // CUDA_ERROR_INVALID_IMAGE
  *mod = (void *)0x2000;
  return kOk;
}
API CUresult cuModuleUnload(void *) { log("cuModuleUnload"); return kOk; }
API CUresult cuModuleGetFunction(void **fn, void *, const char *name) {
  log("cuModuleGetFunction");
  st().functions.push_back(name);
  *fn = (void *)(uintptr_t)st().functions.size();
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
  Launch l{};
  l.name = st().functions[i - 1];
  l.grid[0] = gx, l.grid[1] = gy, l.grid[2] = gz;
  l.block[0] = bx, l.block[1] = by, l.block[2] = bz;
  l.stream = stream;
  l.nargs = nargs_of(l.name);
  for (int a = 0; a < l.nargs; ++a) memcpy(&l.arg[a], args[a], 8);
  st().launches.push_back(l);
  return kOk;
}
API CUresult cuMemAlloc_v2(CUdeviceptr *p, size_t bytes) {
  log("cuMemAlloc");
  void *m = aligned_alloc(256, (bytes + 255) / 256 * 256);
  if (!m) return kOutOfMemory;
  memset(m, 0xA5, bytes);  // garbage, as real device memory may hold
  st().allocs[(uintptr_t)m] = bytes;
  *p = (CUdeviceptr)(uintptr_t)m;
  return kOk;
}
API CUresult cuMemFree_v2(CUdeviceptr p) {
  log("cuMemFree");
  auto it = st().allocs.find((uintptr_t)p);
  if (it == st().allocs.end()) return kInvalidValue;
  free((void *)(uintptr_t)p);
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
API CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void *src, size_t n, void *stream) {
  log("cuMemcpyHtoDAsync");
  if (busy(stream)) {  // the source is read now, the device written in stream order
    std::shared_ptr<std::vector<char>> copy(new std::vector<char>((const char *)src, (const char *)src + n));
    enqueue(stream, [dst, copy] { memcpy((void *)(uintptr_t)dst, copy->data(), copy->size()); });
    return kOk;
  }
  memcpy((void *)(uintptr_t)dst, src, n);
  return kOk;
}
API CUresult cuMemcpyDtoHAsync_v2(void *dst, CUdeviceptr src, size_t n, void *stream) {
  log("cuMemcpyDtoHAsync");
  if (busy(stream)) {
    if (pinned(dst, n)) {
      enqueue(stream, [dst, src, n] { memcpy(dst, (const void *)(uintptr_t)src, n); });
      return kOk;
    }
    drain(stream);  // pageable memory: the copy is synchronous
  }
  memcpy(dst, (const void *)(uintptr_t)src, n);
  return kOk;
}
API CUresult cuMemsetD8Async(CUdeviceptr dst, unsigned char v, size_t n, void *stream) {
  log("cuMemsetD8Async");
  if (busy(stream)) {
    enqueue(stream, [dst, v, n] { memset((void *)(uintptr_t)dst, v, n); });
    return kOk;
  }
  memset((void *)(uintptr_t)dst, v, n);
  return kOk;
}
API CUresult cuStreamSynchronize(void *stream) {
  log("cuStreamSynchronize");
  drain(stream);
  return kOk;
}
// Not logged: callers poll it.
API CUresult cuStreamQuery(void *stream) { return busy(stream) ? 600 /* CUDA_ERROR_NOT_READY */ : kOk; }
API CUresult cuGetErrorString(CUresult r, const char **s) {
  *s = r == kLaunchFailed ? "CUDA_ERROR_LAUNCH_FAILED (fake)" : "fake CUDA error";
  return kOk;
}
API CUresult cuPointerGetAttribute(void *out, int attr, CUdeviceptr p) {
  log("cuPointerGetAttribute");
  if (attr != 2) return kInvalidValue;
  unsigned type = 1;  // host
  auto it = st().allocs.upper_bound((uintptr_t)p);
  if (it != st().allocs.begin()) {
    --it;
    if ((uintptr_t)p < it->first + it->second) type = 2;  // device
  }
  memcpy(out, &type, sizeof type);
  return kOk;
}

// ---- for zopt-gpu-host-check ------------------------------------------------
API int fake_cuda_num_calls(void) { return (int)st().calls.size(); }
API const char *fake_cuda_call(int i) { return st().calls[(size_t)i].c_str(); }
API int fake_cuda_num_launches(void) { return (int)st().launches.size(); }
API const char *fake_cuda_launch(int i, unsigned grid[3], unsigned block[3], void **stream,
                                 unsigned long long args[12]) {
  const Launch &l = st().launches[(size_t)i];
  memcpy(grid, l.grid, sizeof l.grid);
  memcpy(block, l.block, sizeof l.block);
  *stream = l.stream;
  memcpy(args, l.arg, sizeof l.arg);
  return l.name.c_str();
}
API int fake_cuda_num_allocs(void) { return (int)st().allocs.size(); }
API void fake_cuda_fail_next_launch(void) { st().fail_next_launch = 1; }
API void fake_cuda_set_update_nargs(int n) { st().update_nargs = n; }
API unsigned fake_cuda_image_magic(void) { return st().image_magic; }
// For other stand-in libraries (the stand-in NCCL): runs fn(arg) on the
// stream's worker thread after the stream's earlier queued work.
API int fake_cuda_stream_enqueue(void *stream, void (*fn)(void *), void *arg) {
  enqueue(stream, [fn, arg] { fn(arg); });
  return 0;
}
