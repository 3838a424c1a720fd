// checkpoint/q8.cpp - loads between q8 moments and wider ones (q8.h).
#include "checkpoint/q8.h"

#include "checkpoint/format.h"

#include <algorithm>
#include <cmath>
#include <cstring>

namespace zopt {
namespace ckpt {

namespace {

bool is_moment(uint32_t k) { return k == ZOPT_STATE_EXP_AVG || k == ZOPT_STATE_EXP_AVG_SQ; }
bool is_absmax(uint32_t k) { return k == ZOPT_STATE_EXP_AVG_ABSMAX || k == ZOPT_STATE_EXP_AVG_SQ_ABSMAX; }
uint32_t absmax_of(uint32_t moment) {
  return moment == ZOPT_STATE_EXP_AVG ? ZOPT_STATE_EXP_AVG_ABSMAX : ZOPT_STATE_EXP_AVG_SQ_ABSMAX;
}
uint32_t moment_of(uint32_t absmax) {
  return absmax == ZOPT_STATE_EXP_AVG_ABSMAX ? ZOPT_STATE_EXP_AVG : ZOPT_STATE_EXP_AVG_SQ;
}
bool wide(uint32_t dt) { return dt != 0 && dt != ZOPT_DTYPE_Q8 && dt != ZOPT_DTYPE_I16; }

// The set's moment `kind` of tensor t, elements [a, e), as f32.
zopt_status read_f32(const ReadRange &read, uint32_t kind, size_t t, int64_t a, int64_t e, std::vector<float> *out) {
  std::vector<unsigned char> b;
  uint32_t sdt = 0;
  if (zopt_status st = read(kind, t, a, e, &b, &sdt)) return st;
  out->resize((size_t)(e - a));
  convert(b.data(), sdt, out->data(), ZOPT_DTYPE_F32, e - a);
  return ZOPT_OK;
}

}  // namespace

bool q8_converts(uint32_t kind, uint32_t dt, const FileDtype &fdt) {
  if (is_moment(kind)) {
    const uint32_t f = fdt(kind);
    return (dt == ZOPT_DTYPE_Q8 && wide(f)) || (wide(dt) && f == ZOPT_DTYPE_Q8);
  }
  return is_absmax(kind) && !fdt(kind) && wide(fdt(moment_of(kind)));
}

bool q8_absmax_of_moment(uint32_t kind, const zopt_step_descriptor *d) {
  return is_absmax(kind) && state_index(d, moment_of(kind)) >= 0;
}

zopt_status q8_stage(uint32_t kind, uint32_t dt, size_t t, int64_t numel, int64_t start, int64_t len,
                     const FileDtype &fdt, const ReadRange &read, unsigned char *out, const char *path) {
  const int uns = kind == ZOPT_STATE_EXP_AVG_SQ || kind == ZOPT_STATE_EXP_AVG_SQ_ABSMAX;
  std::vector<float> x;
  if (is_absmax(kind)) {  // blocks [start, start + len): from the set's wider moment
    const int64_t a = start * ZOPT_Q8_BLOCK, e = std::min(numel, (start + len) * ZOPT_Q8_BLOCK);
    if (zopt_status st = read_f32(read, moment_of(kind), t, a, e, &x)) return st;
    std::vector<float> m((size_t)len);
    q8_encode_n(x.data(), e - a, uns, nullptr, m.data());
    memcpy(out, m.data(), (size_t)len * 4);
    return ZOPT_OK;
  }
  if (dt == ZOPT_DTYPE_Q8) {  // codes of elements [start, start + len), whole blocks
    if (zopt_status st = read_f32(read, kind, t, start, start + len, &x)) return st;
    std::vector<float> m((size_t)((len + ZOPT_Q8_BLOCK - 1) / ZOPT_Q8_BLOCK));
    q8_encode_n(x.data(), len, uns, out, m.data());
    return ZOPT_OK;
  }
  // The set's q8 moment decoded into the step's wider one.
  const uint32_t ak = absmax_of(kind);
  if (fdt(ak) != ZOPT_DTYPE_F32)
    return ck_fail(path, "tensor %zu: the checkpoint's %s is q8 without its %s", t, state_kind_name(kind),
                   state_kind_name(ak));
  std::vector<unsigned char> codes, am;
  uint32_t cdt = 0, adt = 0;
  const int64_t b0 = start / ZOPT_Q8_BLOCK, b1 = (start + len + ZOPT_Q8_BLOCK - 1) / ZOPT_Q8_BLOCK;
  if (zopt_status st = read(kind, t, start, start + len, &codes, &cdt)) return st;
  if (zopt_status st = read(ak, t, b0, b1, &am, &adt)) return st;
  x.resize((size_t)len);
  for (int64_t i = 0; i < len; ++i) {
    float a;
    memcpy(&a, am.data() + (size_t)((start + i) / ZOPT_Q8_BLOCK - b0) * 4, 4);
    x[(size_t)i] = zopt_q8_decode(codes[(size_t)i], a, uns);
  }
  convert(x.data(), ZOPT_DTYPE_F32, out, dt, len);
  return ZOPT_OK;
}

}  // namespace ckpt
}  // namespace zopt
