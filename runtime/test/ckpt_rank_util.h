// ckpt_rank_util.h - the harness of the multi-rank checkpoint checks,
// zopt-ckpt-check (ckpt_check.cpp) and zopt-ckpt-linked-check
// (ckpt_linked_check.cpp): PASS/FAIL lines and their counts, W ranks as
// loopback threads, each rank's outcome of a call, the files a save left,
// and the command line (step.so paths, --world=W, --dir=DIR).
#ifndef ZOPT_CKPT_RANK_UTIL_H
#define ZOPT_CKPT_RANK_UTIL_H

#include "rank_test_util.h"

#include "zopt/comm.h"
#include "zopt/zopt.h"

#include <dirent.h>

#include <algorithm>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <mutex>
#include <string>
#include <vector>

namespace ckr {

inline int g_world = 2;
inline std::mutex g_mu;
inline int g_fail = 0, g_pass = 0;

// One PASS or FAIL line (RANK_CK's too), counted.
inline void report(bool ok, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
inline void report(bool ok, const char *fmt, ...) {
  char m[2048];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(m, sizeof m, fmt, ap);
  va_end(ap);
  std::lock_guard<std::mutex> lk(g_mu);
  (ok ? g_pass : g_fail)++;
  printf("%s %s\n", ok ? "PASS" : "FAIL", m);
  fflush(stdout);
}

// A rank's status and message of one call.
struct Outcome {
  zopt_status st = ZOPT_OK;
  std::string msg;
};

// Runs fn(rank, comm) on W fresh loopback ranks.
inline void on_ranks(const std::function<void(int, zopt_comm *)> &fn) {
  if (!rtu::on_ranks(g_world, 20, false, fn)) report(false, "loopback: %s", zopt_last_error());
}

// The file names in `dir` that start with `base`, sorted.
inline std::vector<std::string> files_of(const std::string &dir, const std::string &base) {
  std::vector<std::string> out;
  if (DIR *d = opendir(dir.c_str())) {
    while (struct dirent *e = readdir(d))
      if (strncmp(e->d_name, base.c_str(), base.size()) == 0) out.push_back(e->d_name);
    closedir(d);
  }
  std::sort(out.begin(), out.end());
  return out;
}

// `prog STEP.so... --world=W --dir=DIR` with `nsteps` step.so paths into
// steps[0..nsteps); false (after a message on stderr: exit status 2) on an
// unknown argument or a missing one.
inline bool parse_args(int argc, char **argv, const char *prog, const char *usage, std::string *steps, int nsteps,
                       std::string *dir) {
  int got = 0;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a.rfind("--world=", 0) == 0) g_world = atoi(a.c_str() + 8);
    else if (a.rfind("--dir=", 0) == 0) *dir = a.substr(6);
    else if (a[0] != '-' && got < nsteps) steps[got++] = a;
    else {
      fprintf(stderr, "%s: unknown argument '%s'\n", prog, a.c_str());
      return false;
    }
  }
  if (got != nsteps || dir->empty() || g_world < 1) {
    fprintf(stderr, "usage: %s %s --world=W --dir=DIR\n", prog, usage);
    return false;
  }
  return true;
}

// The last line and the exit status.
inline int summary() {
  printf("%d passed, %d failed\n", g_pass, g_fail);
  return g_fail ? 1 : 0;
}

}  // namespace ckr

#endif
