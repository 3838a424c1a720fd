/* test_util.h - tiny assertion helpers shared by the runtime tests (C/C++). */
#ifndef ZOPT_TEST_UTIL_H
#define ZOPT_TEST_UTIL_H

#include "zopt/zopt.h"

#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define ZT_SKIP 77 /* ctest SKIP_RETURN_CODE */

static int zt_failures = 0;

#define ZT_CHECK(cond)                                                     \
  do {                                                                     \
    if (!(cond)) {                                                         \
      fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond); \
      zt_failures++;                                                       \
    }                                                                      \
  } while (0)

#define ZT_OK(call)                                                        \
  do {                                                                     \
    zopt_status zt_st_ = (call);                                           \
    if (zt_st_ != ZOPT_OK) {                                               \
      fprintf(stderr, "%s:%d: %s -> %d: %s\n", __FILE__, __LINE__, #call,  \
              (int)zt_st_, zopt_last_error());                             \
      zt_failures++;                                                       \
    }                                                                      \
  } while (0)

/* Asserts the status code and that a non-empty message was set. */
#define ZT_ERR(call, code)                                                 \
  do {                                                                     \
    zopt_status zt_st_ = (call);                                           \
    const char *zt_m_ = zopt_last_error();                                 \
    if (zt_st_ != (code) || !zt_m_ || !zt_m_[0]) {                         \
      fprintf(stderr, "%s:%d: %s -> %d (want %d), message '%s'\n",         \
              __FILE__, __LINE__, #call, (int)zt_st_, (int)(code),         \
              zt_m_ ? zt_m_ : "(null)");                                   \
      zt_failures++;                                                       \
    } else if (getenv("ZT_VERBOSE")) {                                     \
      printf("  ok %-60.60s -> %d: %s\n", #call, (int)zt_st_, zt_m_);      \
    }                                                                      \
  } while (0)

/* Collects the step .so paths named by argv[1..] or $ZOPT_TEST_STEP; a
 * directory argument contributes every *.so file in it. Returns the count. */
static int zt_collect_steps(int argc, char **argv, char paths[][4096], int max) {
  int n = 0;
  const char *env = getenv("ZOPT_TEST_STEP");
  int na = argc - 1;
  for (int i = 0; i <= na && n < max; ++i) {
    const char *a = i < na ? argv[i + 1] : env;
    if (!a || !*a) continue;
    if (i == na && na > 0) break; /* argv wins over the environment */
    DIR *dir = opendir(a);
    if (dir) {
      struct dirent *e;
      while ((e = readdir(dir)) != NULL && n < max) {
        size_t l = strlen(e->d_name);
        if (l > 3 && strcmp(e->d_name + l - 3, ".so") == 0)
          snprintf(paths[n++], 4096, "%s/%s", a, e->d_name);
      }
      closedir(dir);
    } else {
      snprintf(paths[n++], 4096, "%s", a);
    }
  }
  /* deterministic order */
  for (int i = 0; i < n; ++i)
    for (int j = i + 1; j < n; ++j)
      if (strcmp(paths[i], paths[j]) > 0) {
        char t[4096];
        memcpy(t, paths[i], 4096);
        memcpy(paths[i], paths[j], 4096);
        memcpy(paths[j], t, 4096);
      }
  return n;
}

#endif
