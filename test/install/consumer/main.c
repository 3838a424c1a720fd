/* Loads a compiled AdamW step (f32 on the CPU) from an installed zopt, runs
 * one step over 1000 elements and checks the result against the first
 * AdamW step: p1 = p * (1 - lr*wd) - lr * g / (|g| + eps), with the
 * hyperparameters the step's description gave as defaults. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include <zopt/abi.h>
#include <zopt/comm.h>
#include <zopt/cpu.h>
#include <zopt/zopt.h>

#define N 1000

static int fail(const char *what, zopt_status s) {
  fprintf(stderr, "zopt_consumer: %s failed (%d): %s\n", what, (int)s, zopt_last_error());
  return 1;
}

int main(int argc, char **argv) {
  if (argc != 2) {
    fprintf(stderr, "usage: zopt_consumer step.so\n");
    return 2;
  }
  if (zopt_api_version() != ZOPT_API_VERSION) {
    fprintf(stderr, "zopt_consumer: runtime API %u, header %u\n", zopt_api_version(),
            ZOPT_API_VERSION);
    return 1;
  }
  zopt_step *step = NULL;
  zopt_optimizer *opt = NULL;
  zopt_status s;
  if ((s = zopt_step_load(argv[1], &step))) return fail("zopt_step_load", s);
  if ((s = zopt_optimizer_create(step, &opt))) return fail("zopt_optimizer_create", s);
  static float p[N], g[N], p0[N];
  for (int i = 0; i < N; ++i) {
    p[i] = p0[i] = 0.5f + (float)(i % 17) * 0.01f;
    g[i] = (i % 2 ? 1.0f : -1.0f) * (0.1f + (float)(i % 13) * 0.05f);
  }
  int group, tensor;
  if ((s = zopt_optimizer_add_group(opt, &group))) return fail("add_group", s);
  if ((s = zopt_optimizer_add_tensor(opt, group, p, g, N, ZOPT_DTYPE_F32, &tensor)))
    return fail("add_tensor", s);
  if ((s = zopt_optimizer_finalize(opt))) return fail("finalize", s);
  double lr, wd, eps;
  if ((s = zopt_optimizer_get_hyper(opt, group, "lr", &lr)) ||
      (s = zopt_optimizer_get_hyper(opt, group, "weight_decay", &wd)) ||
      (s = zopt_optimizer_get_hyper(opt, group, "eps", &eps)))
    return fail("get_hyper", s);
  zopt_step_result r;
  if ((s = zopt_optimizer_step(opt, &r))) return fail("zopt_optimizer_step", s);
  double worst = 0;
  for (int i = 0; i < N; ++i) {
    double want = p0[i] * (1 - lr * wd) - lr * g[i] / (fabs(g[i]) + eps);
    double err = fabs(p[i] - want) / (fabs(want) + 1e-30);
    if (err > worst) worst = err;
  }
  zopt_optimizer_free(opt);
  zopt_step_free(step);
  printf("zopt_consumer: one step of %d elements, lr %g, weight_decay %g: "
         "max relative error %.3g\n", N, lr, wd, worst);
  if (!(worst < 1e-6)) {
    fprintf(stderr, "zopt_consumer: the step is wrong\n");
    return 1;
  }
  return 0;
}
