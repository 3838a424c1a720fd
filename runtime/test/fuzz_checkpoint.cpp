// zopt-fuzz-checkpoint: libFuzzer over checkpoint loading (issue 10).
//
// One optimizer (the step in $ZOPT_FUZZ_STEP, three tensors in two groups,
// two steps taken so that every state is non-zero) is built once. Each input
// is written to a file and loaded into it, with and without
// ZOPT_LOAD_ALLOW_RULE_CHANGE (the input's length picks), and imported from
// memory (zopt_optimizer_import_state, validating only). The properties:
//   - the in-memory import accepts exactly what the file's load accepts,
//     except an image whose header flags say its pieces carry no checksums
//     (ZOPT_EXPORT_NO_CHECKSUMS): the file's load always refuses it, the
//     in-memory import reads it without checking the pieces' data;
//   - no crash, no sanitizer report, no leak (ASan + LeakSanitizer);
//   - a refused load leaves every state, step count, hyperparameter, loss
//     scale and tensor step bit-identical (a snapshot is compared);
//   - after a load that succeeds, a step runs, and loading the original
//     checkpoint back restores the snapshot exactly.
// $ZOPT_FUZZ_SEEDS=DIR writes seed checkpoints (the optimizer's own saves
// after 2 and 3 steps: format 3, and the first rewritten in format 2, which
// loads too) into DIR and exits. scripts/fuzz.sh builds and runs
// it (-DZOPT_ENABLE_FUZZER=ON).
#include "zopt/zopt.h"

#include "ckpt_test_util.h"

#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace {

const int64_t kSizes[3] = {5, 1000, 33};
const int kGroup[3] = {0, 1, 0};

struct Fixture {
  zopt_step *step = nullptr;
  zopt_optimizer *o = nullptr;
  const zopt_step_descriptor *d = nullptr;
  std::vector<std::vector<unsigned char>> p, g;
  size_t pes = 4, ges = 4;
  std::string input, original;
};
Fixture F;

[[noreturn]] void die(const char *what) {
  fprintf(stderr, "zopt-fuzz-checkpoint: %s: %s\n", what, zopt_last_error());
  abort();
}

size_t dsize(uint32_t dt) { return dt == ZOPT_DTYPE_F32 ? 4 : 2; }

// Everything a load may change, as bytes.
std::vector<unsigned char> snapshot() {
  std::vector<unsigned char> s;
  auto put = [&](const void *x, size_t n) {
    const unsigned char *c = (const unsigned char *)x;
    s.insert(s.end(), c, c + n);
  };
  for (int t = 0; t < 3; ++t) {
    for (uint32_t k = 0; k < F.d->num_states; ++k) {
      uint32_t kind = F.d->states[k].kind;
      if (kind == ZOPT_STATE_GRAD) continue;
      std::vector<unsigned char> b((size_t)kSizes[t] * dsize(F.d->states[k].dtype));
      if (zopt_optimizer_read_state_raw(F.o, t, (zopt_state_kind)kind, b.data(), b.size()) != ZOPT_OK)
        die("read_state_raw");
      put(b.data(), b.size());
    }
    int64_t ts = 0;
    if (zopt_optimizer_get_tensor_step(F.o, t, &ts) != ZOPT_OK) die("get_tensor_step");
    put(&ts, sizeof ts);
  }
  for (int gi = 0; gi < 2; ++gi) {
    int64_t c = 0;
    if (zopt_optimizer_get_step_count(F.o, gi, &c) != ZOPT_OK) die("get_step_count");
    put(&c, sizeof c);
    static const char *const kNames[] = {"lr", "beta1", "beta2", "eps", "weight_decay",
                                         "momentum", "dampening", "bias_correction"};
    for (const char *name : kNames) {
      double v = 0;
      if (zopt_optimizer_get_hyper(F.o, gi, name, &v) == ZOPT_OK) put(&v, sizeof v);
    }
  }
  double S = 0;
  zopt_optimizer_get_loss_scale(F.o, &S);
  put(&S, sizeof S);
  return s;
}

void fill_grads(int k) {
  for (int t = 0; t < 3; ++t)
    for (int64_t i = 0; i < kSizes[t]; ++i) {
      float v = (float)(0.01 * std::sin(1.0 + k * 7.0 + t * 13.0 + (double)i));
      if (F.ges == 4) {
        memcpy(F.g[t].data() + i * 4, &v, 4);
      } else {  // bf16/f16 grads: a small exactly representable value
        uint16_t h = F.d->states[1].dtype == ZOPT_DTYPE_BF16 ? 0x3c00 : 0x1800;
        memcpy(F.g[t].data() + i * 2, &h, 2);
      }
    }
}

void take_steps(int n) {
  for (int k = 0; k < n; ++k) {
    fill_grads(k);
    if (zopt_optimizer_step(F.o, nullptr) != ZOPT_OK) die("step");
  }
}

void setup() {
  const char *path = getenv("ZOPT_FUZZ_STEP");
  if (!path) {
    fprintf(stderr, "zopt-fuzz-checkpoint: set ZOPT_FUZZ_STEP to a compiled step.so\n");
    exit(2);
  }
  if (zopt_step_load(path, &F.step) != ZOPT_OK) die("step_load");
  F.d = zopt_step_get_descriptor(F.step);
  for (uint32_t k = 0; k < F.d->num_states; ++k) {
    if (F.d->states[k].kind == ZOPT_STATE_PARAM) F.pes = dsize(F.d->states[k].dtype);
    if (F.d->states[k].kind == ZOPT_STATE_GRAD) F.ges = dsize(F.d->states[k].dtype);
  }
  if (zopt_optimizer_create(F.step, &F.o) != ZOPT_OK) die("create");
  zopt_optimizer_set_num_threads(F.o, 1);
  int id = 0;
  zopt_optimizer_add_group(F.o, &id);
  zopt_optimizer_add_group(F.o, &id);
  uint32_t pdt = ZOPT_DTYPE_F32;
  for (uint32_t k = 0; k < F.d->num_states; ++k)
    if (F.d->states[k].kind == ZOPT_STATE_PARAM) pdt = F.d->states[k].dtype;
  F.p.resize(3);
  F.g.resize(3);
  for (int t = 0; t < 3; ++t) {
    F.p[t].assign((size_t)kSizes[t] * F.pes, 0);
    F.g[t].assign((size_t)kSizes[t] * F.ges, 0);
    for (int64_t i = 0; i < kSizes[t]; ++i) {  // params 0.5 + small (any dtype: f32 bits or 16-bit 0x3800)
      if (F.pes == 4) {
        float v = 0.5f + 0.001f * (float)i;
        memcpy(F.p[t].data() + i * 4, &v, 4);
      } else {
        uint16_t h = (uint16_t)(0x3800 + (i & 7));
        memcpy(F.p[t].data() + i * 2, &h, 2);
      }
    }
    if (zopt_optimizer_add_tensor(F.o, kGroup[t], F.p[t].data(), F.g[t].data(), kSizes[t], (zopt_dtype)pdt, &id) !=
        ZOPT_OK)
      die("add_tensor");
  }
  if (zopt_optimizer_finalize(F.o) != ZOPT_OK) die("finalize");
  zopt_optimizer_set_hyper(F.o, 1, "lr", 3e-3);
  take_steps(2);
  const char *tmp = getenv("TMPDIR");
  std::string dir = tmp ? tmp : "/tmp";
  F.input = dir + "/zopt-fuzz-ck-" + std::to_string(getpid()) + ".in";
  F.original = dir + "/zopt-fuzz-ck-" + std::to_string(getpid()) + ".orig";
  if (const char *seeds = getenv("ZOPT_FUZZ_SEEDS")) {
    std::string a = std::string(seeds) + "/seed-2-steps", b = std::string(seeds) + "/seed-3-steps";
    if (zopt_optimizer_save(F.o, a.c_str()) != ZOPT_OK) die("save seed");
    if (!ckt::spit(a + "-format2", ckt::to_format2(ckt::slurp(a)))) die("write the format-2 seed");
    take_steps(1);
    if (zopt_optimizer_save(F.o, b.c_str()) != ZOPT_OK) die("save seed");
    exit(0);
  }
  if (zopt_optimizer_save(F.o, F.original.c_str()) != ZOPT_OK) die("save original");
  atexit([] {
    unlink(F.input.c_str());
    unlink(F.original.c_str());
    zopt_optimizer_free(F.o);
    zopt_step_free(F.step);
  });
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int *, char ***) {
  setup();
  return 0;
}

// FNV-1a-64 (docs/CHECKPOINT.md).
uint64_t fnv(const uint8_t *p, size_t n) {
  uint64_t h = 14695981039346656037ull;
  for (size_t i = 0; i < n; ++i) h = (h ^ p[i]) * 1099511628211ull;
  return h;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  // Half of the inputs get their header checksum recomputed, so that
  // mutations of the header's fields reach the checks behind it (sizes,
  // groups, tensors, hyperparameters, piece tables) instead of all stopping
  // at the checksum.
  std::vector<uint8_t> buf(data, data + size);
  if ((size >> 1) & 1 && size >= 24) {
    uint64_t H;
    memcpy(&H, buf.data() + 16, 8);
    if (H >= 24 && H <= size - 8) {
      uint64_t c = fnv(buf.data(), (size_t)H);
      memcpy(buf.data() + H, &c, 8);
    }
  }
  FILE *f = fopen(F.input.c_str(), "wb");
  if (!f) die("cannot write the input file");
  if (size && fwrite(buf.data(), 1, size, f) != size) die("short write");
  fclose(f);
  const std::vector<unsigned char> before = snapshot();
  const uint32_t flags = (size & 1) ? ZOPT_LOAD_ALLOW_RULE_CHANGE : 0;
  // The same bytes in memory (zopt_optimizer_import_state, every check and
  // nothing applied): the same reader, so the same verdict as the file's.
  const zopt_status mem = zopt_optimizer_import_state(F.o, buf.data(), buf.size(), flags | ZOPT_LOAD_VALIDATE_ONLY);
  if (snapshot() != before) {
    fprintf(stderr, "zopt-fuzz-checkpoint: a validating in-memory import changed the optimizer's state\n");
    abort();
  }
  const zopt_status file = zopt_optimizer_load_ex(F.o, F.input.c_str(), flags);
  uint32_t hflags = 0;
  if (size >= 16) memcpy(&hflags, buf.data() + 12, 4);
  if (size >= 16 && memcmp(buf.data(), "ZOPTCKP2", 8) == 0 && hflags == 1) {  // no piece checksums
    if (file == ZOPT_OK) {
      fprintf(stderr, "zopt-fuzz-checkpoint: a file without piece checksums was loaded\n");
      abort();
    }
  } else if ((mem == ZOPT_OK) != (file == ZOPT_OK)) {
    fprintf(stderr, "zopt-fuzz-checkpoint: the in-memory import says %d, the file's load %d\n", (int)mem, (int)file);
    abort();
  }
  if (file != ZOPT_OK) {
    if (snapshot() != before) {
      fprintf(stderr, "zopt-fuzz-checkpoint: a refused load changed the optimizer's state\n");
      abort();
    }
    return 0;
  }
  // Accepted: a step runs on what was loaded; the original restores exactly
  // (the params in user memory are the model's to restore, as a model
  // checkpoint would).
  const std::vector<std::vector<unsigned char>> params = F.p;
  fill_grads(5);
  zopt_step_result r;
  if (zopt_optimizer_step(F.o, &r) != ZOPT_OK) die("step after an accepted load");
  for (int t = 0; t < 3; ++t) memcpy(F.p[t].data(), params[t].data(), params[t].size());
  if (zopt_optimizer_load(F.o, F.original.c_str()) != ZOPT_OK) die("reloading the original");
  if (snapshot() != before) {
    fprintf(stderr, "zopt-fuzz-checkpoint: reloading the original checkpoint did not restore the state\n");
    abort();
  }
  return 0;
}
