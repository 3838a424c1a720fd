// zopt-zero-check: a compiled step at W ranks against one rank, bit for bit.
//
// Every rank r of W builds the same model (tensors of awkward sizes in two
// groups: empty, smaller than W, not divisible by anything, spanning
// buckets) with the same initial params, and at step k uses its own
// gradients G[r][k] (deterministic random, never zero). Every rank also
// runs, locally, a one-rank optimizer of the same step (the reference) whose
// gradient is the rank-order f32 sum of every rank's G, rounded to the grad
// dtype, with the gradient divisor set to W (the mean). After every step
// the W-rank result must equal the reference exactly: the norm, the skip
// decision, the loss scale, the params in user memory (gathered under
// ZeRO-3), the grad memory (the reduced gradient, the reference's
// rank-order sum, wherever the step program leaves it: whole under ZeRO-0/1,
// in the rank's own shards under ZeRO-2/3, the rank's own gradient
// elsewhere), every optimizer state (read through the C API, a collective
// gather for sharded states), and the step counts. After the steps, the
// runtime-held bytes (zopt_memory_info) must be exactly what the documented
// layout, computed here, assigns to the rank.
//
//   zopt-zero-check STEP.so [options]
//     --comm=loopback|mpi   ranks as threads (with --world=W) or MPI processes
//     --world=W             loopback world size
//     --steps=N             steps (default 4)
//     --bucket=E            bucket elements (default 65536: several buckets;
//                           0: the runtime's default, picked from the model)
//     --params=N            the model scaled to about N elements (the small
//                           tensors kept); with --bucket=0 the memory check
//                           also requires every rank to hold no more bytes
//                           than one rank of the same step at stage 0
//     --threads=T           threads per rank (default 1)
//     --grad-scale=X        gradient magnitude (clipping active or not)
//     --accum=A             divisor W*A (A accumulated micro-batches)
//     --inf-at=K            the last rank puts +inf in one gradient at step K
//     --mask                tensor 3 has no gradient on any rank, tensor 5
//                           has one on rank 0 only
//     --delay               loopback: random delays and poisoned buffers
//     --save=PATH           after the steps, save a checkpoint (collective)
//     --load=PATH --from-world=Ws --loaded-steps=S
//                           start from a checkpoint that a run at Ws ranks
//                           saved after S steps; continue --steps steps
//     --mismatch=stage|tensors|size|bucket|hyper|seed|steps|clip|divisor|call
//                           rank 1 (only) differs: every rank must fail with
//                           an error naming the setting and both values
//                           (call: rank 1 calls another collective)
//     --other=STEP2.so      rank 1's step for --mismatch=stage
//     --stream              gradient streaming (zopt_optimizer_reduce_bucket):
//                           no grad memory registered, the buckets reduced
//                           in reverse order before each step, each
//                           gradient poisoned (NaN) once its buckets are
//                           reduced
//     --async               with --stream: zopt_optimizer_reduce_bucket_async;
//                           each gradient poisoned once bucket_done says
//                           every bucket it spans is finished; a call made
//                           while buckets may be in flight either fails
//                           naming wait_buckets or finds them all finished
//     --async-misorder      with --async: rank 1 hands the buckets over in
//                           ascending order, the others descending: the
//                           background exchange fails and every rank's step
//                           reports it, naming the bucket
//     --async-free          hand every bucket over in the background and free
//                           the optimizer at once (run at --world=1)
//     --stall               the last rank sleeps 2.5 s before its second step
//                           (timeout 1 s): the others fail within the
//                           timeout naming it, its own step then at once
//     --begin               each step in two halves (zopt_optimizer_step_begin
//                           or _step_linked_begin, then the step), with
//                           max_norm set to 0.5 k at step k (steps with
//                           clipping) on the ranks and the reference: the
//                           begin's norm is the step's, calls in between are
//                           refused, the result bit-identical as always
//     --linked=STEP2.so     a second optimizer (another parameter class: its
//                           own tensors and gradients) stepped with the first
//                           by zopt_optimizer_step_linked: one norm over
//                           both; at one rank the norm is also checked
//                           against a float64 sum over both parts' gradients
#include "zero_check.h"

using namespace zc;

namespace {

// Builds a model with the initial params; `drop_last` registers one tensor
// fewer (the tensors mismatch).
bool build(int rank, const zopt_step *step, Model &m, const Options &opt, zopt_comm *comm, int drop_last) {
  m.step = step;
  m.d = zopt_step_get_descriptor(step);
  m.pdt = dtype_of(m.d, ZOPT_STATE_PARAM);
  m.gdt = dtype_of(m.d, ZOPT_STATE_GRAD);
  size_t T = kSizes.size() - (drop_last == 1 ? 1 : 0);
  const size_t shrunk = drop_last == 2 ? T - 1 : T;  // one element short
  m.p.resize(T);
  m.g.resize(T);
  for (size_t t = 0; t < T; ++t) {
    m.p[t].resize((size_t)kSizes[t] * esize(m.pdt) + 1);
    m.g[t].resize((size_t)kSizes[t] * esize(m.gdt) + 1);
    for (int64_t i = 0; i < kSizes[t]; ++i) store(m.p[t].data(), m.pdt, (size_t)i, value(1, t, 0, i, 1.0));
  }
  CK(zopt_optimizer_create(step, &m.o));
  CK(zopt_optimizer_set_num_threads(m.o, opt.threads));
  // Streaming (the ranks' model, not the one-rank reference): no grad memory.
  const bool stream = opt.stream && comm;
  if (stream) CK(zopt_optimizer_set_grad_streaming(m.o, 1));
  int id;
  CK(zopt_optimizer_add_group(m.o, &id));
  CK(zopt_optimizer_add_group(m.o, &id));
  for (size_t t = 0; t < T; ++t)
    CK(zopt_optimizer_add_tensor(m.o, kGroups[t], m.p[t].data(), stream ? nullptr : m.g[t].data(),
                                 kSizes[t] - (t == shrunk ? 1 : 0), (zopt_dtype)m.pdt, &id));
  if (comm) CK(zopt_optimizer_set_comm(m.o, comm));
  if (opt.bucket > 0) CK(zopt_optimizer_set_bucket_elems(m.o, opt.bucket));
  double v;
  if (zopt_optimizer_get_hyper(m.o, 0, "lr", &v) == ZOPT_OK) {
    CK(zopt_optimizer_set_hyper(m.o, 0, "lr", 1e-2));
    CK(zopt_optimizer_set_hyper(m.o, 1, "lr", 3e-3));
  }
  if (zopt_optimizer_get_hyper(m.o, 0, "weight_decay", &v) == ZOPT_OK)
    CK(zopt_optimizer_set_hyper(m.o, 1, "weight_decay", 0.1));
  if (m.d->flags & ZOPT_FLAG_LOSS_SCALE) {
    zopt_loss_scaler_config c = {1024.0, 2.0, 0.5, 2, 1.0, 1};
    CK(zopt_optimizer_configure_loss_scaler(m.o, &c));
  }
  CK(zopt_optimizer_set_seed(m.o, 42));
  return true;
}

// Rank r's gradient of tensor t at step k, already multiplied by the loss
// scale S (exact: S is a power of two).
// Part `cls` of a linked step has gradients of its own (and the Inf, with
// --inf-at, is in part 1's gradients then).
float grad_value(const Options &opt, int r, int k, size_t t, int64_t i, double S, int cls = 0) {
  if (opt.inf_at == k && r == opt.world - 1 && t == 6 && i == 17 && cls == (opt.linked.empty() ? 0 : 1))
    return INFINITY;
  return (float)(value(2 + 10 * (uint64_t)cls, t, (uint64_t)k * 4096 + (uint64_t)r, (uint64_t)i, opt.grad_scale) * S);
}
bool has_grad(const Options &opt, int r, size_t t) {
  if (!opt.mask) return true;
  if (t == 3) return false;
  if (t == 5) return r == 0;
  return true;
}

void fill_grads(Model &m, const Options &opt, int r, int k, double S, int cls = 0) {
  for (size_t t = 0; t < m.g.size(); ++t)
    for (int64_t i = 0; i < kSizes[t]; ++i)
      store(m.g[t].data(), m.gdt, (size_t)i, has_grad(opt, r, t) ? grad_value(opt, r, k, t, i, S, cls) : 0.0f);
}

// The reference's gradient: the rank-order f32 sum of every rank's
// gradient (absent ones contribute nothing), rounded to the grad dtype.
void fill_ref_grads(Model &m, const Options &opt, int world, int k, double S, int cls = 0) {
  for (size_t t = 0; t < m.g.size(); ++t)
    for (int64_t i = 0; i < kSizes[t]; ++i) {
      float acc = 0;
      bool first = true;
      for (int r = 0; r < world; ++r) {
        // Each rank's value as stored in its grad dtype.
        unsigned char tmp[4];
        store(tmp, m.gdt, 0, has_grad(opt, r, t) ? grad_value(opt, r, k, t, i, S, cls) : 0.0f);
        float x = load(tmp, m.gdt, 0);
        acc = first ? x : acc + x;
        first = false;
      }
      store(m.g[t].data(), m.gdt, (size_t)i, acc);
    }
}

std::vector<uint8_t> mask_of(const Options &opt, int r) {
  std::vector<uint8_t> a(kSizes.size());
  for (size_t t = 0; t < a.size(); ++t) a[t] = has_grad(opt, r, t);
  return a;
}

// Hands the model's gradients to the optimizer bucket by bucket, last
// bucket first (any order the ranks share), NULL where this rank has no
// gradient; then poisons each gradient (quiet NaN) once every bucket it
// spans is reduced: the step must not read it.
bool stream_grads(int rank, Model &m, const Options &opt) {
  int nb = 0;
  CK(zopt_optimizer_num_buckets(m.o, &nb));
  std::vector<int> left(m.g.size(), 0);
  std::vector<std::vector<int>> ids(nb);
  for (int b = 0; b < nb; ++b) {
    int n = 0;
    CK(zopt_optimizer_bucket_tensors(m.o, b, nullptr, 0, &n));
    ids[b].resize(n);
    CK(zopt_optimizer_bucket_tensors(m.o, b, ids[b].data(), n, &n));
    for (int t : ids[b]) left[t]++;
  }
  auto poison = [&](int b) {
    for (int t : ids[b])
      if (--left[t] == 0)
        for (int64_t i = 0; i < kSizes[t]; ++i) store(m.g[t].data(), m.gdt, (size_t)i, NAN);
  };
  if (!opt.async) {
    for (int b = nb - 1; b >= 0; --b) {
      std::vector<const void *> g;
      for (int t : ids[b]) g.push_back(has_grad(opt, rank, (size_t)t) ? m.g[t].data() : nullptr);
      CK(zopt_optimizer_reduce_bucket(m.o, b, g.data(), (int)g.size()));
      poison(b);
    }
    return true;
  }
  // In the background: poison a bucket's gradients only once bucket_done
  // says it is finished (the runtime must not read them after that).
  const bool ascending = opt.misorder && rank == 1;
  std::vector<uint8_t> poisoned(nb, 0);
  auto poll = [&]() -> bool {
    for (int b = 0; b < nb; ++b) {
      int done = 0;
      CK(zopt_optimizer_bucket_done(m.o, b, &done));
      if (done && !poisoned[b]) poisoned[b] = 1, poison(b);
    }
    return true;
  };
  for (int i = 0; i < nb; ++i) {
    const int b = ascending ? i : nb - 1 - i;
    std::vector<const void *> g;
    for (int t : ids[b]) g.push_back(has_grad(opt, rank, (size_t)t) ? m.g[t].data() : nullptr);
    CK(zopt_optimizer_reduce_bucket_async(m.o, b, g.data(), (int)g.size()));
    if (!poll()) return false;
  }
  if (opt.misorder) return true;  // the step reports the failure
  // A second hand-over of a bucket is refused at once.
  {
    std::vector<const void *> g(ids[0].size(), nullptr);
    zopt_status st = zopt_optimizer_reduce_bucket_async(m.o, 0, g.data(), (int)g.size());
    report(rank, st == ZOPT_ERR_BAD_STATE && strstr(zopt_last_error(), "already"),
           "a second hand-over of bucket 0 is refused at once (\"%s\")", st ? zopt_last_error() : "no error");
    if (st != ZOPT_ERR_BAD_STATE) return false;
  }
  // Another call while buckets may be in flight: refused naming
  // wait_buckets, or (if it ran) every bucket had finished.
  zopt_memory_info mi{};
  zopt_status st = zopt_optimizer_memory_info(m.o, &mi);
  bool all_done = true;
  for (int b = 0; b < nb; ++b) {
    int done = 0;
    CK(zopt_optimizer_bucket_done(m.o, b, &done));
    all_done = all_done && done;
  }
  bool ok = st == ZOPT_OK ? all_done
                          : st == ZOPT_ERR_BAD_STATE && strstr(zopt_last_error(), "zopt_optimizer_wait_buckets");
  if (!ok) {
    report(rank, false, "memory_info while buckets are in flight: %s (all done: %d)",
           st ? zopt_last_error() : "ran", (int)all_done);
    return false;
  }
  CK(zopt_optimizer_wait_buckets(m.o));
  return poll();
}

bool expect_error(int rank, zopt_status st, const char *what, const char *needle) {
  const char *msg = zopt_last_error();
  bool ok = st != ZOPT_OK && strstr(msg, needle);
  report(rank, ok, "%s fails on every rank naming %s (rank %d: \"%s\")", what, needle, rank, st ? msg : "no error");
  return ok;
}

// One rank's whole run.
bool run_rank(int rank, int world, zopt_comm *comm, const Options &opt) {
  zopt_step *step = nullptr, *other = nullptr;
  CK(zopt_step_load(opt.step.c_str(), &step));
  std::unique_ptr<zopt_step, void (*)(zopt_step *)> own_step(step, zopt_step_free);
  if (!opt.other.empty()) CK(zopt_step_load(opt.other.c_str(), &other));
  std::unique_ptr<zopt_step, void (*)(zopt_step *)> own_other(other, zopt_step_free);
  Options o2 = opt;
  o2.world = world;

  // ---- deliberate mismatches: every rank must fail, naming rank 1 --------
  if (!opt.mismatch.empty()) {
    Model m;
    const bool odd = rank == 1;
    const zopt_step *s = (odd && opt.mismatch == "stage") ? other : step;
    const int odd_tensors = !odd ? 0 : opt.mismatch == "tensors" ? 1 : opt.mismatch == "size" ? 2 : 0;
    if (!build(rank, s, m, o2, comm, odd_tensors)) return false;
    if (opt.mismatch == "bucket" && odd) CK(zopt_optimizer_set_bucket_elems(m.o, opt.bucket * 2));
    zopt_status st = zopt_optimizer_finalize(m.o);
    // Every rank's message names the setting and both values.
    char want[160];
    if (opt.mismatch == "tensors") {
      snprintf(want, sizeof want, "tensor count: rank 0 has %zu, rank 1 has %zu", kSizes.size(), kSizes.size() - 1);
      return expect_error(rank, st, "another tensor list at finalize", want);
    }
    if (opt.mismatch == "size") {
      snprintf(want, sizeof want, "tensor %zu elements: rank 0 has %lld, rank 1 has %lld", kSizes.size() - 1,
               (long long)kSizes.back(), (long long)kSizes.back() - 1);
      return expect_error(rank, st, "another tensor size at finalize", want);
    }
    if (opt.mismatch == "stage") {
      snprintf(want, sizeof want, "ZeRO stage: rank 0 has %u, rank 1 has %u", zopt_step_get_descriptor(step)->zero_stage,
               zopt_step_get_descriptor(other)->zero_stage);
      return expect_error(rank, st, "another step (ZeRO stage) at finalize", want);
    }
    if (opt.mismatch == "bucket") {
      snprintf(want, sizeof want, "bucket size (elements; 0: the default): rank 0 has %lld, rank 1 has %lld",
               (long long)opt.bucket, (long long)opt.bucket * 2);
      return expect_error(rank, st, "another bucket size at finalize", want);
    }
    CK(st);
    const char *what = "?";
    if (opt.mismatch == "hyper") {
      if (odd) CK(zopt_optimizer_set_hyper(m.o, 0, "lr", 0.5));
      what = "other hyperparameters", snprintf(want, sizeof want, "group 0 lr: rank 0 has 0.01, rank 1 has 0.5");
    } else if (opt.mismatch == "seed") {
      if (odd) CK(zopt_optimizer_set_seed(m.o, 7));
      what = "another seed";
      snprintf(want, sizeof want, "seed: rank 0 has 0x000000000000002a, rank 1 has 0x0000000000000007");
    } else if (opt.mismatch == "steps") {
      if (odd) CK(zopt_optimizer_set_step_count(m.o, 1, 5));
      what = "another step count", snprintf(want, sizeof want, "group 1 step count: rank 0 has 0, rank 1 has 5");
    } else if (opt.mismatch == "clip") {
      if (odd) CK(zopt_optimizer_set_max_norm(m.o, 0.5));
      what = "another max_norm";
      snprintf(want, sizeof want, "clip max_norm: rank 0 has %.17g, rank 1 has 0.5", m.d->max_norm);
    } else if (opt.mismatch == "divisor") {
      if (odd) CK(zopt_optimizer_set_grad_divisor(m.o, 7));
      what = "another gradient divisor";
      snprintf(want, sizeof want, "gradient divisor: rank 0 has %d, rank 1 has 7", world);
    }
    fill_grads(m, o2, rank, 1, 1.0);
    zopt_step_result r{};
    if (opt.mismatch == "call") {
      // Rank 1 gathers params while the others step: the collectives differ.
      st = odd ? zopt_optimizer_gather_params(m.o, 0, (int)kSizes.size(), nullptr) : zopt_optimizer_step(m.o, &r);
      return expect_error(rank, st, "a rank calling another collective", "rank");
    }
    st = zopt_optimizer_step(m.o, &r);
    return expect_error(rank, st, what, want);
  }

  // ---- a stalled rank: the last one sleeps before its second step. Every
  // other rank's step fails within the communicator's timeout (1 s here),
  // naming it; the stalled rank's own step then fails at once, naming the
  // ranks that gave up.
  if (opt.stall) {
    Model m;
    if (!build(rank, step, m, o2, comm, 0)) return false;
    CK(zopt_optimizer_finalize(m.o));
    CK(zopt_comm_set_timeout(comm, 1.0));
    zopt_step_result r{};
    fill_grads(m, o2, rank, 1, 1.0);
    CK(zopt_optimizer_step(m.o, &r));
    fill_grads(m, o2, rank, 2, 1.0);
    const bool stalled = rank == world - 1;
    if (stalled) std::this_thread::sleep_for(std::chrono::milliseconds(2500));
    auto t0 = std::chrono::steady_clock::now();
    zopt_status st = zopt_optimizer_step(m.o, &r);
    double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    char want[96];
    snprintf(want, sizeof want, stalled ? "gave up on collective" : "rank %d did not call collective", world - 1);
    bool ok = expect_error(rank, st, stalled ? "the stalled rank's late step" : "a step while a rank stalls", want);
    bool fast = took < (stalled ? 0.5 : 2.0);
    report(rank, fast, "the error came after %.2f s (timeout 1 s)", took);
    return ok && fast;
  }

  // ---- the optimizer freed with buckets in flight: the queued ones are
  // skipped, a running one finishes, the thread is joined (no crash, leak
  // or hang; the sanitizer builds run this)
  if (opt.async_free) {
    Model m;
    if (!build(rank, step, m, o2, comm, false)) return false;
    CK(zopt_optimizer_finalize(m.o));
    fill_grads(m, o2, rank, 1, 1.0);
    int nb = 0;
    CK(zopt_optimizer_num_buckets(m.o, &nb));
    for (int b = nb - 1; b >= 0; --b) {
      int n = 0;
      CK(zopt_optimizer_bucket_tensors(m.o, b, nullptr, 0, &n));
      std::vector<int> ids(n);
      CK(zopt_optimizer_bucket_tensors(m.o, b, ids.data(), n, &n));
      std::vector<const void *> g;
      for (int t : ids) g.push_back(m.g[t].data());
      CK(zopt_optimizer_reduce_bucket_async(m.o, b, g.data(), n));
    }
    zopt_optimizer_free(m.o);
    m.o = nullptr;
    report(rank, nb > 1, "freed with %d buckets handed over in the background", nb);
    return nb > 1;
  }

  zopt_step *step2 = nullptr;
  if (!opt.linked.empty()) CK(zopt_step_load(opt.linked.c_str(), &step2));
  std::unique_ptr<zopt_step, void (*)(zopt_step *)> own_step2(step2, zopt_step_free);
  // parts[0] = (m, ref); with --linked also parts[1] = (m2, ref2).
  Model m, ref, m2, ref2;
  if (!build(rank, step, m, o2, comm, false) || !build(rank, step, ref, o2, nullptr, false)) return false;
  if (step2 && (!build(rank, step2, m2, o2, comm, false) || !build(rank, step2, ref2, o2, nullptr, false)))
    return false;
  const int nparts = step2 ? 2 : 1;
  Model *ms[2] = {&m, &m2}, *refs[2] = {&ref, &ref2};
  for (int c = 0; c < nparts; ++c) {
    CK(zopt_optimizer_finalize(ms[c]->o));
    CK(zopt_optimizer_finalize(refs[c]->o));
    CK(zopt_optimizer_set_grad_divisor(ms[c]->o, (double)world * opt.accum));
    CK(zopt_optimizer_set_grad_divisor(refs[c]->o, (double)world * opt.accum));
    if (opt.mask) {
      std::vector<uint8_t> a = mask_of(o2, rank);
      if (!opt.stream) CK(zopt_optimizer_set_active(ms[c]->o, a.data(), (int64_t)a.size()));
      // The reference has a gradient wherever any rank has one.
      std::vector<uint8_t> any(kSizes.size());
      for (size_t t = 0; t < any.size(); ++t)
        for (int r = 0; r < world; ++r) any[t] |= has_grad(o2, r, t);
      CK(zopt_optimizer_set_active(refs[c]->o, any.data(), (int64_t)any.size()));
    }
  }
  zopt_optimizer *parts[2] = {m.o, m2.o}, *ref_parts[2] = {ref.o, ref2.o};
  int first_step = 1;
  if (!opt.load.empty()) {
    // The reference replays the saving run's steps at its world size; the
    // model's params are what they were then (the model's checkpoint).
    Options os = o2;
    os.world = opt.from_world;
    CK(zopt_optimizer_set_grad_divisor(ref.o, (double)opt.from_world * opt.accum));
    for (int k = 1; k <= opt.loaded_steps; ++k) {
      double S = 1;
      CK(zopt_optimizer_get_loss_scale(ref.o, &S));
      fill_ref_grads(ref, os, opt.from_world, k, S);
      zopt_step_result b{};
      CK(zopt_optimizer_step(ref.o, &b));
    }
    CK(zopt_optimizer_set_grad_divisor(ref.o, (double)world * opt.accum));
    for (size_t t = 0; t < m.p.size(); ++t) m.p[t] = ref.p[t];
    CK(zopt_optimizer_load(m.o, opt.load.c_str()));
    zopt_step_result none{NAN, 0, 0};
    none.loss_scale = 0;
    zopt_step_result z = none;
    bool ok = compare(rank, m, ref, z, none, opt.loaded_steps, o2, "after loading");
    report(rank, ok, "checkpoint of %d rank(s) after %d steps loads at %d rank(s): every state equals one rank's",
           opt.from_world, opt.loaded_steps, world);
    first_step = opt.loaded_steps + 1;
  }
  bool all_ok = true;
  for (int k = first_step; k < first_step + opt.steps; ++k) {
    double S = 1, Sr = 1;
    CK(zopt_optimizer_get_loss_scale(m.o, &S));
    CK(zopt_optimizer_get_loss_scale(ref.o, &Sr));
    for (int c = 0; c < nparts; ++c) {
      fill_grads(*ms[c], o2, rank, k, S, c);
      fill_ref_grads(*refs[c], o2, world, k, Sr, c);
    }
    // This rank's gradients as handed over (the step overwrites the reduced ones).
    std::vector<std::vector<unsigned char>> own[2] = {m.g, m2.g};
    if (opt.stream)
      for (int c = 0; c < nparts; ++c)
        if (!stream_grads(rank, *ms[c], o2)) return false;
    zopt_step_result a{}, b{}, pre{};
    if (opt.begin) {
      // max_norm set at run time (steps with clipping), then the step in
      // two halves: the begin's norm is the step's; calls in between fail.
      if (m.d->flags & ZOPT_FLAG_CLIP)
        for (int c = 0; c < nparts; ++c) {
          CK(zopt_optimizer_set_max_norm(ms[c]->o, 0.5 * k));
          CK(zopt_optimizer_set_max_norm(refs[c]->o, 0.5 * k));
        }
      if (step2)
        CK(zopt_optimizer_step_linked_begin(parts, 2, &pre));
      else
        CK(zopt_optimizer_step_begin(m.o, &pre));
      zopt_status st = zopt_optimizer_set_seed(m.o, 1);
      bool refused = st == ZOPT_ERR_BAD_STATE && strstr(zopt_last_error(), "finish it with zopt_optimizer_step") &&
                     (!step2 || zopt_optimizer_step(m.o, &a) == ZOPT_ERR_BAD_STATE);
      report(rank, refused, "step %d: calls between zopt_optimizer_step_begin and the step are refused (\"%s\")", k,
             zopt_last_error());
      all_ok = all_ok && refused;
    }
    if (step2) {
      CK(zopt_optimizer_step_linked(parts, 2, &a));
      CK(zopt_optimizer_step_linked(ref_parts, 2, &b));
    } else if (opt.misorder) {
      zopt_status st = zopt_optimizer_step(m.o, &a);
      bool ok = expect_error(rank, st, "a step after rank 1 handed its buckets over in another order",
                             "(in the background)");
      // The optimizer is usable again: the failure was reported once.
      zopt_memory_info mi{};
      CK(zopt_optimizer_memory_info(m.o, &mi));
      return ok;
    } else {
      CK(zopt_optimizer_step(m.o, &a));
      CK(zopt_optimizer_step(ref.o, &b));
    }
    bool ok = compare(rank, m, ref, a, b, k, o2, "", &own[0]);
    if (opt.begin) {
      bool same = (std::isnan(pre.grad_norm) ? std::isnan(a.grad_norm) : pre.grad_norm == a.grad_norm) &&
                  pre.skipped == a.skipped && pre.loss_scale == a.loss_scale;
      report(rank, same, "step %d: zopt_optimizer_step_begin's norm %.17g is the step's %.17g", k, pre.grad_norm,
             a.grad_norm);
      ok = ok && same;
    }
    if (step2) {
      ok = compare(rank, m2, ref2, a, b, k, o2, "linked part 1", &own[1]) && ok;
      // One norm over both parts: float64 over the reference's gradients
      // scaled as the kernels scale them (the f32 product with the f32
      // coefficient 1 / (S D)), summed in long double: the kernels' f64
      // sums of ~500k terms are within ~1e-12; a norm that missed a part,
      // or one element (~2e-6), or scaled by another D is far outside 1e-10.
      const float gs = zopt_ref::grad_scale(Sr, world * opt.accum);
      long double sum = 0;
      for (int c = 0; c < nparts; ++c)
        for (size_t t = 0; t < kSizes.size(); ++t)
          sum += zopt_ref::sumsq_exact((size_t)kSizes[t], [&](size_t i) {
            return zopt_ref::norm_value(load(refs[c]->g[t].data(), refs[c]->gdt, i), gs);
          });
      double want = zopt_ref::norm((double)sum);
      bool norm_ok = std::isinf(want) ? std::isinf(b.grad_norm) || std::isnan(b.grad_norm)
                                      : std::fabs(b.grad_norm - want) <= 1e-10 * want;
      report(rank, norm_ok, "linked step %d: the norm %.17g is float64's over both parts (%.17g)", k, b.grad_norm,
             want);
      ok = ok && norm_ok;
    }
    all_ok = all_ok && ok;
    report(rank, ok, "step %d at %d rank(s) (norm %.17g%s) bit-identical to one rank on the rank-order sum", k, world,
           a.grad_norm, a.skipped ? ", skipped" : "");
  }
  for (int c = 0; c < nparts; ++c)
    if (!check_memory(rank, *ms[c], *refs[c], o2, c ? "linked part 1: " : "")) all_ok = false;
  if (!opt.save.empty()) CK(zopt_optimizer_save(m.o, opt.save.c_str()));
  return all_ok;
}

bool parse(int argc, char **argv, Options &o) {
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto val = [&](const char *k) -> const char * {
      size_t n = strlen(k);
      return a.compare(0, n, k) == 0 ? argv[i] + n : nullptr;
    };
    if (const char *v = val("--comm=")) o.comm = v;
    else if (const char *v = val("--world=")) o.world = atoi(v);
    else if (const char *v = val("--steps=")) o.steps = atoi(v);
    else if (const char *v = val("--bucket=")) o.bucket = atoll(v);
    else if (const char *v = val("--params=")) o.params = atoll(v);
    else if (const char *v = val("--threads=")) o.threads = atoi(v);
    else if (const char *v = val("--grad-scale=")) o.grad_scale = atof(v);
    else if (const char *v = val("--accum=")) o.accum = atoi(v);
    else if (const char *v = val("--inf-at=")) o.inf_at = atoi(v);
    else if (const char *v = val("--save=")) o.save = v;
    else if (const char *v = val("--load=")) o.load = v;
    else if (const char *v = val("--from-world=")) o.from_world = atoi(v);
    else if (const char *v = val("--loaded-steps=")) o.loaded_steps = atoi(v);
    else if (const char *v = val("--mismatch=")) o.mismatch = v;
    else if (a == "--begin") o.begin = true;
    else if (a == "--stall") o.stall = true;
    else if (const char *v = val("--other=")) o.other = v;
    else if (const char *v = val("--linked=")) o.linked = v;
    else if (a == "--mask") o.mask = true;
    else if (a == "--delay") o.delay = true;
    else if (a == "--stream") o.stream = true;
    else if (a == "--async") o.stream = o.async = true;
    else if (a == "--async-misorder") o.stream = o.async = o.misorder = true;
    else if (a == "--async-free") o.stream = o.async = o.async_free = true;
    else if (a[0] != '-' && o.step.empty()) o.step = a;
    else {
      fprintf(stderr, "zopt-zero-check: unknown argument '%s'\n", argv[i]);
      return false;
    }
  }
  return !o.step.empty();
}

}  // namespace

int main(int argc, char **argv) {
  Options opt;
  if (!parse(argc, argv, opt)) {
    fprintf(stderr, "usage: zopt-zero-check STEP.so [--comm=loopback|mpi] [--world=W] [options]\n");
    return 2;
  }
  if (opt.params > 0) {  // scale the model, keeping its small tensors
    int64_t base = 0, small = 0;
    for (int64_t n : kSizes) (n >= 1000 ? base : small) += n;
    for (int64_t &n : kSizes)
      if (n >= 1000) n = std::max<int64_t>(1, (int64_t)((double)n * (double)(opt.params - small) / (double)base));
  }
  if (opt.comm == "mpi") {
    zopt_comm *c = nullptr;
    if (zopt_comm_create_mpi(nullptr, &c) != ZOPT_OK) {
      fprintf(stderr, "zopt-zero-check: %s\n", zopt_last_error());
      return 1;
    }
    int rank = zopt_comm_rank(c), world = zopt_comm_size(c);
    opt.world = world;
    zopt_comm_set_timeout(c, 60);
    run_rank(rank, world, c, opt);
    zopt_comm_free(c);
    printf("rank %d: %d passed, %d failed\n", rank, g_passes, g_failures);
    return g_failures ? 1 : 0;
  }
  const int W = opt.world;
  std::vector<zopt_comm *> comms(W);
  zopt_loopback_options lo{};
  lo.timeout_s = 20;
  lo.flags = opt.delay ? (ZOPT_LOOPBACK_DELAY | ZOPT_LOOPBACK_POISON) : 0;
  lo.seed = 5;
  if (zopt_comm_create_loopback(W, &lo, comms.data()) != ZOPT_OK) {
    fprintf(stderr, "zopt-zero-check: %s\n", zopt_last_error());
    return 1;
  }
  std::vector<std::thread> th;
  for (int r = 0; r < W; ++r) th.emplace_back([&, r] { run_rank(r, W, comms[r], opt); });
  for (auto &t : th) t.join();
  for (auto *c : comms) zopt_comm_free(c);
  printf("%d passed, %d failed\n", g_passes, g_failures);
  return g_failures ? 1 : 0;
}
