//===- gpu-host-graph.cpp - CUDA graphs ----------------------------------===//
//
// A step captured into a CUDA graph and replayed on another stream, with
// hyperparameters changed between replays: every read waits for the
// replays. Gradient memory moved after finalize (set_grad_memory) outside
// and inside a capture: the device's state pointer table.
//===----------------------------------------------------------------------===//
#include "gpu-host-check.h"

#include <thread>

namespace ghc {

// A CUDA graph: the step captured on stream C, replayed on stream R, with
// the stand-in emulating the kernels (queued, delayed, FINISH advancing the
// step counts, PREPARE recording the hyperparameters it read). Reads made
// without telling the optimizer about R must wait for the replays; lr
// changes between replays must reach the replays that follow them, and
// only those.
void graph_checks(Fake &f, zopt_step *step) {
  const StepInfo si = info_of(step);
  f.set_emulation(1, 20000);  // 20 ms per kernel
  Setup su = make_optimizer(f, step, si, {33, 1000, 5000});
  zopt_optimizer *o = su.o;
  Z(zopt_optimizer_finalize(o));
  void *cs = nullptr, *rs = nullptr, *graph = nullptr, *exec = nullptr;
  f.stream_create(&cs, 0);
  f.stream_create(&rs, 0);
  Z(zopt_optimizer_set_stream(o, cs));
  Z(zopt_optimizer_step(o, nullptr));  // warm-up, on C
  f.drain_all();
  const int p0 = f.num_prepares();
  f.begin_capture(cs, 0);
  zopt_status st = zopt_optimizer_step(o, nullptr);
  zopt_status st_hyper = zopt_optimizer_set_hyper(o, su.gid[0], "lr", 7e-4);
  std::string msg_hyper = zopt_last_error();
  const bool clip = si.d->flags & ZOPT_FLAG_CLIP;
  double mn0 = 0, mn1 = 0;
  zopt_status st_mn = ZOPT_OK;
  std::string msg_mn;
  if (clip) {
    Z(zopt_optimizer_get_max_norm(o, &mn0));
    st_mn = zopt_optimizer_set_max_norm(o, 0.5 * mn0);
    msg_mn = zopt_last_error();
    Z(zopt_optimizer_get_max_norm(o, &mn1));
  }
  int64_t n = -1;
  zopt_status st_read = zopt_optimizer_get_step_count(o, 0, &n);
  std::string msg_read = zopt_last_error();
  int ec = f.end_capture(cs, &graph);
  check(st == ZOPT_OK && ec == 0, "step captured into a CUDA graph (nothing the capture forbids: no sync, no "
                                  "pageable copy, no wait for an event outside it)");
  check(st_hyper == ZOPT_ERR_BAD_STATE && msg_hyper.find("capturing a CUDA graph") != std::string::npos,
        "set_hyper during the capture is refused, saying why: " + msg_hyper);
  if (clip)
    check(st_mn == ZOPT_ERR_BAD_STATE && msg_mn.find("capturing a CUDA graph") != std::string::npos && mn1 == mn0,
          "set_max_norm during the capture is refused, saying why, and max_norm stays: " + msg_mn);
  check(st_read == ZOPT_ERR_BAD_STATE && msg_read.find("capturing a CUDA graph") != std::string::npos,
        "reading the step count during the capture is refused, saying why: " + msg_read);
  f.instantiate(&exec, graph, 0);
  // Three replays on R, lr changed before the second and third; the
  // optimizer's stream stays C (as after a capture by torch.cuda.graph).
  const double lrs[3] = {1e-3, 5e-4, 2e-4};
  for (int k = 0; k < 3; ++k) {
    if (k) Z(zopt_optimizer_set_hyper(o, su.gid[0], "lr", lrs[k]));
    f.graph_launch(exec, rs);
  }
  int l_after = f.num_launches();
  Z(zopt_optimizer_get_step_count(o, 0, &n));
  check(n == 4,
        "get_step_count after 3 replays on another stream waits for them (the step's event is a record node of "
        "the graph): count " + std::to_string(n) + " (1 + 3)");
  std::string seen;
  bool lr_ok = f.num_prepares() == p0 + 3;
  for (int k = 0; k < 3 && lr_ok; ++k) {
    double h[64];
    f.prepare_hypers(p0 + k, h, 64);
    char b[64];
    snprintf(b, sizeof b, "%g ", h[si.lr_i]);
    seen += b;
    lr_ok &= h[si.lr_i] == lrs[k] && h[si.d->num_hypers + si.lr_i] == 3e-3;
  }
  check(lr_ok, "lr changed between replays reaches exactly the replays after it: the replayed PREPAREs read " + seen);
  (void)l_after;
  // Two more replays, then a checkpoint and gpu_result right away.
  f.graph_launch(exec, rs);
  f.graph_launch(exec, rs);
  std::string ck = "/tmp/zopt-host-check-graph-" + std::to_string(getpid()) + ".ckpt";
  Z(zopt_optimizer_save(o, ck.c_str()));
  zopt_step_result gr{};
  Z(zopt_optimizer_gpu_result(o, &gr));
  Z(zopt_optimizer_load(o, ck.c_str()));
  Z(zopt_optimizer_get_step_count(o, 0, &n));
  remove(ck.c_str());
  check(n == 6, "save after 2 more replays waits for them: the checkpoint holds step count " + std::to_string(n));
  // A step on another stream after a stream change: ordered after the
  // replays (the new stream waits for the optimizer's events).
  void *other = nullptr;
  f.stream_create(&other, 0);
  f.graph_launch(exec, rs);
  int c0 = f.num_calls();
  Z(zopt_optimizer_set_stream(o, other));
  Z(zopt_optimizer_step(o, nullptr));
  Z(zopt_optimizer_get_step_count(o, 0, &n));
  check(calls_since(f, c0, "cuStreamWaitEvent") >= 1 && n == 8,
        "a new stream waits for the optimizer's last work (a replay on R), then steps: count " + std::to_string(n));
  f.drain_all();
  f.set_emulation(0, 0);
  zopt_optimizer_free(o);
  for (size_t i = 0; i < su.dp.size(); ++i) {
    f.mem_free(su.dp[i]);
    f.mem_free(su.dg[i]);
  }
}

// Entry (tensor t, state k) of the device's state pointer table, read from
// the stand-in's "device" memory (the table is UPDATE's first argument).
static unsigned long long table_entry(Fake &f, const StepInfo &si, int t, int k) {
  std::vector<Rec> ls = launches_since(f, 0);
  for (size_t i = ls.size(); i-- > 0;)
    if (ls[i].role == "UPDATE") {
      unsigned long long v = 0;
      memcpy(&v, (const char *)(uintptr_t)ls[i].args[0] + ((size_t)t * si.d->num_states + (size_t)k) * 8, 8);
      return v;
    }
  return 0;
}

// zopt_optimizer_set_grad_memory after finalize (a framework's fresh
// gradient tensors read in place): outside a capture the changed entries of
// the state pointer table are uploaded, ordered after the steps enqueued;
// inside one they are written by value (memset nodes: no pageable copy), so
// every replay reads the gradient the capture saw, and the next step outside
// the graph uploads the table again; a failed write leaves the call without
// effect; a NULL grad of an active tensor is refused at the step.
void rebind_checks(Fake &f, zopt_step *step) {
  const StepInfo si = info_of(step);
  int gi = 0;
  for (uint32_t k = 0; k < si.d->num_states; ++k)
    if (si.d->states[k].kind == ZOPT_STATE_GRAD) gi = (int)k;
  const std::vector<int64_t> sizes = {33, 1000, 5000};
  Setup su = make_optimizer(f, step, si, sizes);
  zopt_optimizer *o = su.o;
  Z(zopt_optimizer_finalize(o));
  void *cs = nullptr, *rs = nullptr, *graph = nullptr, *exec = nullptr;
  f.stream_create(&cs, 0);
  f.stream_create(&rs, 0);
  Z(zopt_optimizer_set_stream(o, cs));
  Z(zopt_optimizer_step(o, nullptr));
  f.drain_all();
  unsigned long long g1 = 0, g2 = 0, g3 = 0;
  f.mem_alloc(&g1, sizes[1] * si.eg);
  f.mem_alloc(&g2, sizes[1] * si.eg);
  f.mem_alloc(&g3, sizes[1] * si.eg);
  const int32_t one = 1;
  void *p1 = (void *)(uintptr_t)g1, *p2 = (void *)(uintptr_t)g2, *p3 = (void *)(uintptr_t)g3;
  // Outside a capture: one upload, then the step reads it.
  int c0 = f.num_calls();
  Z(zopt_optimizer_set_grad_memory(o, 1, &one, &p1));
  Z(zopt_optimizer_step(o, nullptr));
  f.drain_all();
  check(table_entry(f, si, 1, gi) == g1 && table_entry(f, si, 0, gi) == su.dg[0] &&
            calls_since(f, c0, "cuMemcpyHtoDAsync") == 1 && calls_since(f, c0, "cuStreamSynchronize") == 0,
        "set_grad_memory after finalize: tensor 1's grad entry rewritten (one upload, no synchronisation), the "
        "others kept");
  // Inside a capture: written by value, replays restore it.
  f.begin_capture(cs, 0);
  c0 = f.num_calls();
  zopt_status st = zopt_optimizer_set_grad_memory(o, 1, &one, &p2);
  const int memsets = calls_since(f, c0, "cuMemsetD32Async"), copies = calls_since(f, c0, "cuMemcpyHtoDAsync");
  zopt_status st_step = zopt_optimizer_step(o, nullptr);
  int ec = f.end_capture(cs, &graph);
  check(st == ZOPT_OK && st_step == ZOPT_OK && ec == 0 && memsets == 2 && copies == 0,
        "set_grad_memory inside a capture: the entry written by value (2 memset nodes, no copy), the capture valid");
  f.instantiate(&exec, graph, 0);
  Z(zopt_optimizer_set_grad_memory(o, 1, &one, &p3));  // outside: eager steps read g3
  f.drain_all();
  const bool eager = table_entry(f, si, 1, gi) == g3;
  f.graph_launch(exec, rs);
  f.drain_all();
  const bool replayed = table_entry(f, si, 1, gi) == g2;
  c0 = f.num_calls();
  Z(zopt_optimizer_step(o, nullptr));
  f.drain_all();
  check(eager && replayed && table_entry(f, si, 1, gi) == g3 && calls_since(f, c0, "cuMemcpyHtoDAsync") >= 1,
        "a replay reads the gradient the capture saw, the next step outside the graph the one set since (the table "
        "uploaded again)");
  // A failed write: the call fails with nothing changed, the next step
  // rewrites the whole table.
  f.begin_capture(cs, 0);
  f.fail_memset(1);
  st = zopt_optimizer_set_grad_memory(o, 1, &one, &p1);
  std::string msg = zopt_last_error();
  f.end_capture(cs, &graph);
  f.fail_memset(0);
  Z(zopt_optimizer_step(o, nullptr));
  f.drain_all();
  check(st == ZOPT_ERR_INTERNAL && msg.find("state pointer table") != std::string::npos &&
            table_entry(f, si, 1, gi) == g3,
        "a failed table write: the call fails, the grad stays registered where it was: " + msg);
  // Grads carved from one allocation (a caching allocator's segment): the
  // driver is asked about it once per call, and again in the next call.
  {
    unsigned long long seg = 0;
    size_t at[3], total = 0;
    for (size_t i = 0; i < sizes.size(); ++i) at[i] = total, total += ((size_t)sizes[i] * si.eg + 511) / 512 * 512;
    f.mem_alloc(&seg, total);
    int32_t ids[3] = {0, 1, 2};
    void *gs[3];
    for (int i = 0; i < 3; ++i) gs[i] = (void *)(uintptr_t)(seg + at[i]);
    int q0 = f.num_calls();
    Z(zopt_optimizer_set_grad_memory(o, 3, ids, gs));
    const int first = calls_since(f, q0, "cuPointerGetAttribute");
    for (int i = 0; i < 3; ++i) gs[i] = (void *)(uintptr_t)(seg + at[(i + 1) % 3]);
    q0 = f.num_calls();
    zopt_status st_swap = zopt_optimizer_set_grad_memory(o, 3, ids, gs);  // (sizes differ: only the checks count)
    const int second = calls_since(f, q0, "cuPointerGetAttribute");
    int32_t back_ids[3] = {0, 1, 2};
    void *back[3] = {(void *)(uintptr_t)su.dg[0], (void *)(uintptr_t)g3, (void *)(uintptr_t)su.dg[2]};
    Z(zopt_optimizer_set_grad_memory(o, 3, back_ids, back));
    f.drain_all();
    f.mem_free(seg);
    check(first == 4 && second == 4 && st_swap == ZOPT_OK,
          "three grads in one allocation: the driver asked 4 times per call (memory type, device, the "
          "allocation's range), not trusted across calls: " + std::to_string(first) + ", " + std::to_string(second));
  }
  // A NULL grad: refused at the step while the tensor is active.
  void *none = nullptr;
  Z(zopt_optimizer_set_grad_memory(o, 1, &one, &none));
  st = zopt_optimizer_step(o, nullptr);
  msg = zopt_last_error();
  const uint8_t mask[3] = {1, 0, 1};
  Z(zopt_optimizer_set_active(o, mask, 3));
  zopt_status st2 = zopt_optimizer_step(o, nullptr);
  f.drain_all();
  check(st == ZOPT_ERR_INVALID_ARGUMENT && msg.find("tensor 1 has no gradient memory") != std::string::npos &&
            st2 == ZOPT_OK,
        "a NULL grad of an active tensor refused at the step, stepped once masked off: " + msg);
  zopt_optimizer_free(o);
  for (size_t i = 0; i < su.dp.size(); ++i) {
    f.mem_free(su.dp[i]);
    f.mem_free(su.dg[i]);
  }
  f.mem_free(g1);
  f.mem_free(g2);
  f.mem_free(g3);
}

}  // namespace ghc
