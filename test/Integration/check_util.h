//===- check_util.h - PASS/FAIL lines and API error exits for test drivers -===//
//
// Shared by zopt-gpu-check and zopt-gpu-host-check: check() prints one
// "PASS what" / "FAIL what" line (lit tests FileCheck them and the last
// line "N passed, M failed"); Z() exits with the runtime's message when a
// zopt C API call fails.
//===----------------------------------------------------------------------===//
#ifndef ZOPT_TEST_INTEGRATION_CHECK_UTIL_H
#define ZOPT_TEST_INTEGRATION_CHECK_UTIL_H

#include "zopt/zopt.h"

#include <cstdio>
#include <cstdlib>
#include <string>

namespace zopt_check {
inline int passed = 0, failed = 0;
inline void check(bool ok, const std::string &what) {
  std::printf("%s %s\n", ok ? "PASS" : "FAIL", what.c_str());
  (ok ? passed : failed)++;
}
} // namespace zopt_check

#define Z(call)                                                                \
  do {                                                                         \
    zopt_status s_ = (call);                                                   \
    if (s_ != ZOPT_OK) {                                                       \
      std::fprintf(stderr, "%s failed (%d): %s\n", #call, (int)s_,             \
                   zopt_last_error());                                         \
      std::exit(1);                                                            \
    }                                                                          \
  } while (0)

#endif
