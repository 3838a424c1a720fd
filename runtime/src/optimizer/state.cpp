// optimizer/state.cpp - a tensor's state read or written whole (zopt.h:
// as f32, or raw in its storage dtype) through the backend's state
// access, masters refreshed from the params, ZeRO-3 params gathered.
#include "optimizer/api.h"

#include "backend/backend.h"
#include "exec/exec.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

using namespace zopt;

extern "C" {

// The checks every state access shares: the buffer, the state, and its
// size (`size` elements for f32 access, `size` bytes of storage for raw).
static zopt_status check_state_access(const zopt_optimizer *o, int tensor, uint32_t kind,
                                      const void *buf, bool raw, uint64_t size, const char *fn,
                                      int *si) {
  if (zopt_status st = resolve_state(o, tensor, kind, fn, si)) return st;
  // A q8 absmax has one element per block of the tensor (abi.h "q8 moments").
  uint64_t numel = (uint64_t)state_numel(o->d, *si, o->tensors[tensor].numel);
  if (!buf && numel) return fail(ZOPT_ERR_INVALID_ARGUMENT, "%s: %s is NULL", fn, raw ? "buffer" : "array");
  if (!raw && size != numel)
    return fail(ZOPT_ERR_INVALID_ARGUMENT, "%s: numel %lld != tensor's %lld", fn, (long long)size,
                (long long)numel);
  uint64_t want = numel * dtype_size(o->d->states[*si].dtype);
  if (raw && size != want)
    return fail(ZOPT_ERR_INVALID_ARGUMENT, "%s: bytes %llu != %llu", fn, (unsigned long long)size,
                (unsigned long long)want);
  return ZOPT_OK;
}

// State si of tensor t in its storage dtype, whole: device copies for GPU
// memory, a copy of host memory, or (a state sharded across ranks) a
// collective gather: every rank reads.
static zopt_status read_storage(const zopt_optimizer *o, int t, int si, void *out, size_t bytes) {
  return o->backend->read_state(o, t, si, out, bytes);
}

// Writes state si of tensor t from its storage dtype: each rank keeps the
// elements it holds (no communication).
static zopt_status write_storage(zopt_optimizer *o, int t, int si, const void *in, size_t bytes) {
  return o->backend->write_state(o, t, si, in, bytes);
}

static zopt_status with_staging(int64_t n, uint32_t dt, std::vector<unsigned char> *tmp) {
  try {
    tmp->resize((size_t)n * dtype_size(dt));
  } catch (...) {
    return fail(ZOPT_ERR_OUT_OF_MEMORY, "out of host memory for a staging copy of %lld elements", (long long)n);
  }
  return ZOPT_OK;
}

// A remainder master read as f32: rebuilt from the param (its high half)
// and the remainder (abi.h "Remainder masters"), exactly.
static zopt_status read_remainder_master(const zopt_optimizer *o, int tensor, int si, float *out, int64_t numel) {
  std::vector<unsigned char> hi, lo;
  if (zopt_status st = with_staging(numel, ZOPT_DTYPE_I16, &hi)) return st;
  if (zopt_status st = with_staging(numel, ZOPT_DTYPE_I16, &lo)) return st;
  if (zopt_status st = read_storage(o, tensor, o->step->param_index, hi.data(), hi.size())) return st;
  if (zopt_status st = read_storage(o, tensor, si, lo.data(), lo.size())) return st;
  for (int64_t i = 0; i < numel; ++i) {
    uint16_t p, r;
    memcpy(&p, hi.data() + 2 * i, 2);
    memcpy(&r, lo.data() + 2 * i, 2);
    uint32_t b = zopt_remainder_join(p, r);
    memcpy(out + i, &b, 4);
  }
  return ZOPT_OK;
}

// The absmax state of q8 moment si (abi.h "q8 moments").
static int absmax_of(const zopt_optimizer *o, int si) {
  const bool v = o->d->states[si].kind == ZOPT_STATE_EXP_AVG_SQ;
  return state_index(o->d, v ? ZOPT_STATE_EXP_AVG_SQ_ABSMAX : ZOPT_STATE_EXP_AVG_ABSMAX);
}

// A q8 moment's host staging: its codes and its blocks' absmax (state ai),
// and whether its map is the unsigned one (exp_avg_sq).
struct Q8Staging {
  int ai = 0, uns = 0;
  std::vector<unsigned char> codes, absmax;
  zopt_status init(const zopt_optimizer *o, int si, int64_t numel) {
    ai = absmax_of(o, si);
    uns = o->d->states[si].kind == ZOPT_STATE_EXP_AVG_SQ;
    if (zopt_status st = with_staging(numel, ZOPT_DTYPE_Q8, &codes)) return st;
    return with_staging(state_numel(o->d, ai, numel), ZOPT_DTYPE_F32, &absmax);
  }
};

// A q8 moment read as f32: every code decoded with its block's absmax.
static zopt_status read_q8(const zopt_optimizer *o, int tensor, int si, float *out, int64_t numel) {
  Q8Staging q;
  if (zopt_status st = q.init(o, si, numel)) return st;
  if (zopt_status st = read_storage(o, tensor, si, q.codes.data(), q.codes.size())) return st;
  if (zopt_status st = read_storage(o, tensor, q.ai, q.absmax.data(), q.absmax.size())) return st;
  const float *a = (const float *)q.absmax.data();
  for (int64_t i = 0; i < numel; ++i) out[i] = zopt_q8_decode(q.codes[(size_t)i], a[i / ZOPT_Q8_BLOCK], q.uns);
  return ZOPT_OK;
}

// A q8 moment written from f32: per block the absmax max |x| (NaN if any x
// is), each element zopt_q8_encode'd (the kernels' encode): codes and
// absmax both written.
static zopt_status write_q8(zopt_optimizer *o, int tensor, int si, const float *in, int64_t numel) {
  Q8Staging q;
  if (zopt_status st = q.init(o, si, numel)) return st;
  q8_encode_n(in, numel, q.uns, q.codes.data(), (float *)q.absmax.data());
  if (zopt_status st = write_storage(o, tensor, si, q.codes.data(), q.codes.size())) return st;
  return write_storage(o, tensor, q.ai, q.absmax.data(), q.absmax.size());
}

ZOPT_API zopt_status zopt_optimizer_read_state_f32(const zopt_optimizer *o, int tensor, zopt_state_kind kind,
                                                   float *out, int64_t numel) {
  const char *fn = "zopt_optimizer_read_state_f32";
  CHECK_OPT(o, "zopt_optimizer_read_state_f32");
  int si;
  if (zopt_status st = check_state_access(o, tensor, raw_enum(kind), out, false, (uint64_t)numel, fn, &si))
    return st;
  const uint32_t dt = o->d->states[si].dtype;
  if (dt == ZOPT_DTYPE_F32) return read_storage(o, tensor, si, out, (size_t)numel * 4);
  if (dt == ZOPT_DTYPE_I16) return read_remainder_master(o, tensor, si, out, numel);
  if (dt == ZOPT_DTYPE_Q8) return read_q8(o, tensor, si, out, numel);
  std::vector<unsigned char> tmp;
  if (zopt_status st = with_staging(numel, dt, &tmp)) return st;
  if (zopt_status st = read_storage(o, tensor, si, tmp.data(), tmp.size())) return st;
  convert(tmp.data(), dt, out, ZOPT_DTYPE_F32, numel);
  return ZOPT_OK;
}

ZOPT_API zopt_status zopt_optimizer_write_state_f32(zopt_optimizer *o, int tensor, zopt_state_kind kind,
                                                    const float *in, int64_t numel) {
  const char *fn = "zopt_optimizer_write_state_f32";
  CHECK_OPT(o, "zopt_optimizer_write_state_f32");
  int si;
  if (zopt_status st = check_state_access(o, tensor, raw_enum(kind), in, false, (uint64_t)numel, fn, &si))
    return st;
  const uint32_t dt = o->d->states[si].dtype;
  if (dt == ZOPT_DTYPE_F32) return write_storage(o, tensor, si, in, (size_t)numel * 4);
  if (dt == ZOPT_DTYPE_I16)
    return fail(ZOPT_ERR_UNSUPPORTED, "%s: the master is a remainder (abi.h \"Remainder masters\"): its high half "
                "is the param; write the param and call zopt_optimizer_refresh_master, or write the raw remainder",
                fn);
  if (dt == ZOPT_DTYPE_Q8) return write_q8(o, tensor, si, in, numel);
  std::vector<unsigned char> tmp;
  if (zopt_status st = with_staging(numel, dt, &tmp)) return st;
  convert(in, ZOPT_DTYPE_F32, tmp.data(), dt, numel);
  return write_storage(o, tensor, si, tmp.data(), tmp.size());
}

ZOPT_API zopt_status zopt_optimizer_read_state_raw(const zopt_optimizer *o, int tensor, zopt_state_kind kind,
                                                   void *out, size_t bytes) {
  const char *fn = "zopt_optimizer_read_state_raw";
  CHECK_OPT(o, "zopt_optimizer_read_state_raw");
  int si;
  if (zopt_status st = check_state_access(o, tensor, raw_enum(kind), out, true, bytes, fn, &si))
    return st;
  return read_storage(o, tensor, si, out, bytes);
}

ZOPT_API zopt_status zopt_optimizer_write_state_raw(zopt_optimizer *o, int tensor, zopt_state_kind kind,
                                                    const void *in, size_t bytes) {
  const char *fn = "zopt_optimizer_write_state_raw";
  CHECK_OPT(o, "zopt_optimizer_write_state_raw");
  int si;
  if (zopt_status st = check_state_access(o, tensor, raw_enum(kind), in, true, bytes, fn, &si))
    return st;
  return write_storage(o, tensor, si, in, bytes);
}

ZOPT_API zopt_status zopt_optimizer_refresh_master(zopt_optimizer *o, int first, int count) {
  const char *fn = "zopt_optimizer_refresh_master";
  CHECK_OPT(o, "zopt_optimizer_refresh_master");
  if (!o->finalized) return fail(ZOPT_ERR_BAD_STATE, "%s: call zopt_optimizer_finalize first", fn);
  if (first < 0 || count < 0 || (size_t)first + (size_t)count > o->tensors.size())
    return fail(ZOPT_ERR_INVALID_ARGUMENT, "%s: tensors [%d, %d + %d) out of range (have %zu)", fn, first, first,
                count, o->tensors.size());
  return o->backend->refresh_master(o, first, count);
}

ZOPT_API zopt_status zopt_optimizer_gather_params(zopt_optimizer *o, int first, int count, void *const *dst) {
  const char *fn = "zopt_optimizer_gather_params";
  CHECK_OPT(o, "zopt_optimizer_gather_params");
  if (!o->finalized) return fail(ZOPT_ERR_BAD_STATE, "%s: call zopt_optimizer_finalize first", fn);
  if (first < 0 || count < 0 || (size_t)first + (size_t)count > o->tensors.size())
    return fail(ZOPT_ERR_INVALID_ARGUMENT, "%s: tensors [%d, %d + %d) out of range (have %zu)", fn, first, first,
                count, o->tensors.size());
  if (zopt_status st = o->backend->supports(o, Feature::GatherParams, fn)) return st;
  return exec::gather_state(o, o->step->param_index, first, count, dst);
}

}  // extern "C"

// ---- remainder masters in other layouts (abi.h's two functions, n at a time) ----
ZOPT_API zopt_status zopt_remainder_join_n(const uint16_t *param, const int16_t *rem, float *master, int64_t n) {
  if (n < 0 || (n > 0 && (!param || !rem || !master)))
    return fail(ZOPT_ERR_INVALID_ARGUMENT, "zopt_remainder_join_n: n = %lld with %s", (long long)n,
                n < 0 ? "n < 0" : "a NULL array");
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t b = zopt_remainder_join(param[i], (uint16_t)rem[i]);
    std::memcpy(&master[i], &b, 4);
  }
  return ZOPT_OK;
}

ZOPT_API zopt_status zopt_remainder_split_n(const float *master, uint16_t *param, int16_t *rem, int64_t n) {
  if (n < 0 || (n > 0 && (!param || !rem || !master)))
    return fail(ZOPT_ERR_INVALID_ARGUMENT, "zopt_remainder_split_n: n = %lld with %s", (long long)n,
                n < 0 ? "n < 0" : "a NULL array");
  for (int64_t i = 0; i < n; ++i) {
    uint32_t b;
    std::memcpy(&b, &master[i], 4);
    uint16_t r;
    zopt_remainder_split(b, &param[i], &r);
    rem[i] = (int16_t)r;
  }
  return ZOPT_OK;
}
