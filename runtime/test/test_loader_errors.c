/* Loader error paths: foreign, broken, truncated and missing step files.
 * argv[1]: directory holding the fixture libraries (fx_*.so). */
#include "test_util.h"

#include <stdlib.h>
#include <unistd.h>

static char fxdir[4096];

static const char *fx(const char *name) {
  static char p[4200];
  snprintf(p, sizeof p, "%s/%s.so", fxdir, name);
  return p;
}

static void expect_load_fails(const char *name, zopt_status code, const char *needle) {
  zopt_step *s = (zopt_step *)1;
  zopt_status st = zopt_step_load(fx(name), &s);
  const char *m = zopt_last_error();
  if (st != code || s != NULL || !m[0] || (needle && !strstr(m, needle))) {
    fprintf(stderr, "fixture %s: status %d (want %d), step %p, message '%s' (want '%s')\n", name, (int)st,
            (int)code, (void *)s, m, needle ? needle : "");
    zt_failures++;
  } else {
    printf("  %-16s -> %d: %s\n", name, (int)st, m);
  }
}

int main(int argc, char **argv) {
  if (argc < 2) {
    fprintf(stderr, "usage: %s FIXTURE_DIR\n", argv[0]);
    return 2;
  }
  snprintf(fxdir, sizeof fxdir, "%s", argv[1]);
  unsetenv("ZOPT_CPU");

  ZT_CHECK(zopt_api_version() == ZOPT_API_VERSION);
  ZT_CHECK(zopt_abi_version() == ZOPT_ABI_VERSION);

  /* null pointers */
  zopt_step *s = NULL;
  ZT_ERR(zopt_step_load(NULL, &s), ZOPT_ERR_INVALID_ARGUMENT);
  ZT_ERR(zopt_step_load(fx("fx_gpustate"), NULL), ZOPT_ERR_INVALID_ARGUMENT);
  ZT_ERR(zopt_step_load("", &s), ZOPT_ERR_INVALID_ARGUMENT);
  zopt_optimizer *o = NULL;
  ZT_ERR(zopt_optimizer_create(NULL, &o), ZOPT_ERR_INVALID_ARGUMENT);
  ZT_CHECK(zopt_step_get_descriptor(NULL) == NULL);
  zopt_step_free(NULL);   /* no-op */
  zopt_optimizer_free(NULL);
  ZT_ERR(zopt_optimizer_step(NULL, NULL), ZOPT_ERR_INVALID_ARGUMENT);
  ZT_ERR(zopt_optimizer_save(NULL, "/tmp/x"), ZOPT_ERR_INVALID_ARGUMENT);
  ZT_ERR(zopt_optimizer_load(NULL, "/tmp/x"), ZOPT_ERR_INVALID_ARGUMENT);

  /* missing file, directory */
  ZT_ERR(zopt_step_load("/nonexistent/dir/step.so", &s), ZOPT_ERR_IO);
  ZT_ERR(zopt_step_load("/tmp", &s), ZOPT_ERR_IO);

  /* broken descriptors */
  expect_load_fails("fx_nodesc", ZOPT_ERR_ABI, "not a zopt step (no zopt_step_descriptor symbol)");
  expect_load_fails("fx_smalldesc", ZOPT_ERR_ABI, "bytes");
  expect_load_fails("fx_badmagic", ZOPT_ERR_ABI, "magic");
  expect_load_fails("fx_badversion", ZOPT_ERR_ABI, "this runtime reads ABI version");
  /* a step.so of the previous ABI (before CONTROL): recompile it */
  expect_load_fails("fx_oldversion", ZOPT_ERR_ABI, "recompile the step");
  expect_load_fails("fx_nocontrol", ZOPT_ERR_ABI, "no CPU CONTROL kernel (compiled by an older zopt-compile? recompile");
  expect_load_fails("fx_badchecksum", ZOPT_ERR_ABI, "checksum");
  expect_load_fails("fx_badenum", ZOPT_ERR_ABI, "dtype 9");
  expect_load_fails("fx_twoparams", ZOPT_ERR_ABI, "param");
  expect_load_fails("fx_missingsym", ZOPT_ERR_ABI, "fx_no_such_kernel");
  expect_load_fails("fx_unterminated", ZOPT_ERR_ABI, "NUL");
  expect_load_fails("fx_toomany", ZOPT_ERR_ABI, "num_states");
  expect_load_fails("fx_badprogram", ZOPT_ERR_ABI, "program op 1: range 7");
  expect_load_fails("fx_unknownflag", ZOPT_ERR_ABI, "unknown flags 0x100");
  expect_load_fails("fx_rulenotstated", ZOPT_ERR_ABI, "rule flags 0x10 without RULE_STATED");
  /* a Kahan compensation beside an f32 param */
  expect_load_fails("fx_kahanf32", ZOPT_ERR_ABI,
                    "state 2 (kahan_comp): a Kahan compensation is bf16, zero-initialized, read and written, "
                    "beside a written bf16 param on its placement, in a step without a master");

  /* q8 moments on the GPU: only behind the experimental gate (docs/GPU.md
     "q8 moments on the GPU"), unset here; a moment comes with its absmax */
  unsetenv("ZOPT_EXPERIMENTAL_GPU_Q8");
  expect_load_fails("fx_q8gpu", ZOPT_ERR_UNSUPPORTED,
                    "has q8 moments and runs on the GPU (a q8 state or a kernel placed there: the CUDA "
                    "backend): its q8 kernels have not yet been checked bit for bit against the CPU's on a real "
                    "GPU, so the CUDA backend takes such a step only with ZOPT_EXPERIMENTAL_GPU_Q8=1");
  expect_load_fails("fx_q8cuda", ZOPT_ERR_UNSUPPORTED,
                    "has q8 moments and runs on the GPU (a q8 state or a kernel placed there: the CUDA "
                    "backend): its q8 kernels have not yet been checked bit for bit against the CPU's on a real "
                    "GPU, so the CUDA backend takes such a step only with ZOPT_EXPERIMENTAL_GPU_Q8=1");
  expect_load_fails("fx_q8pair", ZOPT_ERR_ABI,
                    "state 2 (exp_avg): a q8 moment and its absmax come in pairs of the same placement, access, "
                    "init and partitioning (abi.h \"q8 moments\"); exp_avg_absmax is missing");

  /* truncated copy of a real shared library, and a text file */
  {
    char tpath[] = "/tmp/zopt_trunc_XXXXXX";
    int fd = mkstemp(tpath);
    FILE *in = fopen(fx("fx_gpustate"), "rb");
    ZT_CHECK(fd >= 0 && in);
    if (fd >= 0 && in) {
      char buf[700];
      size_t k = fread(buf, 1, sizeof buf, in);
      ZT_CHECK(write(fd, buf, k) == (ssize_t)k);
      close(fd);
      ZT_ERR(zopt_step_load(tpath, &s), ZOPT_ERR_ABI);
      printf("  truncated        -> %s\n", zopt_last_error());
      FILE *t = fopen(tpath, "w");
      fputs("this is not an ELF file\n", t);
      fclose(t);
      ZT_ERR(zopt_step_load(tpath, &s), ZOPT_ERR_ABI);
      printf("  text file        -> %s\n", zopt_last_error());
      unlink(tpath);
    }
    if (in) fclose(in);
  }

  /* a loadable descriptor with only the param on the GPU (no GPU code, not
   * an offload: the grad is on the CPU): create refuses */
  ZT_OK(zopt_step_load(fx("fx_gpustate"), &s));
  if (s) {
    ZT_CHECK(zopt_step_get_descriptor(s) != NULL);
    ZT_ERR(zopt_optimizer_create(s, NULL), ZOPT_ERR_INVALID_ARGUMENT);
    o = (zopt_optimizer *)1;
    ZT_ERR(zopt_optimizer_create(s, &o), ZOPT_ERR_UNSUPPORTED);
    ZT_CHECK(o == NULL);
    ZT_CHECK(strstr(zopt_last_error(), "offload needs both param and grad on the GPU") != NULL);
    zopt_step_free(s);
  }

  /* ZOPT_CPU override */
  setenv("ZOPT_CPU", "sparc", 1);
  ZT_ERR(zopt_step_load(fx("fx_gpustate"), &s), ZOPT_ERR_INVALID_ARGUMENT);
  setenv("ZOPT_CPU", "none", 1);
  ZT_OK(zopt_step_load(fx("fx_gpustate"), &s));
  if (s) {
    ZT_CHECK(zopt_step_isa(s) == ZOPT_ISA_NONE);
    zopt_step_free(s);
  }
  unsetenv("ZOPT_CPU");

  if (zt_failures) {
    fprintf(stderr, "%d failure(s)\n", zt_failures);
    return 1;
  }
  printf("test_loader_errors: all passed\n");
  return 0;
}
