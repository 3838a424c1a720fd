//===- pipeline.cpp - an optimizer's background thread -------------------===//
// See pipeline.h.
//===----------------------------------------------------------------------===//
#include "pipeline/pipeline.h"

#include "backend/backend.h"
#include "exec/exec.h"
#include "exec/speculate.h"
#include "internal.h"

namespace zopt {

zopt_status check_idle(const zopt_optimizer *o, const char *fn) {
  if (o->begun)
    return fail(ZOPT_ERR_BAD_STATE,
                "%s: a step was begun (zopt_optimizer_step_begin: its gradients are reduced and its norm computed); "
                "finish it with zopt_optimizer_step%s first",
                fn, o->linked ? "_linked (the same parts)" : "");
  if (o->prog && o->prog->spec && o->prog->spec->open)
    return fail(ZOPT_ERR_BAD_STATE,
                "%s: gradient buckets of the step under way were marked ready (zopt_optimizer_grad_bucket_ready): "
                "their speculative work reads the optimizer's states and settings; finish the step "
                "(zopt_optimizer_step) first",
                fn);
  if (o->pipe && !o->pipe->idle())
    return fail(ZOPT_ERR_BAD_STATE,
                "%s: gradient buckets are still being reduced in the background "
                "(zopt_optimizer_reduce_bucket_async, zopt_optimizer_grad_bucket_ready): zopt_optimizer_wait_buckets "
                "(or the step) first",
                fn);
  return ZOPT_OK;
}

zopt_status join_tail(zopt_optimizer *o, const char *fn) {
  if (!o->tail || !o->backend) return ZOPT_OK;
  return o->backend->join_tail(o, fn);
}

}  // namespace zopt

namespace zopt::pipeline {

Pipeline::~Pipeline() {
  {
    std::lock_guard<std::mutex> l(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
  // Anything still queued was skipped by the loop (stop_): tell its owner.
  for (Job &j : queue_)
    if (j.finish) j.finish(false);
}

uint64_t Pipeline::submit(std::string what, std::function<zopt_status()> run, std::function<void(bool)> finish) {
  std::unique_lock<std::mutex> l(mu_);
  uint64_t t = ++submitted_;
  if (ended_) {  // no thread to run it: skipped at once (the first failure says why)
    ++completed_;
    done_cv_.notify_all();
    l.unlock();
    if (finish) finish(false);
    return t;
  }
  queue_.push_back(Job{t, std::move(what), std::move(run), std::move(finish)});
  if (!thread_.joinable()) thread_ = std::thread([this] { loop(); });
  cv_.notify_one();
  return t;
}

bool Pipeline::idle() const {
  std::lock_guard<std::mutex> l(mu_);
  return completed_ == submitted_;
}

uint64_t Pipeline::completed() const {
  std::lock_guard<std::mutex> l(mu_);
  return completed_;
}

void Pipeline::wait(uint64_t ticket) {
  std::unique_lock<std::mutex> l(mu_);
  done_cv_.wait(l, [&] { return completed_ >= ticket; });
}

zopt_status Pipeline::drain() {
  std::unique_lock<std::mutex> l(mu_);
  done_cv_.wait(l, [&] { return completed_ == submitted_; });
  if (error_ == ZOPT_OK) return ZOPT_OK;
  zopt_status st = error_;
  std::string m = std::move(error_msg_);
  error_ = ZOPT_OK;
  error_msg_.clear();
  l.unlock();
  return fail(st, "%s", m.c_str());
}

void Pipeline::thread_ended(const std::string &what) {
  std::deque<Job> left;
  {
    std::lock_guard<std::mutex> l(mu_);
    ended_ = true;
    if (error_ == ZOPT_OK) {
      error_ = ZOPT_ERR_INTERNAL;
      error_msg_ = "the optimizer's background thread was ended while it ran " + what +
                   " (ended from inside the job: the Python interpreter ends a thread that asks for the GIL "
                   "while it shuts down, e.g. in a collective's callback); that job and the ones queued after it "
                   "did not finish";
    }
    left.swap(queue_);
  }
  // Their owners told before any wait returns (a waiter reads what the
  // finish callbacks wrote), then every job counts as done.
  for (Job &j : left)
    if (j.finish) j.finish(false);
  std::lock_guard<std::mutex> l(mu_);
  completed_ = submitted_;
  done_cv_.notify_all();
}

void Pipeline::loop() {
  // The thread ended inside a job (pthread_exit unwinding through it, e.g.
  // CPython's at its teardown, from a callback that asked for the GIL):
  // that job and every queued one count as done and failed, so drain,
  // wait and the destructor never wait for this thread.
  struct Ended {
    Pipeline *p;
    bool in_job = false;
    std::string what;  // a copy: the job is gone when this runs
    ~Ended() {
      if (in_job) p->thread_ended(what);
    }
  } ended{this, false, {}};
  std::unique_lock<std::mutex> l(mu_);
  for (;;) {
    cv_.wait(l, [&] { return stop_ || !queue_.empty(); });
    if (stop_) return;  // the destructor tells the queued jobs
    Job j = std::move(queue_.front());
    queue_.pop_front();
    const bool skip = error_ != ZOPT_OK;
    l.unlock();
    ended.what = j.what;
    ended.in_job = true;
    zopt_status st = ZOPT_OK;
    std::string msg;
    if (!skip) {
      st = j.run();
      if (st) msg = j.what + " (in the background): " + zopt_last_error();
    }
    if (j.finish) j.finish(!skip && st == ZOPT_OK);
    ended.in_job = false;
    l.lock();
    if (st && error_ == ZOPT_OK) {
      error_ = st;
      error_msg_ = std::move(msg);
    }
    ++completed_;
    done_cv_.notify_all();
  }
}

}  // namespace zopt::pipeline
