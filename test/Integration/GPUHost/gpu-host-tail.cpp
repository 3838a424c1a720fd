//===- gpu-host-tail.cpp - the asynchronous tail of an offloaded step --------===//
//
// zopt-gpu-host-check FAKE.so OFFLOAD_STEP.so CPU_TWIN.so --tail
// (docs/GPU.md "Params back early"): an offloaded optimizer at 1 rank in
// per-bucket mode (E), the same step in the default mode (S) and the
// all-CPU twin (C), stepped together; E's steps pipelined (every bucket
// marked), so each leaves its per-bucket tail (commit or recompute, then
// the bucket's params back) on the pipeline thread:
//   - with bucket 0's copy back stalled in its call (fake_cuda_stall_htod:
//     the tail's last job cannot finish), zopt_optimizer_step returns, with
//     its result final; wait_params(nb-1, s) returns and work on s sees
//     that bucket's new params; read_state, the step counts, save and the
//     next mark (or a serial step) each wait for the whole tail (they
//     return only after the stall is released) and see the step's final state (the saved file,
//     loaded into S, leaves S the twin's);
//   - over several steps (commit, recompute with clipping active, discard
//     with an inf, a mark right after the step) every state and param is
//     bit-identical among E, S and C;
//   - a failed copy back in the tail (fake_cuda_fail_htod): the step
//     returns; the next call returns ZOPT_ERR_INTERNAL naming the bucket;
//     the call after it works, the states are whole, the next step copies
//     every param back (the same through wait_params of the bucket).
// Every stall has a releaser thread with a timeout (a step that does not
// return early still ends, and the check fails).
//===----------------------------------------------------------------------===//
#include "gpu-host-check.h"

#include <atomic>
#include <chrono>
#include <cmath>
#include <thread>

namespace ghc {

namespace {

struct TSide {
  zopt_optimizer *o = nullptr;
  std::vector<unsigned long long> dp, dg;
  std::vector<std::vector<unsigned char>> hp, hg;
  void *stream = nullptr;
};

bool drained(Fake &f, void *s, int ms) {
  for (int i = 0; i < ms; ++i) {
    if (f.stream_query(s) == 0) return true;
    usleep(1000);
  }
  return f.stream_query(s) == 0;
}

// Releases the stand-in's stalls after `ms` unless released before.
struct Releaser {
  Fake &f;
  std::atomic<bool> done{false}, released{false};
  std::thread th;
  Releaser(Fake &fk, int ms) : f(fk) {
    th = std::thread([this, ms] {
      for (int i = 0; i < ms && !done; ++i) usleep(1000);
      released = true;
      f.release_htod();
    });
  }
  void release() {
    done = true;
    th.join();
  }
  ~Releaser() {
    if (th.joinable()) release();
  }
};

}  // namespace

void tail_check(Fake &f, zopt_step *step, const char *twin_path) {
  zopt_step *twin = nullptr;
  Z(zopt_step_load(twin_path, &twin));
  const zopt_step_descriptor *d = zopt_step_get_descriptor(step);
  uint32_t pdt = 0, gdt = 0;
  for (uint32_t i = 0; i < d->num_states; ++i) {
    if (d->states[i].kind == ZOPT_STATE_PARAM) pdt = d->states[i].dtype;
    if (d->states[i].kind == ZOPT_STATE_GRAD) gdt = d->states[i].dtype;
  }
  const bool has_norm = d->flags & ZOPT_FLAG_CLIP;
  const size_t ep = dtype_size(pdt), eg = dtype_size(gdt);
  const std::vector<int64_t> sizes = {3000, 20000, 513, 7, 40000, 1000, 9000};
  const size_t T = sizes.size();
  TSide E, S, C;
  Z(zopt_optimizer_create(step, &E.o));
  Z(zopt_optimizer_create(step, &S.o));
  Z(zopt_optimizer_create(twin, &C.o));
  unsigned rng = 4242;
  auto rnd = [&]() {
    rng = rng * 1664525u + 1013904223u;
    return ((rng >> 8) & 0xFFFF) / 32768.0f - 1.0f;
  };
  for (TSide *x : {&E, &S, &C}) {
    Z(zopt_optimizer_set_bucket_elems(x->o, 16384));
    int id = 0;
    Z(zopt_optimizer_add_group(x->o, &id));
    Z(zopt_optimizer_set_hyper(x->o, id, "lr", 1e-2));
    Z(zopt_optimizer_set_seed(x->o, 99));
  }
  for (size_t t = 0; t < T; ++t) {
    int id = 0;
    for (TSide *x : {&E, &S}) {
      x->dp.push_back(0);
      x->dg.push_back(0);
      f.mem_alloc(&x->dp[t], sizes[t] * ep);
      f.mem_alloc(&x->dg[t], sizes[t] * eg);
      Z(zopt_optimizer_add_tensor(x->o, 0, (void *)(uintptr_t)x->dp[t], (void *)(uintptr_t)x->dg[t], sizes[t],
                                  (zopt_dtype)pdt, &id));
    }
    C.hp.emplace_back(sizes[t] * ep);
    C.hg.emplace_back(sizes[t] * eg);
    Z(zopt_optimizer_add_tensor(C.o, 0, C.hp[t].data(), C.hg[t].data(), sizes[t], (zopt_dtype)pdt, &id));
    std::vector<float> v(sizes[t]);
    for (auto &x : v) x = rnd();
    Z(zopt_optimizer_write_state_f32(C.o, (int)t, ZOPT_STATE_PARAM, v.data(), sizes[t]));
    memcpy((void *)(uintptr_t)E.dp[t], C.hp[t].data(), C.hp[t].size());
    memcpy((void *)(uintptr_t)S.dp[t], C.hp[t].data(), C.hp[t].size());
  }
  Z(zopt_optimizer_set_param_wait(E.o, ZOPT_PARAM_WAIT_PER_BUCKET));
  for (TSide *x : {&E, &S, &C}) Z(zopt_optimizer_finalize(x->o));
  for (TSide *x : {&E, &S}) {
    f.stream_create(&x->stream, 0);
    Z(zopt_optimizer_set_stream(x->o, x->stream));
  }
  void *us = nullptr;
  f.stream_create(&us, 0);
  const BucketMap bm = bucket_map(E.o, T);
  const int nb = bm.nb, held = bm.held;
  const std::vector<int> &only_last = bm.only_last;
  check(nb >= 3 && !only_last.empty() && held >= 0, "tail: " + std::to_string(nb) + " buckets");
  if (held < 0 || only_last.empty()) return;
  std::vector<void *> pin(T);
  for (size_t t = 0; t < T; ++t) f.mem_host_alloc(&pin[t], sizes[t] * ep, 0);
  auto to_host = [&](const TSide &x, int t, void *s) {
    memset(pin[t], 0x5A, sizes[t] * ep);
    f.memcpy_dtoh_async(pin[t], x.dp[t], sizes[t] * ep, s);
  };
  auto host_is_twin = [&](int t) { return memcmp(pin[t], C.hp[t].data(), C.hp[t].size()) == 0; };
  auto set_grads = [&](float scale, bool inf) {
    for (size_t t = 0; t < T; ++t) {
      std::vector<float> v(sizes[t]);
      for (auto &x : v) x = rnd() * scale;
      if (inf && t == 4) v[sizes[t] / 3] = INFINITY;
      Z(zopt_optimizer_write_state_f32(C.o, (int)t, ZOPT_STATE_GRAD, v.data(), sizes[t]));
      memcpy((void *)(uintptr_t)E.dg[t], C.hg[t].data(), C.hg[t].size());
      memcpy((void *)(uintptr_t)S.dg[t], C.hg[t].data(), C.hg[t].size());
    }
  };
  auto mark_all = [&] {
    for (int b = nb - 1; b >= 0; --b) Z(zopt_optimizer_grad_bucket_ready(E.o, b));  // backward order
  };
  auto step_sc = [&](zopt_step_result *rs, zopt_step_result *rc) {
    Z(zopt_optimizer_step(S.o, rs));
    Z(zopt_optimizer_step(C.o, rc));
  };
  // Every state and param of E, S and C bit for bit (E's params read from
  // the device: read_state joins the tail, then waits for its copies).
  auto same_states = [&](const std::string &tag) {
    bool same = states_identical(d, sizes, E.o, S.o, C.o);
    int64_t ce = -1, cc = -2;
    Z(zopt_optimizer_get_step_count(E.o, 0, &ce));
    Z(zopt_optimizer_get_step_count(C.o, 0, &cc));
    check(same && ce == cc, "tail: " + tag + ": every state, param and count bit-identical among per-bucket, "
                                             "default and the CPU twin");
  };

  // ---- 1: the step returns while its tail's last job is stalled -------------
  {
    set_grads(1e-3f, false);
    mark_all();
    f.stall_htod(E.dp[held], E.dp[held] + sizes[held] * ep);
    zopt_step_result re{}, rs{}, rc{};
    bool early = false;
    {
      Releaser rel(f, 3000);
      Z(zopt_optimizer_step(E.o, &re));
      early = !rel.released;
      step_sc(&rs, &rc);
      check(early && re.grad_norm == rc.grad_norm && re.skipped == rc.skipped && rs.grad_norm == rc.grad_norm,
            "tail: zopt_optimizer_step returns while its tail is stalled (bucket 0's copy back), its result final");
      Z(zopt_optimizer_wait_params(E.o, nb - 1, us));
      for (int t : only_last) to_host(E, t, us);
      bool ok = drained(f, us, 5000);
      for (int t : only_last) ok &= host_is_twin(t);
      check(ok && !rel.released, "tail: wait_params(" + std::to_string(nb - 1) +
                                     ", s) returns while the tail is stalled; work on s sees that bucket's new params");
      // read_state joins: it returns only after the stall ends.
      std::thread r([&rel] {
        usleep(100000);
        rel.release();
      });
      std::vector<float> a(sizes[held]), b(sizes[held]);
      const zopt_status st = zopt_optimizer_read_state_f32(E.o, held, ZOPT_STATE_PARAM, a.data(), sizes[held]);
      const bool after = rel.done.load();
      r.join();
      Z(zopt_optimizer_read_state_f32(C.o, held, ZOPT_STATE_PARAM, b.data(), sizes[held]));
      check(st == ZOPT_OK && after && a == b,
            "tail: read_state right after the step waits for the whole tail and sees the final param" +
                std::string(st ? std::string(": ") + zopt_last_error() : ""));
    }
    same_states("stalled step");
  }
  // ---- 2: save, the counts and the next mark right after a stalled step ------
  {
    set_grads(1e-3f, false);
    mark_all();
    f.stall_htod(E.dp[held], E.dp[held] + sizes[held] * ep);
    zopt_step_result re{}, rs{}, rc{};
    Releaser rel(f, 3000);
    Z(zopt_optimizer_step(E.o, &re));
    const bool early = !rel.released;
    step_sc(&rs, &rc);
    std::thread r([&rel] {
      usleep(100000);
      rel.release();
    });
    const std::string pe = "/tmp/zopt-host-check-tail-" + std::to_string(getpid()) + ".ckpt";
    const zopt_status st = zopt_optimizer_save(E.o, pe.c_str());
    const std::string msg = st ? zopt_last_error() : "";
    const bool after = rel.done.load();
    r.join();
    // Loaded into the default-mode optimizer: its states must stay the
    // twin's (same_states below), so the file holds the step's final state.
    const zopt_status ld = st ? st : zopt_optimizer_load(S.o, pe.c_str());
    remove(pe.c_str());
    check(early && after && st == ZOPT_OK && ld == ZOPT_OK,
          "tail: save right after the step waits for the tail; the default-mode optimizer loads the file" + msg);
    same_states("saved step");
  }
  // ---- 2b: the next mark, then a serial step, right after a stalled step -------
  for (int serial = 0; serial < 2; ++serial) {
    set_grads(1e-3f, false);
    mark_all();
    f.stall_htod(E.dp[held], E.dp[held] + sizes[held] * ep);
    zopt_step_result re{}, rs{}, rc{};
    Releaser rel(f, 3000);
    Z(zopt_optimizer_step(E.o, &re));
    const bool early = !rel.released;
    step_sc(&rs, &rc);
    set_grads(0.5f, false);  // the next step's grads (device memory the tail does not read)
    std::thread r([&rel] {
      usleep(100000);
      rel.release();
    });
    // The next step's first mark, or (serial) the next step without marks.
    const zopt_status st = serial ? zopt_optimizer_step(E.o, &re) : zopt_optimizer_grad_bucket_ready(E.o, nb - 1);
    const std::string msg = st ? zopt_last_error() : "";
    const bool after = rel.done.load();
    r.join();
    if (!serial)
      for (int b = nb - 2; b >= 0; --b) Z(zopt_optimizer_grad_bucket_ready(E.o, b));
    if (!serial) Z(zopt_optimizer_step(E.o, &re));
    step_sc(&rs, &rc);
    check(early && after && st == ZOPT_OK,
          std::string("tail: ") + (serial ? "a serial step" : "the next step's first mark") +
              " right after the step waits for its tail" + msg);
    same_states(serial ? "serial step after a stalled one" : "marked after a stalled step");
  }
  // ---- 3: several steps: commit, recompute, discard; the next mark at once ---
  {
    struct Plan {
      float scale;
      bool inf;
    };
    const Plan plans[] = {{1e-3f, false}, {0.5f, false}, {1e-3f, true}, {0.5f, false}, {1e-3f, false}};
    bool ok = true;
    for (const Plan &pl : plans) {
      if (pl.inf && !has_norm) continue;
      set_grads(pl.scale, pl.inf);
      mark_all();  // right after the last step: joins its tail
      zopt_step_result re{}, rs{}, rc{};
      Z(zopt_optimizer_step(E.o, &re));
      step_sc(&rs, &rc);
      ok &= re.skipped == rc.skipped && (re.grad_norm == rc.grad_norm || (std::isnan(re.grad_norm) && std::isnan(rc.grad_norm)));
    }
    for (int b = 0; b < nb; ++b) Z(zopt_optimizer_wait_params(E.o, b, us));
    for (size_t t = 0; t < T; ++t) to_host(E, (int)t, us);
    ok &= drained(f, us, 5000);
    for (size_t t = 0; t < T; ++t) ok &= host_is_twin((int)t);
    check(ok, "tail: commit, recompute and discard steps, each marked right after the last: results equal, "
              "wait_params of every bucket sees every new param");
    same_states("several steps");
  }
  // ---- 4: a failed copy back in the tail -------------------------------------
  for (int via_wait = 0; via_wait < 2; ++via_wait) {
    const std::string tag = via_wait ? "through wait_params" : "through the next call";
    set_grads(1e-3f, false);
    mark_all();
    f.fail_htod(E.dp[held], E.dp[held] + sizes[held] * ep);
    zopt_step_result re{}, rs{}, rc{};
    Z(zopt_optimizer_step(E.o, &re));
    step_sc(&rs, &rc);
    zopt_status st;
    if (via_wait) {
      Z(zopt_optimizer_wait_params(E.o, nb - 1, us));
      st = zopt_optimizer_wait_params(E.o, 0, us);
    } else {
      zopt_pipeline_stats ps{};
      ps.size = sizeof ps;
      st = zopt_optimizer_get_pipeline_stats(E.o, &ps);
    }
    const std::string msg = zopt_last_error();
    check(st == ZOPT_ERR_INTERNAL && msg.find("bucket 0") != std::string::npos,
          "tail: a failed copy back (" + tag + ") is reported by the next call, naming the bucket: " + msg);
    zopt_pipeline_stats ps{};
    ps.size = sizeof ps;
    const zopt_status again = zopt_optimizer_get_pipeline_stats(E.o, &ps);
    check(again == ZOPT_OK && ps.buckets == nb && ps.committed == nb,
          "tail: the call after the failure works (" + tag + ")");
    // The states are whole; the next step copies every param back.
    set_grads(1e-3f, false);
    mark_all();
    Z(zopt_optimizer_step(E.o, &re));
    step_sc(&rs, &rc);
    same_states("after a failed copy back (" + tag + ")");
  }
  f.drain_all();
  for (TSide *x : {&E, &S, &C}) zopt_optimizer_free(x->o);
  for (TSide *x : {&E, &S})
    for (size_t t = 0; t < T; ++t) {
      f.mem_free(x->dp[t]);
      f.mem_free(x->dg[t]);
    }
  for (void *p : pin) f.mem_free_host(p);
  zopt_step_free(twin);
}

}  // namespace ghc
