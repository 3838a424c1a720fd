// common.cpp - errors, dtype conversions, hashing, thread pool.
#include "internal.h"
#include "backend/backend.h"

#include <algorithm>
#include <cmath>
#include <cstdarg>
#include <cstdio>

namespace zopt {

static thread_local char g_err[1024];

zopt_status fail(zopt_status st, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(g_err, sizeof g_err, fmt, ap);
  va_end(ap);
  if (!g_err[0]) snprintf(g_err, sizeof g_err, "zopt error %d", (int)st);
  return st;
}

void clear_error() { g_err[0] = 0; }

bool has_q8(const zopt_step_descriptor *d) {
  for (uint32_t s = 0; s < d->num_states; ++s)
    if (d->states[s].dtype == ZOPT_DTYPE_Q8 || (d->states[s].flags & ZOPT_STATE_PER_BLOCK)) return true;
  return false;
}

uint8_t zero_byte(const zopt_step_descriptor *d, int si) {
  const zopt_state_desc &s = d->states[si];
  if (s.dtype != ZOPT_DTYPE_Q8) return 0;
  return s.kind == ZOPT_STATE_EXP_AVG_SQ ? ZOPT_Q8_UNSIGNED_ZERO : ZOPT_Q8_SIGNED_ZERO;
}

void q8_encode_n(const float *x, int64_t n, int is_unsigned, uint8_t *codes, float *absmax) {
  for (int64_t b = 0; b * ZOPT_Q8_BLOCK < n; ++b) {
    const int64_t a = b * ZOPT_Q8_BLOCK, e = std::min<int64_t>(n, a + ZOPT_Q8_BLOCK);
    float m = 0.0f;
    for (int64_t i = a; i < e; ++i) {
      const float v = std::fabs(x[i]);
      m = (std::isnan(v) || std::isnan(m)) ? NAN : std::max(m, v);
    }
    absmax[b] = m;
    if (codes)
      for (int64_t i = a; i < e; ++i) codes[i] = zopt_q8_encode(x[i], m, is_unsigned);
  }
}

size_t dtype_size(uint32_t dt) {
  switch (dt) {
    case ZOPT_DTYPE_F32: return 4;
    case ZOPT_DTYPE_BF16: return 2;
    case ZOPT_DTYPE_F16: return 2;
    case ZOPT_DTYPE_I16: return 2;
    case ZOPT_DTYPE_Q8: return 1;
  }
  return 0;
}

const char *dtype_name(uint32_t dt) {
  switch (dt) {
    case ZOPT_DTYPE_F32: return "f32";
    case ZOPT_DTYPE_BF16: return "bf16";
    case ZOPT_DTYPE_F16: return "f16";
    case ZOPT_DTYPE_I16: return "i16";
    case ZOPT_DTYPE_Q8: return "q8";
  }
  return "?";
}

const char *state_kind_name(uint32_t k) {
  switch (k) {
    case ZOPT_STATE_PARAM: return "param";
    case ZOPT_STATE_GRAD: return "grad";
    case ZOPT_STATE_MASTER: return "master";
    case ZOPT_STATE_EXP_AVG: return "exp_avg";
    case ZOPT_STATE_EXP_AVG_SQ: return "exp_avg_sq";
    case ZOPT_STATE_MAX_EXP_AVG_SQ: return "max_exp_avg_sq";
    case ZOPT_STATE_MOMENTUM_BUFFER: return "momentum_buffer";
    case ZOPT_STATE_EXP_AVG_ABSMAX: return "exp_avg_absmax";
    case ZOPT_STATE_EXP_AVG_SQ_ABSMAX: return "exp_avg_sq_absmax";
    case ZOPT_STATE_KAHAN_COMP: return "kahan_comp";
  }
  return "?";
}

static const char *const kHyperNames[] = {
    nullptr, "lr", "beta1", "beta2", "eps", "weight_decay",
    "momentum", "dampening", "bias_correction"};

const char *hyper_name(uint32_t k) {
  return (k >= 1 && k <= 8) ? kHyperNames[k] : "?";
}

int hyper_kind_from_name(const char *name) {
  for (int k = 1; k <= 8; ++k)
    if (strcmp(name, kHyperNames[k]) == 0) return k;
  return 0;
}

static inline uint32_t fbits(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
}
static inline float bitsf(uint32_t u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}

float bf16_to_f32(uint16_t h) { return bitsf((uint32_t)h << 16); }

uint16_t f32_to_bf16(float f) {
  uint32_t u = fbits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}

float f16_to_f32(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
  int32_t e = (h >> 10) & 0x1f;
  uint32_t m = h & 0x3ffu;
  if (e == 0) {
    if (m == 0) return bitsf(sign);
    e = 1;
    while (!(m & 0x400u)) {
      m <<= 1;
      --e;
    }
    m &= 0x3ffu;
    return bitsf(sign | ((uint32_t)(e + 112) << 23) | (m << 13));
  }
  if (e == 31) return bitsf(sign | 0x7f800000u | (m << 13));
  return bitsf(sign | ((uint32_t)(e + 112) << 23) | (m << 13));
}

uint16_t f32_to_f16(float f) {
  uint32_t u = fbits(f);
  uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
  u &= 0x7fffffffu;
  if (u > 0x7f800000u) return sign | 0x7e00u | (uint16_t)((u >> 13) & 0x3ffu);
  if (u >= 0x47800000u) return sign | 0x7c00u;  // >= 65536 (incl. inf)
  if (u >= 0x38800000u) {                       // normal half
    uint32_t r = u - 0x38000000u;
    r = (r + 0xfffu + ((r >> 13) & 1u)) >> 13;  // carry may give inf: right
    return (uint16_t)(sign | r);
  }
  if (u <= 0x33000000u) return sign;  // <= 2^-25 rounds to (signed) zero
  uint32_t e = u >> 23;               // 102..112
  uint32_t m = (u & 0x7fffffu) | 0x800000u;
  uint32_t shift = 126 - e;  // 14..24
  uint32_t half = m >> shift;
  uint32_t rem = m & ((1u << shift) - 1u);
  uint32_t halfway = 1u << (shift - 1);
  if (rem > halfway || (rem == halfway && (half & 1u))) ++half;
  return (uint16_t)(sign | half);
}

static inline float load_f32(const void *p, uint32_t dt, int64_t i) {
  switch (dt) {
    case ZOPT_DTYPE_F32: return ((const float *)p)[i];
    case ZOPT_DTYPE_BF16: return bf16_to_f32(((const uint16_t *)p)[i]);
    default: return f16_to_f32(((const uint16_t *)p)[i]);
  }
}

static inline void store_f32(void *p, uint32_t dt, int64_t i, float v) {
  switch (dt) {
    case ZOPT_DTYPE_F32: ((float *)p)[i] = v; break;
    case ZOPT_DTYPE_BF16: ((uint16_t *)p)[i] = f32_to_bf16(v); break;
    default: ((uint16_t *)p)[i] = f32_to_f16(v); break;
  }
}

void convert(const void *src, uint32_t sdt, void *dst, uint32_t ddt,
             int64_t n) {
  if (sdt == ddt) {
    memmove(dst, src, (size_t)n * dtype_size(sdt));
    return;
  }
  if (ddt == ZOPT_DTYPE_I16) {  // a remainder master of the param: 0 (abi.h)
    memset(dst, 0, (size_t)n * 2);
    return;
  }
  for (int64_t i = 0; i < n; ++i) store_f32(dst, ddt, i, load_f32(src, sdt, i));
}

uint64_t fnv1a64(const void *data, size_t n, uint64_t h) {
  const unsigned char *p = (const unsigned char *)data;
  for (size_t i = 0; i < n; ++i) h = (h ^ p[i]) * 1099511628211ull;
  return h;
}

// ---- thread pool --------------------------------------------------------

ThreadPool::ThreadPool(int n) : n_(n < 1 ? 1 : n) {
  try {
    threads_.reserve(n_ - 1);
    for (int t = 1; t < n_; ++t) threads_.emplace_back(&ThreadPool::worker, this, t);
  } catch (...) {  // join what started, then report (the caller maps to an error)
    {
      std::lock_guard<std::mutex> lk(mu_);
      stop_ = true;
    }
    cv_start_.notify_all();
    for (auto &t : threads_) t.join();
    throw;
  }
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
  }
  cv_start_.notify_all();
  for (auto &t : threads_) t.join();
}

void ThreadPool::worker(int tid) {
  uint64_t seen = 0;
  for (;;) {
    void (*fn)(void *, int);
    void *ctx;
    {
      std::unique_lock<std::mutex> lk(mu_);
      cv_start_.wait(lk, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
      fn = fn_;
      ctx = ctx_;
    }
    fn(ctx, tid);
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (--pending_ == 0) cv_done_.notify_one();
    }
  }
}

void ThreadPool::run(void (*fn)(void *, int), void *ctx) {
  if (n_ == 1) {
    fn(ctx, 0);
    return;
  }
  // One job at a time: a second caller waits here instead of overwriting
  // the job (and the pending count) of the one running.
  std::lock_guard<std::mutex> one(run_mu_);
  {
    std::lock_guard<std::mutex> lk(mu_);
    fn_ = fn;
    ctx_ = ctx;
    pending_ = n_ - 1;
    ++generation_;
  }
  cv_start_.notify_all();
  fn(ctx, 0);
  std::unique_lock<std::mutex> lk(mu_);
  cv_done_.wait(lk, [&] { return pending_ == 0; });
}

// ---- one call at a time per optimizer ----------------------------------------

bool CallGate::enter(const char *fn, const char **running) {
  std::lock_guard<std::mutex> lk(mu_);
  const std::thread::id me = std::this_thread::get_id();
  if (closing_) {
    *running = "zopt_optimizer_free";
    return false;
  }
  if (depth_ > 0 && owner_ != me) {
    *running = fn_;
    return false;
  }
  if (depth_++ == 0) {
    owner_ = me;
    fn_ = fn;
  }
  return true;
}

void CallGate::leave() {
  std::lock_guard<std::mutex> lk(mu_);
  if (--depth_ == 0) {
    owner_ = std::thread::id();
    fn_ = nullptr;
    idle_.notify_all();
  }
}

void CallGate::close() {
  std::unique_lock<std::mutex> lk(mu_);
  closing_ = true;
  // A free from inside a call on this very thread cannot wait for it.
  if (depth_ > 0 && owner_ == std::this_thread::get_id()) return;
  idle_.wait(lk, [&] { return depth_ == 0; });
}

CallHold::CallHold(const zopt_optimizer *o, const char *fn, bool join) : fn_(fn) {
  if (!o->gate.enter(fn, &running_)) return;
  gate_ = &o->gate;
  // The caller's optimizer is not const; a tail left by its last step
  // changes its states (joined before any call reads or writes them).
  // (join_tail, through the backend: this file links alone into tests.)
  if (join && o->tail && o->backend) joined_ = o->backend->join_tail(const_cast<zopt_optimizer *>(o), fn);
}

CallHold::~CallHold() {
  if (gate_) gate_->leave();
}

zopt_status CallHold::refuse() const {
  if (joined_) return joined_;  // the join's message is set
  if (running_ && strcmp(running_, "zopt_optimizer_free") == 0)
    return fail(ZOPT_ERR_BAD_STATE, "%s: the optimizer is being freed (zopt_optimizer_free) on another thread", fn_);
  return fail(ZOPT_ERR_BAD_STATE,
              "%s: another call (%s) is running on this optimizer on another thread: one optimizer takes one call "
              "at a time (zopt.h \"Threading\")",
              fn_, running_ ? running_ : "?");
}

}  // namespace zopt

extern "C" {
ZOPT_API const char *zopt_last_error(void) { return zopt::g_err; }
ZOPT_API uint32_t zopt_api_version(void) { return ZOPT_API_VERSION; }
ZOPT_API uint32_t zopt_abi_version(void) { return ZOPT_ABI_VERSION; }
}
