//===- fake-cuda.cpp - a CUDA driver stand-in that records what it is asked --===//
//
// libzopt-fake-cuda.so exports the driver entry points the runtime resolves
// (runtime/src/backend/cuda/cuda_driver.h) with host semantics: "device" memory is host
// memory from malloc, the devices are sm_90s with 132 SMs (one by default,
// fake_cuda_set_device_count for more), the driver reports CUDA 13.0
// (fake_cuda_set_driver_version). Kernels are NOT executed: cuLaunchKernel
// records the kernel name, launch shape, stream, context and arguments.
// Every call is appended to a log that zopt-gpu-host-check reads through the
// fake_cuda_* functions (fake-cuda-control.cpp), to check the runtime's host
// side of a GPU step on a machine without a GPU. This file holds the
// stand-in's state and helpers; fake-cuda.h lists the other files.
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
//     fail for that attribute; fake_cuda_fail_memset(n) the n-th next
//     cuMemsetD32Async.
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
// Asynchrony: by default a copy on an idle stream runs at the call. With
// ZOPT_FAKE_CUDA_ASYNC=1 every copy between cuMemHostAlloc memory and the
// device (cuMemcpyHtoDAsync, cuMemcpyDtoHAsync) is queued on its stream's
// worker thread, as a real DMA: the call returns before the bytes move, and
// only the stream's order, its events and synchronisations make them
// visible. ZOPT_FAKE_CUDA_STRESS=<us> does the same and sleeps a random
// 0..us microseconds before each queued copy (seeded by
// ZOPT_FAKE_CUDA_SEED, default 1), so that a caller that reads or reuses a
// buffer before the stream says the copy is done sees wrong bytes.
//
// Every host-to-device copy is logged (fake_cuda_num_htod / fake_cuda_htod:
// destination, bytes, stream, in call order), and fake_cuda_hold_htod(lo,
// hi) queues the copies into [lo, hi) issued after it and holds each at its
// turn (with its stream's later work) until fake_cuda_release_htod: a copy
// as slow as a test needs, to show what waits for it and what does not.
// fake_cuda_stall_htod(lo, hi) instead blocks the caller of such a copy in
// the call until the release (a thread slow to issue it: the offload
// tail's job), and fake_cuda_fail_htod(lo, hi) makes the next one fail
// (700, an illegal address), once.
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
#include "fake-cuda.h"

#include <sys/mman.h>

namespace fake {

std::recursive_mutex g_mu;
std::atomic<int> g_delayed_done{0};
State &st() {
  static State s;
  return s;
}
Hold &hold() {
  static Hold h;
  return h;
}

// ---- stream queues (see the header) ------------------------------------------


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
std::map<uintptr_t, size_t>::iterator find_alloc(uintptr_t p, size_t n) {
  auto &a = st().allocs;
  auto it = a.upper_bound(p);
  if (it == a.begin()) return a.end();
  --it;
  return p + n <= it->first + it->second ? it : a.end();
}

// ---- asynchrony (see the top) ----------------------------------------------------
namespace {
unsigned env_unsigned(const char *name, unsigned dflt) {
  const char *v = getenv(name);
  return v && *v ? (unsigned)strtoul(v, nullptr, 10) : dflt;
}
const unsigned g_stress_us = env_unsigned("ZOPT_FAKE_CUDA_STRESS", 0);
const bool g_async = g_stress_us > 0 || env_unsigned("ZOPT_FAKE_CUDA_ASYNC", 0) != 0;
std::mutex g_rng_mu;
uint64_t g_rng = env_unsigned("ZOPT_FAKE_CUDA_SEED", 1) * 0x9E3779B97F4A7C15ull + 1;
}  // namespace

bool async_copies() { return g_async; }
unsigned stress_delay_us() {
  if (!g_stress_us) return 0;
  std::lock_guard<std::mutex> lk(g_rng_mu);
  g_rng = g_rng * 6364136223846793005ull + 1442695040888963407ull;
  return (unsigned)((g_rng >> 33) % (g_stress_us + 1));
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

}  // namespace fake
