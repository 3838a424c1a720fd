/* API misuse and corrupt/mismatched checkpoints against a compiled step.
 * Steps: argv[1..] (files or directories of *.so) or $ZOPT_TEST_STEP.
 * Without any step the test is skipped (exit 77). */
#include "test_util.h"

#include <math.h>
#include <unistd.h>

typedef struct snapshot {
  unsigned char *bytes;
  size_t n;
} snapshot;

/* Everything load() may change: owned states (raw), step counts, hypers,
 * loss scale. */
static snapshot take(const zopt_optimizer *o, const zopt_step_descriptor *d, int ntensors, int ngroups,
                     const int64_t *numel) {
  snapshot s = {NULL, 0};
  size_t cap = 1 << 16;
  s.bytes = (unsigned char *)malloc(cap);
  for (int t = 0; t < ntensors; ++t) {
    for (uint32_t k = 0; k < d->num_states; ++k) {
      uint32_t kind = d->states[k].kind;
      if (kind == ZOPT_STATE_PARAM || kind == ZOPT_STATE_GRAD) continue;
      size_t bytes = (size_t)numel[t] * (d->states[k].dtype == ZOPT_DTYPE_F32 ? 4 : 2);
      while (s.n + bytes + 1024 > cap) s.bytes = (unsigned char *)realloc(s.bytes, cap *= 2);
      memset(s.bytes + s.n, 0, bytes);
      zopt_optimizer_read_state_raw(o, t, (zopt_state_kind)kind, s.bytes + s.n, bytes);
      s.n += bytes;
    }
  }
  for (int g = 0; g < ngroups; ++g) {
    int64_t c = -1;
    zopt_optimizer_get_step_count(o, g, &c);
    memcpy(s.bytes + s.n, &c, 8);
    s.n += 8;
    static const char *names[] = {"lr", "beta1", "beta2", "eps", "weight_decay", "momentum", "dampening",
                                  "bias_correction"};
    for (int h = 0; h < 8; ++h) {
      double v = -12345;
      zopt_optimizer_get_hyper(o, g, names[h], &v);
      memcpy(s.bytes + s.n, &v, 8);
      s.n += 8;
    }
  }
  double ls = 0;
  zopt_optimizer_get_loss_scale(o, &ls);
  memcpy(s.bytes + s.n, &ls, 8);
  s.n += 8;
  return s;
}

static int same(snapshot a, snapshot b) { return a.n == b.n && memcmp(a.bytes, b.bytes, a.n) == 0; }

static size_t elem_size(uint32_t dt) { return dt == ZOPT_DTYPE_F32 ? 4 : 2; }

static void fill(void *p, uint32_t dt, int64_t n, float base) {
  for (int64_t i = 0; i < n; ++i) {
    float v = base * (float)((i % 17) - 8) / 8.0f;
    if (dt == ZOPT_DTYPE_F32) {
      ((float *)p)[i] = v;
    } else {
      /* exact small values: k/8 fit both bf16 and f16 */
      uint32_t u;
      memcpy(&u, &v, 4);
      if (dt == ZOPT_DTYPE_BF16) {
        ((uint16_t *)p)[i] = (uint16_t)(u >> 16);
      } else {
        /* f16 of k/8*base with base = 0.5 or 0.25: build via simple table */
        float a = fabsf(v);
        uint16_t h = 0;
        if (a != 0) {
          int e;
          float m = frexpf(a, &e); /* a = m * 2^e, m in [0.5,1) */
          h = (uint16_t)(((e - 1 + 15) << 10) | (uint16_t)((m * 2 - 1) * 1024));
        }
        if (v < 0) h |= 0x8000;
        ((uint16_t *)p)[i] = h;
      }
    }
  }
}

static void flip_byte(const char *path, long off) {
  FILE *f = fopen(path, "r+b");
  if (!f) return;
  fseek(f, 0, SEEK_END);
  long n = ftell(f);
  if (off < 0) off += n;
  fseek(f, off, SEEK_SET);
  int c = fgetc(f);
  fseek(f, off, SEEK_SET);
  fputc(c ^ 0x5a, f);
  fclose(f);
}

static void truncate_copy(const char *src, const char *dst, long keep_from_end) {
  FILE *f = fopen(src, "rb");
  FILE *g = fopen(dst, "wb");
  if (!f || !g) return;
  fseek(f, 0, SEEK_END);
  long n = ftell(f);
  fseek(f, 0, SEEK_SET);
  long want = n - keep_from_end;
  for (long i = 0; i < want; ++i) fputc(fgetc(f), g);
  fclose(f);
  fclose(g);
}

static void run_step(const char *path) {
  printf("== %s\n", path);
  zopt_step *step = NULL;
  /* ZOPT_CPU=none: compiled CPU steps have no baseline variants (zopt.h). */
  const char *was = getenv("ZOPT_CPU");
  char saved[64] = "";
  if (was) snprintf(saved, sizeof saved, "%s", was);
  setenv("ZOPT_CPU", "none", 1);
  ZT_ERR(zopt_step_load(path, &step), ZOPT_ERR_UNSUPPORTED);
  ZT_CHECK(step == NULL && strstr(zopt_last_error(), "no UPDATE kernel variant runs") != NULL);
  if (was) setenv("ZOPT_CPU", saved, 1);
  else unsetenv("ZOPT_CPU");
  ZT_OK(zopt_step_load(path, &step));
  if (!step) return;
  const zopt_step_descriptor *d = zopt_step_get_descriptor(step);
  uint32_t pdt = 0, gdt = 0;
  for (uint32_t i = 0; i < d->num_states; ++i) {
    if (d->states[i].kind == ZOPT_STATE_PARAM) pdt = d->states[i].dtype;
    if (d->states[i].kind == ZOPT_STATE_GRAD) gdt = d->states[i].dtype;
  }
  enum { NT = 3 };
  const int64_t numel[NT] = {1000, 77, 4096 + 3};
  void *p[NT], *g[NT];
  for (int t = 0; t < NT; ++t) {
    p[t] = calloc((size_t)numel[t], elem_size(pdt));
    g[t] = calloc((size_t)numel[t], elem_size(gdt));
    fill(p[t], pdt, numel[t], 0.5f);
    fill(g[t], gdt, numel[t], 0.25f);
  }

  zopt_optimizer *o = NULL;
  for (uint32_t i = 0; i < d->num_states; ++i)
    if (d->states[i].placement == ZOPT_PLACE_GPU) {
      /* Without a CUDA driver create refuses the step; with one (a GPU
         machine, or ZOPT_CUDA_DRIVER naming the stand-in) it succeeds, and
         these host-memory tensors are not for it: skipped either way. */
      if (zopt_optimizer_create(step, &o) == ZOPT_OK) {
        printf("  GPU-placed state: a CUDA driver is present; host-memory tensors are not this step's "
               "(rest skipped)\n");
        zopt_optimizer_free(o);
      } else {
        ZT_ERR(zopt_optimizer_create(step, &o), ZOPT_ERR_UNSUPPORTED);
        printf("  GPU-placed state: %s (rest skipped)\n", zopt_last_error());
      }
      zopt_step_free(step);
      for (int t = 0; t < NT; ++t) free(p[t]), free(g[t]);
      return;
    }
  ZT_OK(zopt_optimizer_create(step, &o));
  if (!o) {
    zopt_step_free(step);
    for (int t = 0; t < NT; ++t) free(p[t]), free(g[t]);
    return;
  }
  zopt_step_free(step); /* the optimizer keeps its step alive */
  int g0 = -1, g1 = -1, tid = -1;
  ZT_ERR(zopt_optimizer_add_group(o, NULL), ZOPT_ERR_INVALID_ARGUMENT);
  ZT_OK(zopt_optimizer_add_group(o, &g0));
  ZT_OK(zopt_optimizer_add_group(o, &g1));
  ZT_CHECK(g0 == 0 && g1 == 1);
  ZT_ERR(zopt_optimizer_set_num_threads(o, 0), ZOPT_ERR_INVALID_ARGUMENT);
  ZT_OK(zopt_optimizer_set_num_threads(o, 2));

  /* step/save/load/state access before finalize */
  zopt_step_result r;
  ZT_ERR(zopt_optimizer_step(o, &r), ZOPT_ERR_BAD_STATE);
  ZT_ERR(zopt_optimizer_save(o, "/tmp/zopt_never.ckpt"), ZOPT_ERR_BAD_STATE);
  ZT_ERR(zopt_optimizer_load(o, "/tmp/zopt_never.ckpt"), ZOPT_ERR_BAD_STATE);
  ZT_ERR(zopt_optimizer_finalize(o), ZOPT_ERR_BAD_STATE); /* no tensors */

  /* add_tensor validation */
  zopt_dtype other = pdt == ZOPT_DTYPE_F32 ? ZOPT_DTYPE_BF16 : ZOPT_DTYPE_F32;
  ZT_ERR(zopt_optimizer_add_tensor(o, g0, p[0], g[0], numel[0], other, &tid), ZOPT_ERR_INVALID_ARGUMENT);
  ZT_ERR(zopt_optimizer_add_tensor(o, g0, p[0], g[0], -5, (zopt_dtype)pdt, &tid), ZOPT_ERR_INVALID_ARGUMENT);
  ZT_ERR(zopt_optimizer_add_tensor(o, 7, p[0], g[0], numel[0], (zopt_dtype)pdt, &tid), ZOPT_ERR_INVALID_ARGUMENT);
  ZT_ERR(zopt_optimizer_add_tensor(o, -1, p[0], g[0], numel[0], (zopt_dtype)pdt, &tid), ZOPT_ERR_INVALID_ARGUMENT);
  ZT_ERR(zopt_optimizer_add_tensor(o, g0, NULL, g[0], numel[0], (zopt_dtype)pdt, &tid), ZOPT_ERR_INVALID_ARGUMENT);
  ZT_ERR(zopt_optimizer_add_tensor(o, g0, p[0], NULL, numel[0], (zopt_dtype)pdt, &tid), ZOPT_ERR_INVALID_ARGUMENT);
  ZT_ERR(zopt_optimizer_add_tensor(o, g0, p[0], g[0], numel[0], (zopt_dtype)pdt, NULL), ZOPT_ERR_INVALID_ARGUMENT);
  ZT_ERR(zopt_optimizer_add_tensor(NULL, g0, p[0], g[0], numel[0], (zopt_dtype)pdt, &tid), ZOPT_ERR_INVALID_ARGUMENT);
  ZT_OK(zopt_optimizer_add_tensor(o, g0, p[0], g[0], numel[0], (zopt_dtype)pdt, &tid));
  ZT_CHECK(tid == 0);
  ZT_ERR(zopt_optimizer_add_tensor(o, g1, p[0], g[1], numel[0], (zopt_dtype)pdt, &tid), ZOPT_ERR_INVALID_ARGUMENT);
  ZT_OK(zopt_optimizer_add_tensor(o, g1, p[1], g[1], numel[1], (zopt_dtype)pdt, &tid));
  ZT_OK(zopt_optimizer_add_tensor(o, g0, p[2], g[2], numel[2], (zopt_dtype)pdt, &tid));
  ZT_CHECK(tid == 2);

  /* hyperparameters */
  double v = 0;
  ZT_ERR(zopt_optimizer_set_hyper(o, g0, "learning_rate", 0.1), ZOPT_ERR_INVALID_ARGUMENT);
  ZT_ERR(zopt_optimizer_set_hyper(o, g0, NULL, 0.1), ZOPT_ERR_INVALID_ARGUMENT);
  ZT_ERR(zopt_optimizer_set_hyper(o, 9, "lr", 0.1), ZOPT_ERR_INVALID_ARGUMENT);
  ZT_ERR(zopt_optimizer_get_hyper(o, g0, "lr", NULL), ZOPT_ERR_INVALID_ARGUMENT);
  if (zopt_optimizer_get_hyper(o, g0, "lr", &v) == ZOPT_OK) {
    ZT_ERR(zopt_optimizer_set_hyper(o, g0, "lr", -1e-3), ZOPT_ERR_INVALID_ARGUMENT);
    ZT_ERR(zopt_optimizer_set_hyper(o, g0, "lr", NAN), ZOPT_ERR_INVALID_ARGUMENT);
    ZT_OK(zopt_optimizer_set_hyper(o, g0, "lr", 1e-2));
    ZT_OK(zopt_optimizer_get_hyper(o, g0, "lr", &v));
    ZT_CHECK(v == 1e-2);
  }
  if (zopt_optimizer_get_hyper(o, g0, "beta1", &v) == ZOPT_OK) {
    ZT_ERR(zopt_optimizer_set_hyper(o, g0, "beta1", 1.0), ZOPT_ERR_INVALID_ARGUMENT);
    printf("  beta1 = 1 -> %s\n", zopt_last_error());
    ZT_CHECK(strstr(zopt_last_error(), "beta1 = 1 out of range [0, 1)") != NULL);
  }
  /* a slot the step does not have */
  {
    static const char *names[] = {"lr", "beta1", "beta2", "eps", "weight_decay", "momentum", "dampening",
                                  "bias_correction"};
    for (int h = 0; h < 8; ++h)
      if (zopt_optimizer_get_hyper(o, g0, names[h], &v) != ZOPT_OK) {
        ZT_ERR(zopt_optimizer_set_hyper(o, g0, names[h], 0.5), ZOPT_ERR_INVALID_ARGUMENT);
        break;
      }
  }

  /* group flags (maximize) */
  {
    uint32_t f = 7;
    ZT_OK(zopt_optimizer_get_group_flags(o, g0, &f));
    ZT_CHECK(f == 0);
    ZT_ERR(zopt_optimizer_set_group_flags(o, g0, 2u), ZOPT_ERR_INVALID_ARGUMENT);
    ZT_CHECK(strstr(zopt_last_error(), "unknown bits") != NULL);
    ZT_ERR(zopt_optimizer_set_group_flags(o, 9, ZOPT_GROUP_MAXIMIZE), ZOPT_ERR_INVALID_ARGUMENT);
    ZT_ERR(zopt_optimizer_set_group_flags(o, -1, ZOPT_GROUP_MAXIMIZE), ZOPT_ERR_INVALID_ARGUMENT);
    ZT_ERR(zopt_optimizer_set_group_flags(NULL, g0, ZOPT_GROUP_MAXIMIZE), ZOPT_ERR_INVALID_ARGUMENT);
    ZT_ERR(zopt_optimizer_get_group_flags(o, g0, NULL), ZOPT_ERR_INVALID_ARGUMENT);
    ZT_ERR(zopt_optimizer_get_group_flags(o, 9, &f), ZOPT_ERR_INVALID_ARGUMENT);
    ZT_OK(zopt_optimizer_get_group_flags(o, g0, &f));
    ZT_CHECK(f == 0); /* a refused call changes nothing */
    ZT_OK(zopt_optimizer_set_group_flags(o, g1, ZOPT_GROUP_MAXIMIZE));
    ZT_OK(zopt_optimizer_get_group_flags(o, g1, &f));
    ZT_CHECK(f == ZOPT_GROUP_MAXIMIZE);
    ZT_OK(zopt_optimizer_get_group_flags(o, g0, &f));
    ZT_CHECK(f == 0);
    ZT_OK(zopt_optimizer_set_group_flags(o, g1, 0));
  }

  /* state access */
  float *buf = (float *)malloc(sizeof(float) * (size_t)numel[2]);
  ZT_OK(zopt_optimizer_read_state_f32(o, 0, ZOPT_STATE_PARAM, buf, numel[0])); /* user memory: fine */
  for (uint32_t i = 0; i < d->num_states; ++i)
    if (d->states[i].kind > ZOPT_STATE_GRAD) { /* first runtime-owned state */
      ZT_ERR(zopt_optimizer_read_state_f32(o, 0, (zopt_state_kind)d->states[i].kind, buf, numel[0]),
             ZOPT_ERR_BAD_STATE);
      break;
    }

  /* the state calls (issue 17) before finalize: nothing to export or import */
  {
    void *eb = NULL;
    size_t en = 0;
    zopt_state_import *imp = NULL;
    ZT_ERR(zopt_optimizer_export_state(o, &eb, &en, 0), ZOPT_ERR_BAD_STATE);
    ZT_CHECK(eb == NULL && en == 0);
    ZT_ERR(zopt_optimizer_import_state(o, buf, 64, 0), ZOPT_ERR_BAD_STATE);
    ZT_ERR(zopt_optimizer_import_begin(o, &imp), ZOPT_ERR_BAD_STATE);
    ZT_CHECK(imp == NULL);
    ZT_ERR(zopt_optimizer_export_state(NULL, &eb, &en, 0), ZOPT_ERR_INVALID_ARGUMENT);
    ZT_ERR(zopt_optimizer_export_state(o, NULL, &en, 0), ZOPT_ERR_INVALID_ARGUMENT);
    ZT_ERR(zopt_optimizer_import_begin(o, NULL), ZOPT_ERR_INVALID_ARGUMENT);
    ZT_ERR(zopt_state_import_commit(NULL), ZOPT_ERR_INVALID_ARGUMENT);
    zopt_state_import_abort(NULL); /* a no-op */
    zopt_state_buffer_free(NULL);
    /* add_tensors before finalize checks every entry first: nothing added */
    int grp[2] = {g0, 7};
    void *ps[2] = {p[1], p[2]}, *gs[2] = {g[1], g[2]};
    int64_t ns[2] = {numel[1], numel[2]};
    ZT_ERR(zopt_optimizer_add_tensors(o, 0, 2, grp, ps, gs, ns, (zopt_dtype)pdt, NULL, NULL),
           ZOPT_ERR_INVALID_ARGUMENT);
    ZT_ERR(zopt_optimizer_read_state_f32(o, 3, ZOPT_STATE_PARAM, buf, numel[1]), ZOPT_ERR_INVALID_ARGUMENT);
    ZT_ERR(zopt_optimizer_get_tensor_steps(o, 0, 4, (int64_t *)buf), ZOPT_ERR_INVALID_ARGUMENT);
  }

  ZT_OK(zopt_optimizer_finalize(o));
  ZT_ERR(zopt_optimizer_finalize(o), ZOPT_ERR_BAD_STATE);
  ZT_ERR(zopt_optimizer_add_group(o, &g1), ZOPT_ERR_BAD_STATE);
  ZT_ERR(zopt_optimizer_add_tensor(o, g0, p[1], g[1], numel[1], (zopt_dtype)pdt, &tid), ZOPT_ERR_BAD_STATE);

  ZT_ERR(zopt_optimizer_read_state_f32(o, 0, ZOPT_STATE_PARAM, buf, numel[0] + 1), ZOPT_ERR_INVALID_ARGUMENT);
  ZT_ERR(zopt_optimizer_read_state_f32(o, 5, ZOPT_STATE_PARAM, buf, numel[0]), ZOPT_ERR_INVALID_ARGUMENT);
  ZT_ERR(zopt_optimizer_read_state_f32(o, 0, (zopt_state_kind)99, buf, numel[0]), ZOPT_ERR_INVALID_ARGUMENT);
  ZT_ERR(zopt_optimizer_read_state_f32(o, 0, ZOPT_STATE_PARAM, NULL, numel[0]), ZOPT_ERR_INVALID_ARGUMENT);
  ZT_ERR(zopt_optimizer_read_state_raw(o, 0, ZOPT_STATE_PARAM, buf, 3), ZOPT_ERR_INVALID_ARGUMENT);
  ZT_ERR(zopt_optimizer_write_state_raw(o, 0, ZOPT_STATE_PARAM, buf, 3), ZOPT_ERR_INVALID_ARGUMENT);
  ZT_ERR(zopt_optimizer_get_step_count(o, 4, (int64_t *)buf), ZOPT_ERR_INVALID_ARGUMENT);
  ZT_ERR(zopt_optimizer_get_step_count(o, 0, NULL), ZOPT_ERR_INVALID_ARGUMENT);
  ZT_ERR(zopt_optimizer_memory_info(o, NULL), ZOPT_ERR_INVALID_ARGUMENT);
  ZT_ERR(zopt_optimizer_get_step_stats(o, NULL), ZOPT_ERR_INVALID_ARGUMENT);
  ZT_ERR(zopt_optimizer_get_step_stats(NULL, NULL), ZOPT_ERR_INVALID_ARGUMENT);
  {
    zopt_step_stats ss;
    memset(&ss, 0xff, sizeof ss);
    ZT_OK(zopt_optimizer_get_step_stats(o, &ss)); /* no step yet: every figure 0 */
    ZT_CHECK(ss.steps == 0 && ss.total_seconds == 0 && ss.d2h_bytes == 0 && ss.offloaded == 0);
  }
  /* bucket readiness and speculation are for offloaded steps (zopt.h) */
  ZT_ERR(zopt_optimizer_grad_bucket_ready(o, 0), ZOPT_ERR_UNSUPPORTED);
  ZT_CHECK(strstr(zopt_last_error(), "is not offloaded") != NULL);
  ZT_ERR(zopt_optimizer_set_speculation_budget(o, 1u << 20), ZOPT_ERR_UNSUPPORTED);
  ZT_ERR(zopt_optimizer_get_pipeline_stats(o, NULL), ZOPT_ERR_INVALID_ARGUMENT);
  {
    zopt_pipeline_stats ps;
    memset(&ps, 0xff, sizeof ps);
    ps.size = 0;
    ZT_ERR(zopt_optimizer_get_pipeline_stats(o, &ps), ZOPT_ERR_INVALID_ARGUMENT);
    ps.size = 16; /* an older caller's struct: only its bytes are written */
    ZT_OK(zopt_optimizer_get_pipeline_stats(o, &ps));
    ZT_CHECK(ps.size == 16 && ps.outcome == ZOPT_SPEC_NONE && ps.buckets == 0 && ps.speculated == 0 &&
             ps.committed == -1);
    ps.size = sizeof ps;
    ZT_OK(zopt_optimizer_get_pipeline_stats(o, &ps)); /* no pipelined step: every figure 0 */
    ZT_CHECK(ps.size == sizeof ps && ps.steps == 0 && ps.committed == 0 && ps.exposed_seconds == 0);
  }
  ZT_ERR(zopt_optimizer_get_loss_scale(o, NULL), ZOPT_ERR_INVALID_ARGUMENT);
  ZT_ERR(zopt_optimizer_configure_loss_scaler(o, NULL), ZOPT_ERR_INVALID_ARGUMENT);
  {
    zopt_loss_scaler_config c = {-1, 2, 0.5, 2000, 1, 1};
    ZT_ERR(zopt_optimizer_configure_loss_scaler(o, &c), ZOPT_ERR_INVALID_ARGUMENT);
    c.init_scale = 1024;
    c.backoff_factor = 1.5;
    ZT_ERR(zopt_optimizer_configure_loss_scaler(o, &c), ZOPT_ERR_INVALID_ARGUMENT);
  }
  zopt_memory_info mi;
  ZT_OK(zopt_optimizer_memory_info(o, &mi));
  ZT_CHECK(mi.num_params == (uint64_t)(numel[0] + numel[1] + numel[2]));
  ZT_CHECK(mi.bytes_cpu >= mi.num_params * (elem_size(pdt) + elem_size(gdt)));

  /* two steps, then a good checkpoint */
  ZT_OK(zopt_optimizer_step(o, &r));
  ZT_OK(zopt_optimizer_step(o, NULL));
  char ck[] = "/tmp/zopt_ckpt_XXXXXX";
  int fd = mkstemp(ck);
  close(fd);
  char bad[4200];
  snprintf(bad, sizeof bad, "%s.bad", ck);
  ZT_ERR(zopt_optimizer_save(o, "/nonexistent/dir/x.ckpt"), ZOPT_ERR_IO);
  ZT_OK(zopt_optimizer_save(o, ck));
  ZT_OK(zopt_optimizer_load(o, ck));
  ZT_OK(zopt_optimizer_step(o, NULL)); /* diverge from the file */
  snapshot before = take(o, d, NT, 2, numel);
  char msg[1024];

  /* missing file */
  ZT_ERR(zopt_optimizer_load(o, "/nonexistent/x.ckpt"), ZOPT_ERR_IO);
  /* corrupt: flip a byte in the header, in the data, in the trailer */
  long offs[] = {3, 40, 200, -100, -3};
  for (unsigned i = 0; i < sizeof offs / sizeof offs[0]; ++i) {
    truncate_copy(ck, bad, 0);
    flip_byte(bad, offs[i]);
    ZT_ERR(zopt_optimizer_load(o, bad), ZOPT_ERR_CHECKPOINT);
    snprintf(msg, sizeof msg, "%s", zopt_last_error());
    snapshot now = take(o, d, NT, 2, numel);
    ZT_CHECK(same(before, now));
    free(now.bytes);
  }
  printf("  corrupt -> %s\n", msg);
  /* truncated */
  long cuts[] = {1, 8, 64, 1000};
  for (unsigned i = 0; i < sizeof cuts / sizeof cuts[0]; ++i) {
    truncate_copy(ck, bad, cuts[i]);
    ZT_ERR(zopt_optimizer_load(o, bad), ZOPT_ERR_CHECKPOINT);
    snprintf(msg, sizeof msg, "%s", zopt_last_error());
    snapshot now = take(o, d, NT, 2, numel);
    ZT_CHECK(same(before, now));
    free(now.bytes);
  }
  printf("  truncated -> %s\n", msg);
  /* empty file */
  truncate_copy(ck, bad, 1L << 40);
  ZT_ERR(zopt_optimizer_load(o, bad), ZOPT_ERR_CHECKPOINT);

  /* mismatched: an optimizer with different tensor sizes / counts */
  {
    zopt_step *st2 = NULL;
    ZT_OK(zopt_step_load(path, &st2));
    zopt_optimizer *o2 = NULL;
    ZT_OK(zopt_optimizer_create(st2, &o2));
    zopt_step_free(st2);
    int a, b, t;
    ZT_OK(zopt_optimizer_add_group(o2, &a));
    ZT_OK(zopt_optimizer_add_group(o2, &b));
    ZT_OK(zopt_optimizer_add_tensor(o2, a, p[0], g[0], numel[0], (zopt_dtype)pdt, &t));
    ZT_OK(zopt_optimizer_add_tensor(o2, b, p[1], g[1], numel[1], (zopt_dtype)pdt, &t));
    ZT_OK(zopt_optimizer_add_tensor(o2, a, p[2], g[2], numel[2] - 1, (zopt_dtype)pdt, &t));
    ZT_OK(zopt_optimizer_finalize(o2));
    snapshot b2 = take(o2, d, NT, 2, numel);
    ZT_ERR(zopt_optimizer_load(o2, ck), ZOPT_ERR_CHECKPOINT);
    printf("  mismatched -> %s\n", zopt_last_error());
    /* (snapshot reads fail harmlessly for the shorter tensor; compare anyway) */
    snapshot n2 = take(o2, d, NT, 2, numel);
    ZT_CHECK(same(b2, n2));
    free(b2.bytes);
    free(n2.bytes);
    zopt_optimizer_free(o2);

    ZT_OK(zopt_step_load(path, &st2));
    ZT_OK(zopt_optimizer_create(st2, &o2));
    zopt_step_free(st2);
    ZT_OK(zopt_optimizer_add_group(o2, &a));
    ZT_OK(zopt_optimizer_add_tensor(o2, a, p[0], g[0], numel[0], (zopt_dtype)pdt, &t));
    ZT_OK(zopt_optimizer_finalize(o2));
    ZT_ERR(zopt_optimizer_load(o2, ck), ZOPT_ERR_CHECKPOINT);
    zopt_optimizer_free(o2);
  }

  /* the good file still loads */
  ZT_OK(zopt_optimizer_load(o, ck));
  int64_t cnt = -1;
  ZT_OK(zopt_optimizer_get_step_count(o, 0, &cnt));
  ZT_CHECK(cnt == 2);

  unlink(ck);
  unlink(bad);
  free(before.bytes);
  free(buf);
  zopt_optimizer_free(o);
  for (int t = 0; t < NT; ++t) {
    free(p[t]);
    free(g[t]);
  }
}

/* zopt_remainder_join_n / _split_n: bad arrays refused; split then join
 * gives every master back (a NaN as a NaN); the param is the master
 * rounded to nearest with ties away (abi.h "Remainder masters"). */
static void remainder_arrays(void) {
  const uint32_t bits[] = {0x3f800000u, 0x3f808000u, 0x3f818000u, 0xbf818000u, 0x3f80ffffu,
                           0x7f800000u, 0x7fc00001u, 0x00000001u, 0x80000000u, 0x4049ff00u};
  enum { N = sizeof bits / sizeof bits[0] };
  float m[N], back[N];
  uint16_t p[N];
  int16_t r[N];
  memcpy(m, bits, sizeof m);
  ZT_ERR(zopt_remainder_split_n(m, NULL, r, N), ZOPT_ERR_INVALID_ARGUMENT);
  ZT_ERR(zopt_remainder_join_n(p, r, NULL, 1), ZOPT_ERR_INVALID_ARGUMENT);
  ZT_ERR(zopt_remainder_join_n(p, r, back, -1), ZOPT_ERR_INVALID_ARGUMENT);
  ZT_OK(zopt_remainder_split_n(NULL, NULL, NULL, 0));
  ZT_OK(zopt_remainder_split_n(m, p, r, N));
  ZT_OK(zopt_remainder_join_n(p, r, back, N));
  for (int i = 0; i < N; ++i) {
    uint32_t b;
    memcpy(&b, &back[i], 4);
    if (isnan(m[i]))
      ZT_CHECK(isnan(back[i]));
    else
      ZT_CHECK(b == bits[i]);
  }
  ZT_CHECK(p[0] == 0x3f80 && r[0] == 0);
  ZT_CHECK(p[1] == 0x3f81 && r[1] == (int16_t)0x8000); /* a tie, even high half: away (RNE would keep 0x3f80) */
  ZT_CHECK(p[2] == 0x3f82);                            /* a tie, odd high half: away */
  ZT_CHECK(p[3] == 0xbf82);                            /* away from zero on the negative side */
  ZT_CHECK(p[4] == 0x3f81);                            /* above the tie: up */
}

int main(int argc, char **argv) {
  static char paths[64][4096];
  remainder_arrays();
  int n = zt_collect_steps(argc, argv, paths, 64);
  if (n == 0) {
    if (zt_failures) return 1;
    printf("test_api_errors: no compiled step given (argv or ZOPT_TEST_STEP): skipped\n");
    return ZT_SKIP;
  }
  for (int i = 0; i < n; ++i) run_step(paths[i]);
  if (zt_failures) {
    fprintf(stderr, "%d failure(s)\n", zt_failures);
    return 1;
  }
  printf("test_api_errors: all passed (%d step(s))\n", n);
  return 0;
}
