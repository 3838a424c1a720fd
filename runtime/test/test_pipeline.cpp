// An optimizer's background thread (runtime/src/pipeline/pipeline.cpp)
// ended from inside a job, as CPython ends a thread that asks for the GIL
// while the interpreter shuts down (pthread_exit, from a collective's
// callback in an offloaded step's tail): drain() and wait() return at once
// with ZOPT_ERR_INTERNAL naming the job, the jobs queued after it are
// skipped (their finish told so), a later submit is skipped at once, and
// the destructor returns. Before, drain() waited forever (a process exit
// that hung in zopt_optimizer_free). Bounded by alarm().
#include "pipeline/pipeline.h"

#include <atomic>
#include <cstdio>
#include <cstring>
#include <pthread.h>
#include <unistd.h>

int main() {
  alarm(20);  // a hang fails the test (SIGALRM)
  int failures = 0;
  auto expect = [&](bool ok, const char *what) {
    if (!ok) {
      fprintf(stderr, "FAIL: %s\n", what);
      ++failures;
    }
  };
  std::atomic<int> ran{0}, finished_ok{0}, finished_failed{0};
  auto finish = [&](bool ok) { (ok ? finished_ok : finished_failed)++; };
  {
    zopt::pipeline::Pipeline p;
    // a job that runs, then one whose thread is ended inside it, then one queued after it
    uint64_t t1 = p.submit("job one", [&] { ran++; return ZOPT_OK; }, finish);
    p.wait(t1);
    expect(ran == 1 && finished_ok == 1, "the first job ran");
    uint64_t t2 = p.submit("the step's tail, bucket 3", [&]() -> zopt_status {
      ran++;
      usleep(50000);  // the next job is queued meanwhile
      pthread_exit(nullptr);
    }, finish);
    uint64_t t3 = p.submit("job three", [&] { ran += 100; return ZOPT_OK; }, finish);
    p.wait(t3);
    expect(t3 == t2 + 1 && p.completed() == t3 && p.idle(), "every job counts as done");
    zopt_status st = p.drain();
    const char *msg = zopt_last_error();
    expect(st == ZOPT_ERR_INTERNAL, "drain reports the ended thread");
    expect(strstr(msg, "background thread was ended while it ran the step's tail, bucket 3") != nullptr,
           "the message names the job");
    fprintf(stderr, "drain: %s\n", msg);
    expect(ran == 2, "the job queued after it did not run");
    expect(finished_failed == 1, "its finish was told it failed");
    expect(p.drain() == ZOPT_OK, "the failure is reported once");
    // a later submit: skipped at once (no thread runs it)
    uint64_t t4 = p.submit("job four", [&] { ran += 1000; return ZOPT_OK; }, finish);
    p.wait(t4);
    expect(ran == 2 && finished_failed == 2 && p.idle(), "a later submit is skipped at once");
  }  // the destructor joins the ended thread
  if (failures) return 1;
  printf("pipeline: OK\n");
  return 0;
}
