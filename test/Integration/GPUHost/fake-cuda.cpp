//===- fake-cuda.cpp - a CUDA driver stand-in that records what it is asked --===//
//
// libzopt-fake-cuda.so exports the driver entry points the runtime resolves
// (runtime/src/backend/cuda/cuda_driver.h) with host semantics: "device" memory is host
// memory from malloc, the devices are sm_90s with 132 SMs (one by default,
// fake_cuda_set_device_count for more), the driver reports CUDA 13.0
// (fake_cuda_set_driver_version). Kernels are NOT executed: cuLaunchKernel
// records the kernel name, launch shape, stream, context and arguments.
// Every call is appended to a log that zopt-gpu-host-check reads through the
// fake_cuda_* functions below, to check the runtime's host side of a GPU
// step on a machine without a GPU.
//
// Selected with ZOPT_CUDA_DRIVER=<path to this library>.
//
// What a real driver checks and this one checks too:
//   - memory ranges: the device side of every copy and memset must lie
//     inside one allocation; one that does not is refused (INVALID_VALUE)
//     and counted (fake_cuda_num_bad_ranges), instead of a memcpy past a
//     malloc'ed block. fake_cuda_in_alloc lets the test check the extents
//     of the pointers the runtime hands to kernels.
//   - images: cuModuleLoadData takes a fatbinary whose PTX is stored
//     uncompressed (zopt-compile writes it so; the stand-in reads the PTX to
//     learn every kernel's .param list and .reqntid). cuFuncGetParamInfo
//     answers from those lists; cuLaunchKernel copies exactly the declared
//     parameter bytes and refuses a block shape other than .reqntid.
//   - contexts: a context stack (cuCtxPush/Pop/Set/GetCurrent); each device
//     has a primary context; memory belongs to the device of the context
//     current at cuMemAlloc (CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL); launches
//     record the current context.
//   - attributes: fake_cuda_fail_attribute(attr) makes cuDeviceGetAttribute
//     fail for that attribute.
//   - graph capture (cuStreamBeginCapture ... cuStreamEndCapture): on a
//     capturing stream, launches, memsets, copies between pinned host memory
//     and the device, external event records (CU_EVENT_RECORD_EXTERNAL) and
//     external event waits (CU_EVENT_WAIT_EXTERNAL) become nodes of the
//     graph; a synchronisation, a copy with pageable host memory, or a wait
//     for an event recorded outside the capture without the external flag
//     fails and invalidates the capture (as the driver's rules say), and so
//     does any work on the legacy stream (0) while a stream captures.
//     cuGraphLaunch re-issues the nodes on the launch stream, asynchronously
//     (through its stream queue): an external record node records its event
//     when it runs, a wait node waits for the event's record as of the
//     launch.
//
// Streams: every call acts at once unless work is queued on the stream:
// another stand-in library (the stand-in NCCL) queues work with
// fake_cuda_stream_enqueue, graph replays and (with emulation) kernel
// launches queue their nodes. While a stream has queued work, a worker
// thread runs it in order, and the async copies, memsets, event records and
// waits on that stream join the queue (host-to-device copies read their
// source at the call when it is pageable, at their turn when it is pinned;
// device-to-host copies into pageable memory wait for the stream first, into
// cuMemHostAlloc memory they are queued); cuStreamSynchronize waits for the
// queue and cuStreamQuery reports CUDA_ERROR_NOT_READY (600) while it is not
// empty. Events count records and completions.
//
// With ZOPT_FAKE_CUDA_TWIN=<the step compiled for the CPU> the emulation is
// on from the start and runs each kernel whole on the twin's CPU kernels
// (fake-cuda-twin.cpp): the numbers of a GPU step, on the stand-in.
//
// Emulation (fake_cuda_set_emulation(delay_us), off by default): every kernel
// launch is queued on its stream and runs after `delay_us` microseconds, and
// at that time the stand-in does the little of the kernels' work that the
// host side can observe: PREPARE snapshots the hyperparameter table it reads
// (fake_cuda_num_prepares / fake_cuda_prepare_hypers), FINISH advances the
// step of every active tensor and group unless the step globals say skip
// (as the real FINISH).
//
// Huge allocations (over 1 GiB) are reserved, not committed (mmap
// MAP_NORESERVE, zero-filled), and memsets of zero on them are skipped, so
// that a test can register tensors of more than 2^32 elements.
//===----------------------------------------------------------------------===//
#include <sys/mman.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <set>
#include <vector>

typedef int CUresult;
typedef unsigned long long CUdeviceptr;

// fake-cuda-twin.cpp: with ZOPT_FAKE_CUDA_TWIN, a GPU step's kernels run on
// the CPU twin's kernels.
bool fake_twin_enabled();
bool fake_twin_run(const char *name, const unsigned long long *args, int nargs);

namespace {

constexpr CUresult kOk = 0, kInvalidValue = 1, kOutOfMemory = 2, kInvalidImage = 200, kInvalidContext = 201,
                   kInvalidHandle = 400, kNotReady = 600, kLaunchFailed = 719, kCaptureUnsupported = 900,
                   kCaptureInvalidated = 901, kCaptureIsolation = 904, kCaptureImplicit = 906;
constexpr unsigned kEventRecordExternal = 1, kEventWaitExternal = 1;
constexpr size_t kHuge = (size_t)1 << 30;

struct Param {
  size_t offset, size;
};
struct Kernel {
  std::string name;
  std::vector<Param> params;
  unsigned reqntid[3] = {0, 0, 0};
};

struct Launch {
  std::string name;
  unsigned grid[3], block[3];
  void *stream;
  void *ctx;
  unsigned long long arg[16];
  int nargs;
  int replay;  // 0: launched directly; else the replay number (1-based)
};

struct Event {
  std::mutex mu;
  std::condition_variable cv;
  uint64_t recorded = 0, completed = 0;
  bool in_capture = false;  // last recorded inside a capture without the external flag
};

// A node of a captured graph.
struct Node {
  enum Kind { kLaunch, kCopyHtoD, kCopyDtoH, kMemset8, kMemset32, kRecord, kWait } kind;
  Launch launch;
  int fn = 0;
  std::vector<unsigned char> argbytes;  // the launch's parameters, packed
  CUdeviceptr dptr = 0;
  void *hptr = nullptr;
  size_t n = 0;
  unsigned value = 0;
  Event *ev = nullptr;
};
struct Graph {
  std::vector<Node> nodes;
  bool invalid = false;
};

struct State {
  std::vector<std::string> calls;
  std::vector<Launch> launches;
  std::map<uintptr_t, size_t> allocs;  // base -> bytes
  std::map<uintptr_t, int> alloc_device;
  std::map<uintptr_t, bool> lazy;  // huge allocation, still all zero
  std::vector<std::string> functions;  // CUfunction = index + 1
  std::vector<Kernel> kernels;         // of the last image loaded
  std::vector<int> function_kernel;    // CUfunction index -> kernels index (-1: unknown)
  int fail_next_launch = 0;
  uint32_t image_magic = 0;
  bool image_ptx = false;  // the last image had readable PTX
  int device_count = 1;
  int driver_version = 13000;
  int fail_attribute = -1;
  int blocks_per_sm = 2;
  std::map<void *, Graph *> capturing;  // stream -> graph under capture
  int replays = 0;
  unsigned delay_us = 0;
  bool emulate = fake_twin_enabled();  // a twin runs every kernel (fake-cuda-twin.cpp)
  std::vector<std::vector<double>> prepare_hypers;  // emulation: per executed PREPARE
  std::string patch_suffix;  // fake_cuda_patch_params
  int patch_delta = 0;
  unsigned htod_delay_us = 0;  // fake_cuda_set_htod_delay
  std::vector<std::string> bad_ranges;  // copies/memsets refused: device range outside every allocation
};

std::recursive_mutex g_mu;  // guards st() against the stream workers
std::atomic<int> g_delayed_done{0};  // delayed copies (fake_cuda_set_htod_delay) finished
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

void log(const char *api) {
  std::lock_guard<std::recursive_mutex> lk(g_mu);
  st().calls.push_back(api);
}

// Each thread has its own context stack, as in the real driver: a rank
// thread of --world that pushed its optimizer's context must not see (or
// pop) another thread's. One stack for all threads made those ranks fail
// with CUDA_ERROR_INVALID_CONTEXT when another rank popped in between.
std::vector<void *> &ctx_stack() {
  thread_local std::vector<void *> s;
  return s;
}
void *current_ctx() { return ctx_stack().empty() ? nullptr : ctx_stack().back(); }
int ctx_device(void *ctx) { return ctx ? (int)((uintptr_t)ctx - 0x1000) : 0; }

// The allocation holding [p, p + n), or allocs.end().
std::map<uintptr_t, size_t>::iterator find_alloc(uintptr_t p, size_t n = 1) {
  auto &a = st().allocs;
  auto it = a.upper_bound(p);
  if (it == a.begin()) return a.end();
  --it;
  return p + n <= it->first + it->second ? it : a.end();
}

// ---- events --------------------------------------------------------------------
void complete(Event *e, uint64_t seq) {
  std::lock_guard<std::mutex> lk(e->mu);
  if (seq > e->completed) e->completed = seq;
  e->cv.notify_all();
}
void wait_for(Event *e, uint64_t seq) {
  std::unique_lock<std::mutex> lk(e->mu);
  e->cv.wait(lk, [&] { return e->completed >= seq; });
}
uint64_t record_seq(Event *e) {
  std::lock_guard<std::mutex> lk(e->mu);
  e->in_capture = false;
  return ++e->recorded;
}
// Records e on `stream` now (or in stream order when work is queued).
void record_on(Event *e, void *stream) {
  uint64_t seq = record_seq(e);
  if (busy(stream)) enqueue(stream, [e, seq] { complete(e, seq); });
  else complete(e, seq);
}
// Makes `stream` wait for e's record as of now.
void wait_on(Event *e, void *stream) {
  uint64_t seq;
  {
    std::lock_guard<std::mutex> lk(e->mu);
    seq = e->recorded;
    if (e->completed >= seq) return;
  }
  enqueue(stream, [e, seq] { wait_for(e, seq); });
}

// ---- capture ---------------------------------------------------------------------
Graph *capture_of(void *stream) {
  std::lock_guard<std::recursive_mutex> lk(g_mu);
  auto it = st().capturing.find(stream);
  return it == st().capturing.end() ? nullptr : it->second;
}
// Work on the legacy stream while a stream captures (global mode):
// forbidden, and it invalidates the captures.
bool legacy_conflict(void *stream) {
  std::lock_guard<std::recursive_mutex> lk(g_mu);
  if (stream || st().capturing.empty()) return false;
  for (auto &c : st().capturing) c.second->invalid = true;
  return true;
}
// The result of a call that a capture does not allow: the capture is invalid.
CUresult refuse_in_capture(Graph *g) {
  g->invalid = true;
  return kCaptureUnsupported;
}

// ---- PTX ---------------------------------------------------------------------------
size_t ptx_type_size(const std::string &t) {
  if (t == ".u64" || t == ".s64" || t == ".b64" || t == ".f64") return 8;
  if (t == ".u32" || t == ".s32" || t == ".b32" || t == ".f32") return 4;
  if (t == ".u16" || t == ".s16" || t == ".b16" || t == ".f16") return 2;
  if (t == ".u8" || t == ".s8" || t == ".b8") return 1;
  return 0;
}

// Every .entry of a PTX text: name, .param sizes/offsets, .reqntid.
std::vector<Kernel> parse_ptx(const char *ptx, size_t len) {
  std::vector<Kernel> out;
  std::string s(ptx, strnlen(ptx, len));
  size_t at = 0;
  while ((at = s.find(".entry ", at)) != std::string::npos) {
    at += 7;
    size_t open = s.find('(', at), close = s.find(')', at);
    if (open == std::string::npos || close == std::string::npos) break;
    Kernel k;
    k.name = s.substr(at, open - at);
    while (!k.name.empty() && isspace((unsigned char)k.name.back())) k.name.pop_back();
    std::string list = s.substr(open + 1, close - open - 1);
    size_t p = 0, offset = 0;
    while ((p = list.find(".param", p)) != std::string::npos) {
      size_t end = list.find(',', p);
      std::string decl = list.substr(p, end == std::string::npos ? std::string::npos : end - p);
      p += 6;
      size_t size = 0, align = 0;
      size_t tok = 0;
      std::vector<std::string> words;
      while (tok < decl.size()) {
        while (tok < decl.size() && isspace((unsigned char)decl[tok])) ++tok;
        size_t e = tok;
        while (e < decl.size() && !isspace((unsigned char)decl[e])) ++e;
        if (e > tok) words.push_back(decl.substr(tok, e - tok));
        tok = e;
      }
      bool ptr = false;  // ".ptr .align N" is the pointee's alignment
      for (size_t w = 1; w < words.size(); ++w) {
        if (words[w] == ".ptr") ptr = true;
        else if (words[w] == ".align" && w + 1 < words.size()) {
          if (!ptr) align = strtoul(words[w + 1].c_str(), nullptr, 10);
          ++w;
        } else if (size_t ts = ptx_type_size(words[w])) size = ts;
      }
      const std::string &name = words.back();
      size_t br = name.find('[');
      if (br != std::string::npos) size *= strtoul(name.c_str() + br + 1, nullptr, 10);  // .b8 x[N]
      if (!align) align = size;
      offset = (offset + align - 1) / align * align;
      k.params.push_back({offset, size});
      offset += size;
    }
    size_t body = s.find('{', close);
    size_t req = s.find(".reqntid", close);
    if (req != std::string::npos && req < body)
      sscanf(s.c_str() + req, ".reqntid %u, %u, %u", &k.reqntid[0], &k.reqntid[1], &k.reqntid[2]);
    out.push_back(k);
    at = close;
  }
  return out;
}

// The PTX of a fatbinary (uncompressed entries only), or "".
std::string fatbin_ptx(const unsigned char *image) {
  uint32_t magic;
  uint16_t hsize;
  uint64_t fsize;
  memcpy(&magic, image, 4);
  memcpy(&hsize, image + 6, 2);
  memcpy(&fsize, image + 8, 8);
  if (magic != 0xBA55ED50u) return "";
  const unsigned char *e = image + hsize, *end = image + hsize + fsize;
  while (e + 16 <= end) {
    uint16_t kind;
    uint32_t ehs;
    uint64_t psz;
    memcpy(&kind, e, 2);
    memcpy(&ehs, e + 4, 4);
    memcpy(&psz, e + 8, 8);
    const char *payload = (const char *)e + ehs;
    if (kind == 1 && psz > 8 && !memcmp(payload, "//", 2)) return std::string(payload, strnlen(payload, psz));
    if (kind == 1 && psz > 8 && strstr(std::string(payload, strnlen(payload, std::min<uint64_t>(psz, 4096))).c_str(), ".version"))
      return std::string(payload, strnlen(payload, psz));
    e += ehs + psz;
  }
  return "";
}

// ---- emulation of what the kernels do that the host can see ---------------------
bool ends_with(const std::string &s, const char *suf) {
  size_t n = strlen(suf);
  return s.size() >= n && s.compare(s.size() - n, n, suf) == 0;
}

void emulate(const Launch &l) {
  std::lock_guard<std::recursive_mutex> lk(g_mu);
  if (ends_with(l.name, "_prepare_gpu")) {
    const double *hy = (const double *)(uintptr_t)l.arg[0];
    auto it = find_alloc((uintptr_t)hy);
    size_t n = it == st().allocs.end() ? 0 : (it->first + it->second - (uintptr_t)hy) / 8;
    st().prepare_hypers.emplace_back(hy, hy + n);
  }
  if (fake_twin_run(l.name.c_str(), l.arg, l.nargs)) return;  // the whole kernel, on the twin
  if (ends_with(l.name, "_finish")) {
    // finish(globals, num_groups, sg, sc, tensor_t, active, num_segments)
    double *gl = (double *)(uintptr_t)l.arg[0];
    int64_t ng = (int64_t)l.arg[1];
    uint32_t *sg = (uint32_t *)(uintptr_t)l.arg[2];
    double *tt = (double *)(uintptr_t)l.arg[4];
    const uint8_t *active = (const uint8_t *)(uintptr_t)l.arg[5];
    int64_t nrows = (int64_t)l.arg[6];
    if (sg && sg[7]) return;  // zopt_gpu_step_globals.skip
    for (int64_t g = 0; g < ng; ++g)
      if (active[nrows + g]) gl[g * 3] += 1;  // groups with an updated tensor
    for (int64_t r = 0; r < nrows; ++r)
      if (active[r]) tt[r] += 1;  // the updated tensors
    if (sg) ++sg[9];  // steps_applied
  }
}

// A kernel reads its inputs when it starts and its results land when it
// ends: PREPARE's snapshot of the table is taken before the delay, FINISH's
// step counts advance after it.
void run_launch(const Launch &l) {
  const bool reads = ends_with(l.name, "_prepare_gpu");
  if (reads) emulate(l);
  if (st().delay_us) std::this_thread::sleep_for(std::chrono::microseconds(st().delay_us));
  if (!reads) emulate(l);
}

// The device side of a copy or memset must lie inside one allocation, as
// on a real device (where a range past the end faults or is refused):
// [p, p + n) outside every allocation is refused with CUDA_ERROR_INVALID_VALUE
// and remembered (fake_cuda_num_bad_ranges), so that a buffer sized or
// offset for another dtype (a grad of 4-byte elements copied at the param's
// 2) fails here instead of reading or writing past a malloc'ed block.
bool bad_range(const char *api, CUdeviceptr p, size_t n) {
  if (!n) return false;
  std::lock_guard<std::recursive_mutex> lk(g_mu);
  if (find_alloc((uintptr_t)p, n) != st().allocs.end()) return false;
  char buf[160];
  snprintf(buf, sizeof buf, "%s(%#llx, %zu bytes)", api, (unsigned long long)p, n);
  st().bad_ranges.push_back(buf);
  return true;
}

// Memset of zero on a lazily committed huge allocation: nothing to do.
bool lazy_zero(CUdeviceptr dst, unsigned v) {
  if (v) return false;
  std::lock_guard<std::recursive_mutex> lk(g_mu);
  auto it = find_alloc((uintptr_t)dst);
  return it != st().allocs.end() && st().lazy.count(it->first) && st().lazy[it->first];
}

}  // namespace

#define API extern "C" __attribute__((visibility("default")))

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
  touch(dst);
  if (st().htod_delay_us && pinned(src, n)) {  // a DMA that takes a while
    unsigned us = st().htod_delay_us;
    enqueue(stream, [dst, src, n, us] {
      std::this_thread::sleep_for(std::chrono::microseconds(us));
      memcpy((void *)(uintptr_t)dst, src, n);
      ++g_delayed_done;
    });
    return kOk;
  }
  if (busy(stream)) {  // the source is read now (pageable) or at its turn (pinned)
    if (pinned(src, n)) {
      enqueue(stream, [dst, src, n] { memcpy((void *)(uintptr_t)dst, src, n); });
      return kOk;
    }
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
  return kInvalidValue;
}

// ---- for zopt-gpu-host-check ------------------------------------------------
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
