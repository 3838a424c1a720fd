//===- pipeline.h - an optimizer's background thread ---------------------===//
//
// This subsystem owns an optimizer's background thread and its job queue.
// Jobs (the gradient-bucket reductions of
// zopt_optimizer_reduce_bucket_async; an offloaded step's per-bucket CPU
// work after its copies, zopt_optimizer_grad_bucket_ready) run one at a time, in
// submission order, off the caller's thread. Every rank submits its jobs in
// the same order, so the collectives inside them match across ranks.
//
// It owns the first failure: once a job fails, the jobs queued after it are
// skipped (not run, their `finish` told so), and the failure's status and
// message are reported once, by drain(), on the caller's thread.
//
// Each job gets a ticket (1, 2, ...); completed() is the number of jobs run
// or skipped so far, so a job is finished when its ticket <= completed().
// The thread starts at the first submit; the destructor skips what is still
// queued, waits for the running job (a collective ends by the
// communicator's timeout at the latest) and joins. A thread ended from
// inside a job (pthread_exit unwinding through it: CPython ends a thread
// that asks for the GIL during its teardown, e.g. in a collective's
// callback) fails that job and every queued one (ZOPT_ERR_INTERNAL, named
// by drain) and skips later submits, so nothing waits for it forever.
//
// Thread safety: submit, idle, completed and drain are called by one caller
// thread at a time (the optimizer's API takes one call at a time: its
// CallGate, internal.h); the jobs run on
// the pipeline's thread. A job's `run` may use the optimizer's thread pool
// and scratch: the API refuses every other call on the optimizer while a
// job is queued or running (CHECK_OPT, optimizer/api.h), and a step drains
// first.
//===----------------------------------------------------------------------===//
#ifndef ZOPT_RUNTIME_PIPELINE_H
#define ZOPT_RUNTIME_PIPELINE_H

#include "zopt/zopt.h"

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <string>
#include <thread>

namespace zopt::pipeline {

class Pipeline {
 public:
  Pipeline() = default;
  Pipeline(const Pipeline &) = delete;
  Pipeline &operator=(const Pipeline &) = delete;
  ~Pipeline();

  // Queues `run` (its status; on failure it has called fail(), whose
  // message is kept) and returns its ticket. `finish(ran_ok)` runs on the
  // pipeline's thread after `run` succeeded (true) or failed or was
  // skipped (false). `what` names the job in a failure's message.
  uint64_t submit(std::string what, std::function<zopt_status()> run, std::function<void(bool)> finish);
  // No job queued or running.
  bool idle() const;
  // Jobs run or skipped so far.
  uint64_t completed() const;
  // Waits until the job of `ticket` (and every job before it) has run or
  // been skipped; reports nothing (drain does).
  void wait(uint64_t ticket);
  // Waits until idle; then reports the first failure since the last drain
  // (fail() with its status and message, naming the job) and forgets it.
  zopt_status drain();

 private:
  struct Job {
    uint64_t ticket;
    std::string what;
    std::function<zopt_status()> run;
    std::function<void(bool)> finish;
  };
  void loop();
  // The thread was ended inside the job `what` (loop's guard): every job
  // done and failed, later submits skipped at once.
  void thread_ended(const std::string &what);

  mutable std::mutex mu_;
  std::condition_variable cv_;       // work queued, or stop
  std::condition_variable done_cv_;  // a job completed
  std::deque<Job> queue_;
  bool stop_ = false;
  bool ended_ = false;  // the thread was ended inside a job (thread_ended)
  uint64_t submitted_ = 0, completed_ = 0;  // idle: completed_ == submitted_
  zopt_status error_ = ZOPT_OK;
  std::string error_msg_;
  std::thread thread_;
};

}  // namespace zopt::pipeline

#endif
