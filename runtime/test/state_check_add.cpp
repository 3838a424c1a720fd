// state_check_add.cpp - zopt-state-check's tests 1 and 2 (state_check.cpp
// says what they check): tensors added after finalize keep every state and
// count, bit-identical to an optimizer built with them; adds refused alike
// on every rank, nothing changed.
#include "state_test_util.h"

#include "zopt/comm.h"
#include "zopt/zopt.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <string>
#include <vector>

namespace stt {

// ---- 1. tensors added after finalize ------------------------------------------

void test_add() {
  std::vector<Snap> after((size_t)g_world), with_all((size_t)g_world);
  std::atomic<bool> kept{true}, fresh{true};
  on_ranks([&](int r, zopt_comm *c) {
    Rank A;
    RANK_CK(build_old(A, c));
    Snap s0;
    RANK_CK(A.snapshot(&s0));
    const size_t T0 = A.n.size();
    A.grow(kNew, kNewG, 5);
    RANK_CK(A.add(T0) == ZOPT_OK);
    RANK_CK(A.hypers());
    Snap s1;
    RANK_CK(A.snapshot(&s1));
    // The old tensors kept every state and count; the new ones start fresh.
    for (size_t t = 0; t < T0; ++t)
      if (s1.st[t] != s0.st[t] || s1.steps[t] != s0.steps[t]) kept = false;
    if (s1.scale != s0.scale || s1.good != s0.good) kept = false;
    for (int gi = 0; gi < 2; ++gi)
      if (s1.gcounts[(size_t)gi] != s0.gcounts[(size_t)gi]) kept = false;
    if (s1.gcounts[2] != 0) fresh = false;
    int pk = -1;
    for (uint32_t k = 0; k < A.d->num_states; ++k)
      if (A.d->states[k].kind == ZOPT_STATE_PARAM) pk = (int)k;
    for (size_t t = T0; t < A.n.size(); ++t) {
      if (s1.steps[t] != 0) fresh = false;
      for (uint32_t k = 0; k < A.d->num_states; ++k) {
        const zopt_state_desc &sd = A.d->states[k];
        if (!is_owned(sd.kind)) continue;
        if (is_q8_state(sd)) {  // the zero code, absmax 0
          fresh = fresh && q8_fresh(sd, s1.st[t][k], A.n[t]);
          continue;
        }
        for (int64_t i = 0; i < A.n[t]; ++i) {
          float v = load(s1.st[t][k].data(), sd.dtype, (size_t)i);
          if (sd.dtype == ZOPT_DTYPE_I16) {  // a remainder master: rebuilt from the param (abi.h)
            uint16_t hi, lo;
            memcpy(&hi, s1.st[t][(size_t)pk].data() + 2 * i, 2);
            memcpy(&lo, s1.st[t][k].data() + 2 * i, 2);
            const uint32_t b = zopt_remainder_join(hi, lo);
            memcpy(&v, &b, 4);
          }
          float want = sd.init == ZOPT_INIT_FROM_PARAM ? load(s1.st[t][(size_t)pk].data(), A.pdt, (size_t)i) : 0.0f;
          if (memcmp(&v, &want, 4)) {
            fresh = false;
            break;
          }
        }
      }
    }
    RANK_CK(A.steps(2, 3));
    RANK_CK(A.snapshot(&after[(size_t)r]));
    // The reference: every tensor registered before finalize (add_tensors,
    // the new group included), the old tensors' params and states those A
    // had when the tensors were added.
    Rank B;
    RANK_CK(B.create(c));
    B.grow(kOld, kOldG, 1);
    B.grow(kNew, kNewG, 5);
    for (size_t t = 0; t < T0; ++t) memcpy(B.p[t], s0.st[t][(size_t)pk].data(), (size_t)B.n[t] * esz(B.pdt));
    RANK_CK(B.add(0) == ZOPT_OK);
    RANK_CK(zopt_optimizer_finalize(B.o) == ZOPT_OK && B.hypers());
    for (size_t t = 0; t < T0; ++t) {
      for (uint32_t k = 0; k < B.d->num_states; ++k) {
        const zopt_state_desc &sd = B.d->states[k];
        if (!is_owned(sd.kind)) continue;
        RANK_CK(zopt_optimizer_write_state_raw(B.o, (int)t, (zopt_state_kind)sd.kind, s0.st[t][k].data(),
                                               (size_t)selems(sd, B.n[t]) * esz(sd.dtype)) == ZOPT_OK);
      }
      RANK_CK(zopt_optimizer_set_tensor_step(B.o, (int)t, s0.steps[t]) == ZOPT_OK);
    }
    for (int gi = 0; gi < 2; ++gi) RANK_CK(zopt_optimizer_set_step_count(B.o, gi, s0.gcounts[(size_t)gi]) == ZOPT_OK);
    RANK_CK(zopt_optimizer_set_loss_scaler_state(B.o, s0.scale, s0.good) == ZOPT_OK);
    RANK_CK(B.steps(2, 3));
    RANK_CK(B.snapshot(&with_all[(size_t)r]));
  });
  report(kept, "add_tensors after finalize (2 steps, %zu + %zu tensors, a new group): every old state, count and "
               "the scaler kept",
         kOld.size(), kNew.size());
  report(fresh, "the added tensors start as at finalize (master = param, moments 0, counts 0)");
  bool same = true;
  std::string where;
  for (int q = 0; q < g_world; ++q)
    if (after[(size_t)q] != with_all[(size_t)q]) {
      same = false;
      where = diff(after[(size_t)q], with_all[(size_t)q]);
    }
  report(same && !after[0].st.empty() && after[0].steps[0] == 5,
         "3 steps after the add are bit-identical to an optimizer built with every tensor into which the old "
         "states were written%s%s",
         where.empty() ? "" : ": differs at ", where.c_str());
  // With gradient streaming (ZeRO-2/3 CPU steps at W > 1): the same steps,
  // the gradients handed over bucket by bucket, bit-identical; and no
  // addition once a bucket was reduced for the next step.
  zopt_step *st = nullptr;
  zopt_step_load(g_step.c_str(), &st);
  const zopt_step_descriptor *d = zopt_step_get_descriptor(st);
  bool can_stream = g_world > 1 && d->zero_stage >= 2;
  for (uint32_t k = 0; k < d->num_states; ++k) can_stream = can_stream && d->states[k].placement == ZOPT_PLACE_CPU;
  zopt_step_free(st);
  if (!can_stream) return;
  std::atomic<bool> streamed{true};
  Outcomes reduced;
  on_ranks([&](int r, zopt_comm *c) {
    Rank S;
    S.streaming = true;
    RANK_CK(build_old(S, c));
    const size_t T0 = S.n.size();
    S.grow(kNew, kNewG, 5);
    RANK_CK(S.add(T0) == ZOPT_OK);
    RANK_CK(S.hypers() && S.steps(2, 3));
    Snap s;
    RANK_CK(S.snapshot(&s));
    if (s != after[(size_t)r]) streamed = false;
    RANK_CK(S.reduce_buckets(0, 1));
    std::vector<int64_t> one = {5};
    S.grow(one, {2}, 7);
    reduced.set(r, S.add(S.reg));
  });
  report(streamed, "with gradient streaming: tensors added after finalize, the same steps bit-identical");
  report(reduced.all(ZOPT_ERR_BAD_STATE, "was reduced"),
         "with gradient streaming: no addition once a bucket was reduced for the next step (%s)",
         reduced.msg[0].c_str());
}

void test_add_refused() {
  std::atomic<bool> unchanged{true}, stepped{true};
  Outcomes differ, begun, one_bad;
  std::vector<std::string> errs;
  std::mutex mu;
  on_ranks([&](int r, zopt_comm *c) {
    Rank A;
    RANK_CK(build_old(A, c));
    Snap s0, s1;
    RANK_CK(A.snapshot(&s0));
    const size_t T0 = A.n.size();
    A.grow(kNew, kNewG, 5);
    std::vector<int> gs = {1, 2, 2};
    std::vector<void *> ps = {A.p[T0], A.p[T0 + 1], A.p[T0 + 2]};
    std::vector<void *> gr = {A.g[T0], A.g[T0 + 1], A.g[T0 + 2]};
    std::vector<int64_t> ns = {kNew[0], kNew[1], kNew[2]};
    const zopt_dtype pdt = (zopt_dtype)A.pdt, other = (zopt_dtype)(A.pdt == ZOPT_DTYPE_F32 ? ZOPT_DTYPE_BF16 : ZOPT_DTYPE_F32);
    struct Bad {
      const char *what;
      std::function<zopt_status()> call;
    };
    void *dup = A.p[1];  // an old tensor's param
    const std::vector<Bad> bad = {
        {"another dtype", [&] { return zopt_optimizer_add_tensors(A.o, 1, 3, gs.data(), ps.data(), gr.data(), ns.data(), other, nullptr, nullptr); }},
        {"a group out of range", [&] { std::vector<int> g2 = {1, 3, 2}; return zopt_optimizer_add_tensors(A.o, 1, 3, g2.data(), ps.data(), gr.data(), ns.data(), pdt, nullptr, nullptr); }},
        {"a registered param", [&] { std::vector<void *> p2 = {ps[0], dup, ps[2]}; return zopt_optimizer_add_tensors(A.o, 1, 3, gs.data(), p2.data(), gr.data(), ns.data(), pdt, nullptr, nullptr); }},
        {"one param twice", [&] { std::vector<void *> p2 = {ps[0], ps[0], ps[2]}; return zopt_optimizer_add_tensors(A.o, 1, 3, gs.data(), p2.data(), gr.data(), ns.data(), pdt, nullptr, nullptr); }},
        {"a NULL grad", [&] { std::vector<void *> g2 = {gr[0], nullptr, gr[2]}; return zopt_optimizer_add_tensors(A.o, 1, 3, gs.data(), ps.data(), g2.data(), ns.data(), pdt, nullptr, nullptr); }},
        {"a negative numel", [&] { std::vector<int64_t> n2 = {kNew[0], -1, kNew[2]}; return zopt_optimizer_add_tensors(A.o, 1, 3, gs.data(), ps.data(), gr.data(), n2.data(), pdt, nullptr, nullptr); }},
        {"NULL arrays", [&] { return zopt_optimizer_add_tensors(A.o, 1, 3, nullptr, ps.data(), gr.data(), ns.data(), pdt, nullptr, nullptr); }},
        {"new_groups < 0", [&] { return zopt_optimizer_add_tensors(A.o, -1, 3, gs.data(), ps.data(), gr.data(), ns.data(), pdt, nullptr, nullptr); }},
    };
    for (const Bad &b : bad) {
      zopt_status st = b.call();
      if (st != ZOPT_ERR_INVALID_ARGUMENT) {
        std::lock_guard<std::mutex> lk(mu);
        errs.push_back(std::string(b.what) + " -> " + std::to_string((int)st) + ": " + zopt_last_error());
      }
    }
    int64_t cnt;
    if (zopt_optimizer_get_tensor_step(A.o, (int)T0, &cnt) != ZOPT_ERR_INVALID_ARGUMENT) unchanged = false;
    RANK_CK(A.snapshot(&s1));
    if (s1 != s0) unchanged = false;
    // W > 1: the last rank adds another size: refused on every rank.
    if (g_world > 1) {
      std::vector<int64_t> n2 = ns;
      if (r == g_world - 1) n2[1] = 6;
      differ.set(r, zopt_optimizer_add_tensors(A.o, 1, 3, gs.data(), ps.data(), gr.data(), n2.data(), pdt, nullptr, nullptr));
      std::vector<void *> g2 = gr;
      if (r == g_world - 1) g2[1] = nullptr;  // refused on that rank only
      one_bad.set(r, zopt_optimizer_add_tensors(A.o, 1, 3, gs.data(), ps.data(), g2.data(), ns.data(), pdt, nullptr, nullptr));
      RANK_CK(A.snapshot(&s1));
      if (s1 != s0) unchanged = false;
    }
    // A begun step: refused (and the step finishes).
    zopt_step_result res;
    RANK_CK(zopt_optimizer_step_begin(A.o, &res) == ZOPT_OK);
    begun.set(r, A.add(T0));
    RANK_CK(zopt_optimizer_step(A.o, nullptr) == ZOPT_OK);
    // Then it works, and the next step runs.
    RANK_CK(A.add(T0) == ZOPT_OK);
    if (!A.steps(3, 1)) stepped = false;
  });
  std::string e;
  for (const std::string &x : errs) e += " [" + x + "]";
  report(errs.empty() && unchanged, "refused add_tensors calls (dtype, group, registered or repeated param, NULL grad, "
                                    "numel, NULL arrays, counts): INVALID_ARGUMENT, nothing changed%s",
         e.c_str());
  if (g_world > 1)
    report(differ.all(ZOPT_ERR_INVALID_ARGUMENT, "added different tensors"),
           "ranks adding different tensors: refused on every rank alike, nothing changed (%s)", differ.msg[0].c_str());
  if (g_world > 1)
    report(one_bad.all(ZOPT_ERR_INVALID_ARGUMENT, "grad pointer is NULL"),
           "an entry refused on one rank only: refused on every rank alike, nothing changed (%s)",
           one_bad.msg[0].c_str());
  report(begun.all(ZOPT_ERR_BAD_STATE), "add_tensors during a begun step: BAD_STATE (%s)", begun.msg[0].c_str());
  report(stepped, "after the refusals the add works and the next step runs");
}

}  // namespace stt
