// Checkpoint format checks (docs/CHECKPOINT.md) that need no multi-rank
// setup:
//   - FNV-1a-64 against published test vectors, and the descriptor checksum
//     of abi.h is that hash (the format-1 / ABI-1 offset basis was wrong);
//   - a file with a non-zero `flags` field is refused;
//   - a stale <path>.tmp (a save killed midway) neither breaks the next
//     save nor is read by a load, and does not survive the next save; nor
//     do the files of older sets (format 2's path.<r>-of-<W>, format 3's
//     path.<r>-of-<W>.<identity>), while files that only look alike stay;
//   - format 3's group flags: bit 0 (maximize) is restored by a load and
//     saved again; an unknown bit is refused; a format-2 file (the same
//     save rewritten) loads with the same states;
//   - a checkpoint of another update rule (AdamW into SGD) is refused unless
//     ZOPT_LOAD_ALLOW_RULE_CHANGE, and a refused load changes nothing.
// Steps: argv[1] = a directory with the compiled examples (adamw_f32.so and
// sgd_nesterov_f32.so); without it only the hash checks run.
#include "test_util.h"

#include "ckpt_test_util.h"

#include "zopt/abi.h"

#include <unistd.h>

#include <cstdio>
#include <string>
#include <vector>

namespace {

// FNV-1a-64 as the specification writes it (offset basis
// 14695981039346656037, prime 1099511628211), independent of the runtime's.
uint64_t fnv1a64(const void *data, size_t n) {
  const unsigned char *p = (const unsigned char *)data;
  uint64_t h = 14695981039346656037ull;
  for (size_t i = 0; i < n; ++i) h = (h ^ p[i]) * 1099511628211ull;
  return h;
}

void test_fnv() {
  // Published FNV-1a 64-bit test vectors (Fowler/Noll/Vo reference code).
  ZT_CHECK(fnv1a64("", 0) == 0xcbf29ce484222325ull);
  ZT_CHECK(fnv1a64("a", 1) == 0xaf63dc4c8601ec8cull);
  ZT_CHECK(fnv1a64("foobar", 6) == 0x85944171f73967e8ull);
  // abi.h's descriptor checksum is FNV-1a-64 of the struct, checksum read as 0.
  zopt_step_descriptor d;
  memset(&d, 0, sizeof d);
  memcpy(d.magic, ZOPT_DESC_MAGIC, 8);
  strcpy(d.name, "fnv");
  d.checksum = 0x1234;
  zopt_step_descriptor z = d;
  z.checksum = 0;
  ZT_CHECK(zopt_desc_checksum(&d) == fnv1a64(&z, sizeof z));
  printf("  FNV-1a-64 test vectors and the descriptor checksum: checked\n");
}

struct Opt {
  zopt_step *s = nullptr;
  zopt_optimizer *o = nullptr;
  std::vector<float> p[2], g[2];
  ~Opt() {
    zopt_optimizer_free(o);
    zopt_step_free(s);
  }
  bool make(const std::string &path) {
    if (zopt_step_load(path.c_str(), &s) != ZOPT_OK) return false;
    ZT_OK(zopt_optimizer_create(s, &o));
    int gid, tid;
    ZT_OK(zopt_optimizer_add_group(o, &gid));
    for (int t = 0; t < 2; ++t) {
      p[t].assign(1000 + 7 * t, 0.5f + t);
      g[t].assign(p[t].size(), 0.25f - t);
      ZT_OK(zopt_optimizer_add_tensor(o, gid, p[t].data(), g[t].data(), (int64_t)p[t].size(), ZOPT_DTYPE_F32, &tid));
    }
    ZT_OK(zopt_optimizer_finalize(o));
    return true;
  }
};

using ckt::slurp;
using ckt::spit;

// FNV-1a with format 1's offset basis.
uint64_t fnv_v1(const void *data, size_t n) {
  const unsigned char *p = (const unsigned char *)data;
  uint64_t h = 1469598103934665603ull;
  for (size_t i = 0; i < n; ++i) h = (h ^ p[i]) * 1099511628211ull;
  return h;
}

// A format-1 file (what ABI-1 runtimes wrote) for the adamw_f32 optimizer
// below: step counts 3, exp_avg = 0.5 + t, exp_avg_sq = 0.25.
std::vector<unsigned char> v1_file(const zopt_step_descriptor *d, const std::vector<size_t> &numel) {
  std::string w;
  auto put = [&](const void *p, size_t n) { w.append((const char *)p, n); };
  auto u32 = [&](uint32_t v) { put(&v, 4); };
  auto u64 = [&](uint64_t v) { put(&v, 8); };
  auto f64 = [&](double v) { put(&v, 8); };
  put("ZOPTCKP1", 8);
  u32(1);
  u32(0);
  u64(d->checksum);
  put(d->name, ZOPT_NAME_LEN);
  u32(1);
  u32((uint32_t)numel.size());
  f64(65536.0);
  u64(0);
  f64(65536.0), f64(2.0), f64(0.5);
  u64(2000);
  f64(1.0);
  u32(1), u32(0);
  u64(3);  // the group's step count
  u32(d->num_hypers), u32(0);
  for (uint32_t h = 0; h < d->num_hypers; ++h) u32(d->hypers[h].kind), u32(0), f64(d->hypers[h].default_value);
  size_t header = w.size() + numel.size() * (16 + 2 * 32) + 8;
  uint64_t off = (header + 63) / 64 * 64;
  std::vector<std::vector<float>> data;
  for (size_t t = 0; t < numel.size(); ++t) {
    u32(0), u32(2);
    u64(numel[t]);
    for (uint32_t kind : {(uint32_t)ZOPT_STATE_EXP_AVG, (uint32_t)ZOPT_STATE_EXP_AVG_SQ}) {
      data.emplace_back(numel[t], kind == ZOPT_STATE_EXP_AVG ? 0.5f + t : 0.25f);
      u32(kind), u32(ZOPT_DTYPE_F32);
      u64(numel[t] * 4);
      u64(off);
      u64(fnv_v1(data.back().data(), numel[t] * 4));
      off = (off + numel[t] * 4 + 63) / 64 * 64;
    }
  }
  u64(off);
  for (auto &v : data) {
    w.resize((w.size() + 63) / 64 * 64, '\0');
    put(v.data(), v.size() * 4);
  }
  w.resize((w.size() + 63) / 64 * 64, '\0');
  u64(fnv_v1(w.data(), w.size()));
  return std::vector<unsigned char>(w.begin(), w.end());
}

void test_files(const std::string &dir) {
  Opt a, sgd;
  if (!a.make(dir + "/adamw_f32.so") || !sgd.make(dir + "/sgd_nesterov_f32.so")) {
    printf("  (examples not found in %s: file checks skipped)\n", dir.c_str());
    return;
  }
  char tmpl[] = "/tmp/zopt_ckpt_XXXXXX";
  int fd = mkstemp(tmpl);
  close(fd);
  std::string path = tmpl;
  zopt_step_result r;
  ZT_OK(zopt_optimizer_step(a.o, &r));
  // A stale .tmp from a killed save: garbage that must be neither read nor kept.
  spit(path + ".tmp", std::vector<unsigned char>(4096, 0xAB));
  ZT_OK(zopt_optimizer_save(a.o, path.c_str()));
  ZT_CHECK(fopen((path + ".tmp").c_str(), "rb") == nullptr);
  spit(path + ".tmp", std::vector<unsigned char>(100, 0xCD));
  ZT_OK(zopt_optimizer_load(a.o, path.c_str()));
  unlink((path + ".tmp").c_str());

  // flags = 1 (and a header checksum that matches it): refused.
  std::vector<unsigned char> good = slurp(path);
  ZT_CHECK(good.size() > 64 && memcmp(good.data(), "ZOPTCKP2", 8) == 0 && good[8] == 3);
  uint64_t hsize, stored;
  memcpy(&hsize, good.data() + 16, 8);
  memcpy(&stored, good.data() + hsize, 8);
  // The runtime's header checksum is the standard FNV-1a-64 (the doc's).
  ZT_CHECK(stored == fnv1a64(good.data(), (size_t)hsize));
  std::vector<unsigned char> bad = good;
  bad[12] = 1;
  uint64_t h = fnv1a64(bad.data(), (size_t)hsize);
  memcpy(bad.data() + hsize, &h, 8);
  spit(path + ".bad", bad);
  ZT_ERR(zopt_optimizer_load(a.o, (path + ".bad").c_str()), ZOPT_ERR_CHECKPOINT);
  ZT_CHECK(strstr(zopt_last_error(), "flags") != nullptr);
  printf("  flags = 1 -> %s\n", zopt_last_error());
  // A reserved field (the u32 after the loss scaler's `dynamic`, at byte
  // 24 + 8 + 64 + 2 * 4 + 16 + 2 * 4 + 2 * 8 + 5 * 8 + 4 = 188) not 0: refused.
  bad = good;
  bad[ckt::kReservedAt] = 1;
  h = fnv1a64(bad.data(), (size_t)hsize);
  memcpy(bad.data() + hsize, &h, 8);
  spit(path + ".bad", bad);
  ZT_ERR(zopt_optimizer_load(a.o, (path + ".bad").c_str()), ZOPT_ERR_CHECKPOINT);
  ZT_CHECK(strstr(zopt_last_error(), "loss scaler's reserved field is not 0") != nullptr);
  printf("  a reserved field = 1 -> %s\n", zopt_last_error());

  // A newer format version: refused by name.
  bad = good;
  bad[8] = 4;
  h = fnv1a64(bad.data(), (size_t)hsize);
  memcpy(bad.data() + hsize, &h, 8);
  spit(path + ".bad", bad);
  ZT_ERR(zopt_optimizer_load(a.o, (path + ".bad").c_str()), ZOPT_ERR_CHECKPOINT);
  ZT_CHECK(strstr(zopt_last_error(), "format version 4") != nullptr);

  // Header flags: bit 1 (`linked`, a part of a linked save) is read (a
  // plain load of such a file loads it); bit 2 is a newer writer's, and
  // `linked` in a format-2 file is refused (it has no identity).
  bad = good;
  bad[12] = 2;
  ckt::reseal(bad);
  spit(path + ".linked", bad);
  ZT_OK(zopt_optimizer_load(a.o, (path + ".linked").c_str()));
  bad[12] = 4;
  ckt::reseal(bad);
  spit(path + ".bad", bad);
  ZT_ERR(zopt_optimizer_load(a.o, (path + ".bad").c_str()), ZOPT_ERR_CHECKPOINT);
  ZT_CHECK(strstr(zopt_last_error(), "flags 0x4: bits this runtime does not know") != nullptr);
  bad = ckt::to_format2(good);
  bad[12] = 2;
  ckt::reseal(bad);
  spit(path + ".bad", bad);
  ZT_ERR(zopt_optimizer_load(a.o, (path + ".bad").c_str()), ZOPT_ERR_CHECKPOINT);
  ZT_CHECK(strstr(zopt_last_error(), "cannot be a part of a linked save") != nullptr);
  printf("  format 2 with flag 'linked' -> %s\n", zopt_last_error());

  // Group flags (format 3): bit 0 (maximize) loads and is saved again; an
  // unknown bit is refused and changes nothing.
  bad = good;
  const size_t gf = ckt::group_flags_at(bad, 0);
  ZT_CHECK(bad[gf] == 0);
  bad[gf] = 1;
  ckt::reseal(bad);
  spit(path + ".max", bad);
  ZT_OK(zopt_optimizer_load(a.o, (path + ".max").c_str()));
  ZT_OK(zopt_optimizer_save(a.o, (path + ".max2").c_str()));
  std::vector<unsigned char> again = slurp(path + ".max2");
  ZT_CHECK(again.size() > gf && again[ckt::group_flags_at(again, 0)] == 1 && again[ckt::group_flags_at(again, 1)] == 0);
  ZT_OK(zopt_optimizer_load(a.o, path.c_str()));  // back to flags 0
  ZT_OK(zopt_optimizer_save(a.o, (path + ".max2").c_str()));
  again = slurp(path + ".max2");
  ZT_CHECK(again.size() > gf && again[ckt::group_flags_at(again, 0)] == 0);
  std::vector<float> m0(a.p[0].size()), m1(m0.size());
  ZT_OK(zopt_optimizer_read_state_f32(a.o, 0, ZOPT_STATE_EXP_AVG, m0.data(), (int64_t)m0.size()));
  bad[gf] = 2;
  ckt::reseal(bad);
  spit(path + ".bad", bad);
  ZT_ERR(zopt_optimizer_load(a.o, (path + ".bad").c_str()), ZOPT_ERR_CHECKPOINT);
  ZT_CHECK(strstr(zopt_last_error(), "group 0: flags 0x2") != nullptr);
  printf("  group flags 0x2 -> %s\n", zopt_last_error());
  ZT_OK(zopt_optimizer_read_state_f32(a.o, 0, ZOPT_STATE_EXP_AVG, m1.data(), (int64_t)m1.size()));
  ZT_CHECK(m0 == m1);
  // The same save in format 2 (no identity, the flags a reserved field):
  // loads with the same states.
  Opt a2;
  a2.make(dir + "/adamw_f32.so");
  spit(path + ".v2", ckt::to_format2(good));
  ZT_OK(zopt_optimizer_load(a2.o, (path + ".v2").c_str()));
  for (int t = 0; t < 2; ++t)
    for (uint32_t kind : {(uint32_t)ZOPT_STATE_EXP_AVG, (uint32_t)ZOPT_STATE_EXP_AVG_SQ}) {
      std::vector<float> x(a.p[t].size()), y(x.size());
      ZT_OK(zopt_optimizer_read_state_f32(a.o, t, (zopt_state_kind)kind, x.data(), (int64_t)x.size()));
      ZT_OK(zopt_optimizer_read_state_f32(a2.o, t, (zopt_state_kind)kind, y.data(), (int64_t)y.size()));
      ZT_CHECK(x == y && x[0] != 0.0f);
    }
  unlink((path + ".max").c_str());
  unlink((path + ".max2").c_str());
  unlink((path + ".v2").c_str());
  printf("  format version 4, group flags, a format-2 file: checked\n");

  // Files of older sets go with the next save; look-alikes stay.
  const char *strays[] = {".1-of-2", ".1-of-2.tmp", ".0-of-1.0123456789abcdef0123456789abcdef",
                          ".2-of-3.fedcba9876543210fedcba9876543210", ".tmp"};
  const char *others[] = {".f32", ".01-of-2", ".1-of-1", ".1-of-2.0123", ".1-of-2.0123456789ABCDEF0123456789ABCDEF",
                          ".bad"};
  for (const char *x : strays) spit(path + x, {1, 2, 3});
  for (const char *x : others) spit(path + x, {1, 2, 3});
  ZT_OK(zopt_optimizer_save(a.o, path.c_str()));
  for (const char *x : strays) ZT_CHECK(access((path + x).c_str(), F_OK) != 0);
  for (const char *x : others) {
    ZT_CHECK(access((path + x).c_str(), F_OK) == 0);
    unlink((path + x).c_str());
  }
  printf("  a save removes the files of older sets, not look-alikes: checked\n");

  // Another update rule: refused, nothing changes; allowed with the flag.
  std::vector<float> before(sgd.p[0].size()), after(before.size());
  ZT_OK(zopt_optimizer_step(sgd.o, &r));
  ZT_OK(zopt_optimizer_read_state_f32(sgd.o, 0, ZOPT_STATE_MOMENTUM_BUFFER, before.data(), (int64_t)before.size()));
  ZT_ERR(zopt_optimizer_load(sgd.o, path.c_str()), ZOPT_ERR_CHECKPOINT);
  printf("  AdamW into SGD -> %s\n", zopt_last_error());
  ZT_CHECK(strstr(zopt_last_error(), "update rule") != nullptr);
  ZT_OK(zopt_optimizer_read_state_f32(sgd.o, 0, ZOPT_STATE_MOMENTUM_BUFFER, after.data(), (int64_t)after.size()));
  ZT_CHECK(before == after);
  int64_t c = -1;
  ZT_OK(zopt_optimizer_get_tensor_step(sgd.o, 0, &c));
  ZT_CHECK(c == 1);
  ZT_OK(zopt_optimizer_load_ex(sgd.o, path.c_str(), ZOPT_LOAD_ALLOW_RULE_CHANGE));
  ZT_OK(zopt_optimizer_read_state_f32(sgd.o, 0, ZOPT_STATE_MOMENTUM_BUFFER, after.data(), (int64_t)after.size()));
  bool zero = true;
  for (float x : after) zero = zero && x == 0.0f;
  ZT_CHECK(zero);  // the momentum buffer the AdamW file lacks starts at zero
  ZT_ERR(zopt_optimizer_load_ex(sgd.o, path.c_str(), 4), ZOPT_ERR_INVALID_ARGUMENT);
  unlink(path.c_str());
  unlink((path + ".bad").c_str());
  printf("  stale .tmp, flags, another update rule: checked\n");

  // A format-1 file loads: its tensors whole, its group's step count.
  Opt b;
  b.make(dir + "/adamw_f32.so");
  spit(path + ".v1", v1_file(zopt_step_get_descriptor(b.s), {b.p[0].size(), b.p[1].size()}));
  ZT_OK(zopt_optimizer_load(b.o, (path + ".v1").c_str()));
  for (int t = 0; t < 2; ++t) {
    std::vector<float> m(b.p[t].size()), v(b.p[t].size());
    ZT_OK(zopt_optimizer_read_state_f32(b.o, t, ZOPT_STATE_EXP_AVG, m.data(), (int64_t)m.size()));
    ZT_OK(zopt_optimizer_read_state_f32(b.o, t, ZOPT_STATE_EXP_AVG_SQ, v.data(), (int64_t)v.size()));
    ZT_CHECK(m == std::vector<float>(m.size(), 0.5f + t) && v == std::vector<float>(v.size(), 0.25f));
    int64_t c = -1;
    ZT_OK(zopt_optimizer_get_tensor_step(b.o, t, &c));
    ZT_CHECK(c == 3);
  }
  std::vector<unsigned char> v1 = slurp(path + ".v1");
  v1[v1.size() - 100] ^= 1;  // inside the data: the file checksum catches it
  spit(path + ".v1", v1);
  ZT_ERR(zopt_optimizer_load(b.o, (path + ".v1").c_str()), ZOPT_ERR_CHECKPOINT);
  unlink((path + ".v1").c_str());
  printf("  a format-1 checkpoint loads (and a corrupted one is refused): checked\n");
}

}  // namespace

int main(int argc, char **argv) {
  test_fnv();
  if (argc > 1) test_files(argv[1]);
  if (zt_failures) {
    fprintf(stderr, "%d failure(s)\n", zt_failures);
    return 1;
  }
  printf("test_checkpoint: all passed\n");
  return 0;
}
