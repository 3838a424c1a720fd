//===- gpu-host-tensors.cpp - tensors of a GPU step ----------------------===//
//
// The active mask (per-tensor step counts), views at misaligned offsets of
// flat buffers, and (--big) a tensor of more than 2^32 elements.
//===----------------------------------------------------------------------===//
#include "gpu-host-check.h"

namespace ghc {

// The active mask (zopt_optimizer_set_active) of a GPU step: the mask on
// the device (per tensor, then per group), the tensors' own step counts
// (FINISH, emulated by the stand-in as the real kernel: the step t of every
// active tensor and the count of every group with an active tensor), a
// tensor that joins later starting at t = 1 (PREPARE reads its t), the
// counts through set_tensor_step and a checkpoint, a mask refused during a
// capture or with the wrong length leaving the old one.
void active_checks(Fake &f, zopt_step *step) {
  const StepInfo si = info_of(step);
  f.set_emulation(1, 0);
  Setup su = make_optimizer(f, step, si, {33, 1000, 5000, 7});  // groups 0 1 0 1
  zopt_optimizer *o = su.o;
  Z(zopt_optimizer_finalize(o));
  auto counts = [&](zopt_optimizer *x) {
    std::string s;
    for (int t = 0; t < 4; ++t) {
      int64_t c = -1;
      Z(zopt_optimizer_get_tensor_step(x, t, &c));
      s += std::to_string(c) + (t < 3 ? " " : "");
    }
    return s;
  };
  auto groups = [&](zopt_optimizer *x) {
    int64_t a = -1, b = -1;
    Z(zopt_optimizer_get_step_count(x, su.gid[0], &a));
    Z(zopt_optimizer_get_step_count(x, su.gid[1], &b));
    return std::to_string(a) + " " + std::to_string(b);
  };
  const uint8_t mask[4] = {1, 0, 1, 0};  // group 1 has no active tensor
  const int l0 = f.num_launches();
  Z(zopt_optimizer_set_active(o, mask, 4));
  Z(zopt_optimizer_step(o, nullptr));
  Z(zopt_optimizer_step(o, nullptr));
  f.drain_all();
  const uint8_t *act = nullptr;
  const double *tt = nullptr;
  for (const Rec &l : launches_since(f, l0)) {
    if (l.role == "UPDATE") act = (const uint8_t *)(uintptr_t)l.args[6];
    if (l.role == "PREPARE") tt = (const double *)(uintptr_t)l.args[3];
  }
  check(act && act[0] == 1 && act[1] == 0 && act[2] == 1 && act[3] == 0 && act[4] == 1 && act[5] == 0,
        "set_active on a GPU step: the mask on the device, per tensor (1 0 1 0) then per group (1 0), read by "
        "UPDATE");
  std::string c = counts(o), g = groups(o);
  check(c == "2 0 2 0" && g == "2 0",
        "2 steps with tensors 1 and 3 inactive: per-tensor counts " + c + " (2 0 2 0), group counts " + g +
            " (2 0): FINISH advances only the active tensors and groups");
  Z(zopt_optimizer_set_active(o, nullptr, 0));
  const double t_next = tt ? tt[1] : 0;  // what the next PREPARE reads for tensor 1's row
  Z(zopt_optimizer_step(o, nullptr));
  f.drain_all();
  c = counts(o), g = groups(o);
  check(c == "3 1 3 1" && g == "3 1" && t_next == 1 && act[1] == 1,
        "every tensor active again: tensor 1 joins at t = 1 (the device's t of its coefficient row: " +
            std::to_string((int)t_next) + "), counts " + c + ", groups " + g);
  Z(zopt_optimizer_set_tensor_step(o, 1, 7));
  c = counts(o);
  check(c == "3 7 3 1" && tt && tt[1] == 8,
        "set_tensor_step on a GPU step: count " + c + ", the device's t of tensor 1 is 8");
  // Refusals leave the mask as it was: the wrong length; during a capture.
  const uint8_t three[3] = {0, 0, 0};
  zopt_status st_n = zopt_optimizer_set_active(o, three, 3);
  void *cs = nullptr, *graph = nullptr;
  f.stream_create(&cs, 0);
  Z(zopt_optimizer_set_stream(o, cs));
  f.begin_capture(cs, 0);
  zopt_status st_cap = zopt_optimizer_set_active(o, mask, 4);
  std::string msg_cap = zopt_last_error();
  f.end_capture(cs, &graph);
  Z(zopt_optimizer_step(o, nullptr));
  f.drain_all();
  c = counts(o);
  check(st_n == ZOPT_ERR_INVALID_ARGUMENT && st_cap == ZOPT_ERR_BAD_STATE &&
            msg_cap.find("capturing a CUDA graph") != std::string::npos && c == "4 8 4 2" && act[1] == 1,
        "set_active refused with 3 entries for 4 tensors and during a capture (" + msg_cap +
            "); the mask stays all-active: counts " + c);
  // A checkpoint holds the per-tensor counts.
  std::string ck = "/tmp/zopt-host-check-active-" + std::to_string(getpid()) + ".ckpt";
  Z(zopt_optimizer_save(o, ck.c_str()));
  Setup s2 = make_optimizer(f, step, si, {33, 1000, 5000, 7});
  Z(zopt_optimizer_finalize(s2.o));
  Z(zopt_optimizer_load(s2.o, ck.c_str()));
  remove(ck.c_str());
  c = counts(s2.o), g = groups(s2.o);
  check(c == "4 8 4 2" && g == "4 2", "checkpoint round trip: per-tensor counts " + c + ", group counts " + g);
  f.set_emulation(0, 0);
  for (Setup *x : {&su, &s2}) {
    zopt_optimizer_free(x->o);
    for (size_t i = 0; i < x->dp.size(); ++i) {
      f.mem_free(x->dp[i]);
      f.mem_free(x->dg[i]);
    }
  }
}

// Views into flat buffers at odd element offsets (DeepSpeed, FSDP): the
// owned states of each tensor get the 16-byte phase of its param, so that
// the kernels' head (abi.h) reaches one element where every pointer is
// 16-byte aligned and the rest of the chunk takes vectors; a grad whose
// phase differs from its param's leaves that tensor scalar. The grads are
// views at the same element offsets into a flat buffer of the grad's dtype
// (an f32 buffer beside bf16 params: DeepSpeed's and FSDP's flat f32 grad
// buffers), so their byte offsets are those of the params times eg / ep.
void misaligned_checks(Fake &f, zopt_step *step) {
  const StepInfo si = info_of(step);
  const zopt_step_descriptor *d = si.d;
  const std::vector<int64_t> sizes = {7, 100, 3, 1000, 4097, 61};
  int64_t total = 0;
  for (int64_t n : sizes) total += n + 1;
  unsigned long long fp = 0, fg = 0;
  f.mem_alloc(&fp, (size_t)(total + 16) * si.ep);
  f.mem_alloc(&fg, (size_t)(total + 16) * si.eg);
  memset((void *)(uintptr_t)fp, 0, (size_t)(total + 16) * si.ep);
  zopt_optimizer *o = nullptr;
  Z(zopt_optimizer_create(step, &o));
  int gid = 0, id = 0;
  Z(zopt_optimizer_add_group(o, &gid));
  std::vector<uintptr_t> pv, gv;
  int64_t off = 1;  // every view starts at an odd element
  for (size_t t = 0; t < sizes.size(); ++t) {
    // The last tensor's grad is one element further than its param's phase.
    int64_t goff = off + (t + 1 == sizes.size() ? 1 : 0);
    pv.push_back((uintptr_t)fp + (uintptr_t)off * si.ep);
    gv.push_back((uintptr_t)fg + (uintptr_t)goff * si.eg);
    Z(zopt_optimizer_add_tensor(o, gid, (void *)pv.back(), (void *)gv.back(), sizes[t], (zopt_dtype)si.pdt, &id));
    off += sizes[t] + 1;
  }
  Z(zopt_optimizer_finalize(o));
  int l0 = f.num_launches();
  Z(zopt_optimizer_step(o, nullptr));
  const unsigned long long *ptrs = nullptr;
  const zopt_gpu_chunk *ch = nullptr;
  int64_t nch = 0;
  for (const Rec &l : launches_since(f, l0))
    if (l.role == "UPDATE") {
      ptrs = (const unsigned long long *)(uintptr_t)l.args[0];
      ch = (const zopt_gpu_chunk *)(uintptr_t)l.args[2];
      nch = (int64_t)l.args[3];
    }
  // q8 moments (abi.h "q8 moments"): the UPDATE runs an element per thread
  // (no vectors), and each tensor's states start at a q8 block of their
  // buffers instead of the param's phase: every owned state 16-byte aligned
  // (a PER_BLOCK absmax: 4), every chunk whole blocks.
  bool q8 = false;
  for (uint32_t k = 0; k < d->num_states; ++k) q8 |= d->states[k].dtype == ZOPT_DTYPE_Q8;
  if (q8) {
    bool ok = nch > 0;
    for (int64_t c = 0; c < nch; ++c) {
      ok &= ch[c].begin % ZOPT_Q8_BLOCK == 0;
      for (uint32_t k = 0; k < d->num_states; ++k)
        if (d->states[k].kind != ZOPT_STATE_PARAM && d->states[k].kind != ZOPT_STATE_GRAD)
          ok &= ptrs[ch[c].segment * d->num_states + k] % ((d->states[k].flags & ZOPT_STATE_PER_BLOCK) ? 4 : 16) == 0;
    }
    check(ok, "misaligned views, q8 moments: the owned states at q8 block boundaries (not the param's phase: the q8 "
              "UPDATE is scalar), every chunk whole blocks");
    zopt_optimizer_free(o);
    f.mem_free(fp);
    f.mem_free(fg);
    return;
  }
  // The kernels' head rule (abi.h) over every state pointer of the chunk.
  size_t emin = 4;
  for (uint32_t k = 0; k < d->num_states; ++k) emin = std::min(emin, dtype_size(d->states[k].dtype));
  const int64_t lanes = (int64_t)(16 / emin);
  bool same_phase_vector = true, other_scalar = true, owned_unaligned = false;
  for (int64_t c = 0; c < nch; ++c) {
    const size_t t = ch[c].segment;
    bool found = false;
    for (int64_t h = 0; h < lanes && !found; ++h) {
      bool all = true;
      for (uint32_t k = 0; k < d->num_states; ++k)
        all &= (ptrs[t * d->num_states + k] + (uint64_t)(ch[c].begin + h) * dtype_size(d->states[k].dtype)) % 16 == 0;
      found = all;
    }
    if (t + 1 == sizes.size()) other_scalar &= !found;
    else same_phase_vector &= found;
    for (uint32_t k = 0; k < d->num_states; ++k)
      if (d->states[k].kind != ZOPT_STATE_PARAM && d->states[k].kind != ZOPT_STATE_GRAD)
        owned_unaligned |= ptrs[t * d->num_states + k] % 16 != 0;
  }
  check(nch > 0 && same_phase_vector && owned_unaligned,
        "misaligned views: every chunk of a view whose param and grad share a 16-byte phase has one element where "
        "all its pointers (owned states laid out in the param's phase) are 16-byte aligned: a scalar head, then "
        "vectors");
  check(other_scalar, "misaligned views: a tensor whose grad has another phase than its param stays scalar");
  zopt_optimizer_free(o);
  f.mem_free(fp);
  f.mem_free(fg);
}

// A tensor of more than 2^32 elements (pure bf16 steps: no master): chunks
// never straddle a multiple of 2^32 elements, so the kernels' stochastic-
// rounding index_hi is the chunk's (begin + j) >> 32.
void big_checks(Fake &f, zopt_step *step) {
  const StepInfo si = info_of(step);
  const int64_t big = ((int64_t)1 << 32) + 3 * 65536 + 5;
  const std::vector<int64_t> sizes = {1000, big, 17};
  Setup su = make_optimizer(f, step, si, sizes);
  Z(zopt_optimizer_set_seed(su.o, 42));
  Z(zopt_optimizer_finalize(su.o));
  int l0 = f.num_launches();
  Z(zopt_optimizer_step(su.o, nullptr));
  const zopt_gpu_chunk *ch = nullptr;
  int64_t nch = 0;
  bool sr_args = false;
  for (const Rec &l : launches_since(f, l0))
    if (l.role == "UPDATE") {
      ch = (const zopt_gpu_chunk *)(uintptr_t)l.args[2];
      nch = (int64_t)l.args[3];
      sr_args = l.nargs == 9 && l.args[8] == 42;
    }
  int64_t chunk = 0;
  bool cover = ch && chunks_cover(ch, nch, sizes, &chunk);
  int64_t hi = 0, at_boundary = 0;
  for (int64_t c = 0; c < nch; ++c)
    if (ch[c].segment == 1 && (ch[c].begin >> 32) == 1) {
      ++hi;
      at_boundary += ch[c].begin == ((int64_t)1 << 32);
    }
  check(cover && hi > 0 && at_boundary == 1 && sr_args,
        "a tensor of 2^32 + " + std::to_string(big - ((int64_t)1 << 32)) + " elements: " + std::to_string(nch) +
            " chunks cover it, one starts at element 2^32 and " + std::to_string(hi) +
            " lie above it (index_hi 1), none straddles 2^32; UPDATE gets the globals and the seed");
  zopt_optimizer_free(su.o);
  for (size_t i = 0; i < sizes.size(); ++i) {
    f.mem_free(su.dp[i]);
    f.mem_free(su.dg[i]);
  }
}

}  // namespace ghc
