//===- fake-cuda.h - the stand-in CUDA driver's internals ------*- C++ -*-===//
//
// What the files of libzopt-fake-cuda.so share (fake-cuda.cpp says what the
// stand-in is): its state (calls, launches, allocations, kernels of the
// last image, captures), the stream queues and events, the PTX it reads,
// and the emulation of what kernels do that the host can see. The files:
//   fake-cuda.cpp          the state and the helpers below
//   fake-cuda-driver.cpp   the driver API entry points (cu*)
//   fake-cuda-control.cpp  fake_cuda_*: what zopt-gpu-host-check asks and sets
//   fake-cuda-twin.cpp     a GPU step's kernels run on its CPU twin
// Nothing here is exported (hidden visibility but the API entry points).
//===----------------------------------------------------------------------===//
#ifndef ZOPT_TEST_FAKE_CUDA_H
#define ZOPT_TEST_FAKE_CUDA_H

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

#define API extern "C" __attribute__((visibility("default")))

namespace fake {

inline constexpr CUresult kOk = 0, kInvalidValue = 1, kOutOfMemory = 2, kInvalidImage = 200, kInvalidContext = 201,
                   kInvalidHandle = 400, kNotReady = 600, kLaunchFailed = 719, kCaptureUnsupported = 900,
                   kCaptureInvalidated = 901, kCaptureIsolation = 904, kCaptureImplicit = 906;
inline constexpr unsigned kEventRecordExternal = 1, kEventWaitExternal = 1;
inline constexpr size_t kHuge = (size_t)1 << 30;

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
  int fail_memset_in = 0;  // fake_cuda_fail_memset: the n-th next cuMemsetD32Async fails (0: none)
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
  // Host-to-device copies issued (outside captures), in call order.
  struct HtoD {
    CUdeviceptr dst;
    size_t n;
    void *stream;
  };
  std::vector<HtoD> htod_log;
};

// fake_cuda_hold_htod: host-to-device copies into [lo, hi) are queued and
// wait at their turn until fake_cuda_release_htod (a copy that takes as
// long as the test wants).
// fake_cuda_stall_htod: a host-to-device copy into [stall_lo, stall_hi)
// blocks its caller at the call until fake_cuda_release_htod (a caller
// slow to issue it). fake_cuda_fail_htod: the next such copy into
// [fail_lo, fail_hi) fails (CUDA_ERROR_ILLEGAL_ADDRESS), once.
struct Hold {
  std::mutex mu;
  std::condition_variable cv;
  CUdeviceptr lo = 0, hi = 0;  // empty: none held
  CUdeviceptr stall_lo = 0, stall_hi = 0, fail_lo = 0, fail_hi = 0;
  uint64_t gen = 0;            // releases so far
};
Hold &hold();

extern std::recursive_mutex g_mu;      // guards st() against the stream workers
extern std::atomic<int> g_delayed_done;  // delayed copies (fake_cuda_set_htod_delay) finished
State &st();

// ---- stream queues, events, captures, PTX, emulation (fake-cuda.cpp) ----------
struct StreamQueue {
  std::mutex mu;
  std::condition_variable cv;
  std::deque<std::function<void()>> work;  // the front item runs until it is popped
  bool worker = false;
};
extern std::mutex g_streams_mu;
extern std::map<void *, StreamQueue *> *g_streams;
extern std::mutex g_pinned_mu;
extern std::map<uintptr_t, size_t> g_pinned;  // cuMemHostAlloc'ed ranges

StreamQueue *queue_of(void *stream, bool create);
void run_queue(StreamQueue *q);
void enqueue(void *stream, std::function<void()> fn);
bool busy(void *stream);
void drain(void *stream);
bool pinned(const void *p, size_t n);
void log(const char *api);
std::vector<void *> &ctx_stack();
void *current_ctx();
int ctx_device(void *ctx);
std::map<uintptr_t, size_t>::iterator find_alloc(uintptr_t p, size_t n = 1);
void complete(Event *e, uint64_t seq);
void wait_for(Event *e, uint64_t seq);
uint64_t record_seq(Event *e);
void record_on(Event *e, void *stream);
void wait_on(Event *e, void *stream);
Graph *capture_of(void *stream);
bool legacy_conflict(void *stream);
CUresult refuse_in_capture(Graph *g);
size_t ptx_type_size(const std::string &t);
std::vector<Kernel> parse_ptx(const char *ptx, size_t len);
std::string fatbin_ptx(const unsigned char *image);
bool ends_with(const std::string &s, const char *suf);
void emulate(const Launch &l);
void run_launch(const Launch &l);
bool bad_range(const char *api, CUdeviceptr p, size_t n);
// Asynchronous copies (fake-cuda.cpp "Asynchrony"): whether copies between
// pinned host memory and the device always run on the stream's worker
// (ZOPT_FAKE_CUDA_ASYNC=1, or ZOPT_FAKE_CUDA_STRESS), and the delay
// before one such copy: random in [0, ZOPT_FAKE_CUDA_STRESS] microseconds
// (0 without stress).
bool async_copies();
unsigned stress_delay_us();
bool lazy_zero(CUdeviceptr dst, unsigned v);

}  // namespace fake

#endif
