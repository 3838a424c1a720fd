// The runtime's thread pool (runtime/src/common.cpp) used by several
// threads at once: run() calls from two threads on one pool are serialized
// (each job sees every tid exactly once, nothing hangs), as the pipeline's
// thread and an API call could otherwise meet there. Run under
// ThreadSanitizer by scripts/sanitize.sh. Bounded by alarm().
#include "internal.h"

#include <atomic>
#include <cstdio>
#include <thread>
#include <unistd.h>
#include <vector>

int main() {
  alarm(120);  // a deadlock fails the test (SIGALRM) instead of hanging it
  int failures = 0;
  for (int n : {2, 3, 4}) {
    zopt::ThreadPool pool(n);
    const int kJobs = 2000;
    std::atomic<int> bad{0};
    auto caller = [&](int who) {
      for (int j = 0; j < kJobs; ++j) {
        std::vector<std::atomic<int>> seen(n);
        for (auto &s : seen) s = 0;
        zopt::parallel(&pool, [&](int tid) {
          if (tid < 0 || tid >= n) bad++;
          else seen[tid]++;
        });
        for (auto &s : seen)
          if (s.load() != 1) bad++;
        (void)who;
      }
    };
    std::thread a(caller, 0), b(caller, 1);
    a.join();
    b.join();
    if (bad.load()) {
      fprintf(stderr, "test_pool: %d threads: %d jobs saw a tid other than once\n", n, bad.load());
      ++failures;
    }
  }
  if (failures) return 1;
  printf("test_pool: two threads x 2000 jobs on one pool of 2, 3, 4 threads: every job saw every tid once\n");
  return 0;
}
