//===- gpu-host-step.cpp - a GPU step on the stand-in --------------------===//
//
// A GPU step's host side: the image, the segment, state and chunk tables,
// the grids, the launch sequence of a step, the device-resident step state,
// hyperparameter writes, results read back, checkpoints.
//===----------------------------------------------------------------------===//
#include "gpu-host-check.h"

namespace ghc {

int gpu_main_check(Fake &f, zopt_step *step, const char *path) {
  const StepInfo si = info_of(step);
  const zopt_step_descriptor *d = si.d;
  printf("INFO GPU step '%s': param %s, grad %s\n", d->name, dtype_name(si.pdt), dtype_name(si.gdt));
  const uint64_t seed = 0x0123456789ABCDEFull;
  void *ctx0 = nullptr;
  f.ctx_current(&ctx0);
  int c_create = f.num_calls();
  zopt_optimizer *probe = nullptr;
  Z(zopt_optimizer_create(step, &probe));
  check(f.image_magic() == 0xBA55ED50u, "cuModuleLoadData got a CUDA fatbinary (magic 0xBA55ED50)");
  // Every kernel's .param list, as the stand-in read it from the PTX.
  std::string plist;
  for (const char *k : {"_prepare_gpu", "_update", "_sumsq", "_finish", "_init_gpu"}) {
    size_t sizes[16];
    std::string name = std::string(d->name) + k;
    if (!strcmp(k, "_update") || !strcmp(k, "_sumsq")) {
      for (uint32_t i = 0; i < d->num_kernels; ++i)
        if (d->kernels[i].device == ZOPT_PLACE_GPU &&
            d->kernels[i].role == (strcmp(k, "_update") ? ZOPT_KERNEL_SUMSQ : ZOPT_KERNEL_UPDATE))
          name = d->kernels[i].symbol;
    }
    int n = f.kernel_params(name.c_str(), sizes);
    if (n >= 0) plist += role_of(name) + "=" + std::to_string(n) + " ";
  }
  check(f.image_has_ptx(), "the image's PTX is stored uncompressed (the stand-in read the .param lists: " + plist + ")");
  check(calls_since(f, c_create, "cuFuncGetParamInfo") > 0,
        "create checks every kernel's parameters against the image (cuFuncGetParamInfo)");
  void *ctx1 = nullptr;
  f.ctx_current(&ctx1);
  check(ctx1 == ctx0, "create leaves the caller's context (none) current");
  zopt_optimizer_free(probe);

  // Two groups, tensors of odd sizes, params/grads in "device" memory.
  const std::vector<int64_t> sizes = {1, 7, 17, 100, 1000, 4097};
  Setup su = make_optimizer(f, step, si, sizes);
  zopt_optimizer *o = su.o;
  if (si.sr) Z(zopt_optimizer_set_seed(o, seed));
  {
    std::vector<char> host(64), hostg(64);
    int id = 0;
    zopt_status st = zopt_optimizer_add_tensor(o, su.gid[0], host.data(), hostg.data(), 16, (zopt_dtype)si.pdt, &id);
    check(st == ZOPT_ERR_INVALID_ARGUMENT && strstr(zopt_last_error(), "not CUDA device memory") &&
              strstr(zopt_last_error(), "tensor 6"),
          std::string("host pointers refused, naming the tensor: ") + zopt_last_error());
    // Device pointers off their dtype's alignment (the kernels' scalar
    // accesses would fault): a grad half an element into its buffer (for
    // an f32 grad, where a view laid out at a 16-bit param's element size
    // lands), then a param.
    unsigned long long pb = 0, gb = 0;
    f.mem_alloc(&pb, 64 * si.ep);
    f.mem_alloc(&gb, 64 * si.eg);
    st = zopt_optimizer_add_tensor(o, su.gid[0], (void *)(uintptr_t)pb, (void *)(uintptr_t)(gb + si.eg / 2), 16,
                                   (zopt_dtype)si.pdt, &id);
    std::string mg = zopt_last_error();
    zopt_status st2 = zopt_optimizer_add_tensor(o, su.gid[0], (void *)(uintptr_t)(pb + si.ep / 2),
                                                (void *)(uintptr_t)gb, 16, (zopt_dtype)si.pdt, &id);
    std::string mp = zopt_last_error();
    check(st == ZOPT_ERR_INVALID_ARGUMENT && st2 == ZOPT_ERR_INVALID_ARGUMENT &&
              mg.find("the grad of tensor 6") != std::string::npos &&
              mg.find(std::string("not aligned to its dtype ") + dtype_name(si.gdt)) != std::string::npos &&
              mp.find("the param of tensor 6") != std::string::npos &&
              mp.find(std::string("not aligned to its dtype ") + dtype_name(si.pdt)) != std::string::npos,
          "a grad or param not aligned to its own dtype is refused, naming the tensor and the dtype: " + mg);
    f.mem_free(pb);
    f.mem_free(gb);
  }
  int c0 = f.num_calls(), l0 = f.num_launches();
  Z(zopt_optimizer_finalize(o));
  {
    auto ls = launches_since(f, l0);
    int dtoh = calls_since(f, c0, "cuMemcpyDtoHAsync");
    std::string seq = seq_of(ls);
    check(si.master ? (seq == "INIT " && dtoh == 0) : (seq.empty() && dtoh == 0),
          "finalize: the master from the params on the device (INIT), no copy through the host: " +
              (seq.empty() ? std::string("no master") : seq));
  }
  void *const stream = (void *)0x5157;
  Z(zopt_optimizer_set_stream(o, stream));

  // ---- one step: the launch sequence, nothing synchronous --------------------
  c0 = f.num_calls(), l0 = f.num_launches();
  int a0 = f.num_allocs();
  zopt_step_result r{};
  Z(zopt_optimizer_step(o, &r));
  int syncs = calls_since(f, c0, "cuStreamSynchronize"), allocs = calls_since(f, c0, "cuMemAlloc"),
      dtoh = calls_since(f, c0, "cuMemcpyDtoHAsync"), htod = calls_since(f, c0, "cuMemcpyHtoDAsync");
  check(syncs == 0 && allocs == 0 && dtoh == 0 && htod == 0 && f.num_allocs() == a0,
        "step 1: no cuStreamSynchronize, cuMemAlloc or copy (syncs=" + std::to_string(syncs) +
            " allocs=" + std::to_string(allocs) + " dtoh=" + std::to_string(dtoh) + " htod=" + std::to_string(htod) +
            ")");
  check(calls_since(f, c0, "cuEventRecord") == 1, "step 1: one event recorded after the launches (reads wait for it)");
  auto ls = launches_since(f, l0);
  bool on_stream = true, in_ctx = true, blocks = true, nargs = true;
  unsigned long long d_hypers = 0, d_globals = 0, d_states = 0, d_segs = 0, d_chunks = 0, d_sg = 0, d_scaler = 0,
                     nchunks = 0, ngroups = 0, d_tensor_t = 0, nrows = 0, d_active = 0;
  unsigned update_grid = 0, sumsq_grid = 0;
  for (const Rec &l : ls) {
    on_stream &= l.stream == stream;
    in_ctx &= l.ctx == (void *)0x1000;
    const unsigned want_block = l.role == "PREPARE" ? ZOPT_GPU_PREPARE_BLOCK
                                : l.role == "FINISH" ? ZOPT_GPU_FINISH_BLOCK
                                                     : ZOPT_GPU_BLOCK;
    blocks &= l.block[0] == want_block && l.block[1] == 1 && l.block[2] == 1;
    if (l.role == "PREPARE") {
      d_hypers = l.args[0], d_globals = l.args[1], d_tensor_t = l.args[3], nrows = l.args[4];
      nargs &= l.nargs == 6;
    } else if (l.role == "SUMSQ") {
      d_sg = l.args[6];
      sumsq_grid = l.grid[0];
      nargs &= l.nargs == 12;
      check(l.args[9] == nrows && l.args[10] == d_tensor_t,
            "SUMSQ: the rows of the coefficient table (one per tensor) and the tensors' steps");
    } else if (l.role == "UPDATE") {
      d_states = l.args[0], d_segs = l.args[1], d_chunks = l.args[2], nchunks = l.args[3];
      update_grid = l.grid[0];
      d_active = l.args[6];
      nargs &= l.nargs == (si.sr ? 9 : 7);
      check(l.args[5] == d_sg, "UPDATE reads the SUMSQ step globals (or NULL without SUMSQ)");
      if (si.sr)
        check(l.args[7] == d_tensor_t && l.args[8] == seed,
              "stochastic rounding: UPDATE gets the tensors' steps t and the seed");
    } else if (l.role == "FINISH") {
      nargs &= l.nargs == 7;
      ngroups = l.args[1];
      // One block per ZOPT_GPU_FINISH_BLOCK rows (at most 1024) where the
      // kernel strides over any grid (ZOPT_FLAG_FINISH_GRID), else one.
      const unsigned long long want_grid =
          (si.d->flags & ZOPT_FLAG_FINISH_GRID)
              ? std::min<unsigned long long>(std::max<unsigned long long>((nrows + ZOPT_GPU_FINISH_BLOCK - 1) / ZOPT_GPU_FINISH_BLOCK, 1), 1024)
              : 1;
      check(l.grid[0] == want_grid && l.args[0] == d_globals && l.args[2] == d_sg && l.args[4] == d_tensor_t &&
                l.args[5] == d_active && l.args[6] == nrows,
            "FINISH: " + std::to_string(l.grid[0]) + " block(s) for " + std::to_string(nrows) +
                " rows, the globals table, the step globals, the tensors' steps, the active mask, the rows");
      d_scaler = l.args[3];
      check((d_scaler != 0) == si.ls, "FINISH gets the loss scaler exactly when the step scales the loss");
    }
  }
  std::string seq = seq_of(ls);
  check(seq == (si.has_sumsq ? "PREPARE SUMSQ UPDATE FINISH " : "PREPARE UPDATE FINISH "), "launch order: " + seq);
  check(on_stream, "every launch on the stream given to zopt_optimizer_set_stream");
  check(in_ctx, "every launch with the optimizer's context current");
  void *cur = nullptr;
  f.ctx_current(&cur);
  check(cur == ctx0, "step restores the caller's context (none)");
  check(blocks, "every launch with the block size its kernel declares (.reqntid: 64, 256, 256, 32)");
  check(nargs, "every launch passes the parameters of the kernel's PTX .param list");
  check(std::isnan(r.grad_norm) && r.skipped == 0, "step()'s result is left to zopt_optimizer_gpu_result");

  // ---- the tables the kernels read ------------------------------------------
  check(ngroups == 2 && nrows == sizes.size(), "2 groups, a coefficient row per tensor");
  {
    const double *tt = (const double *)(uintptr_t)d_tensor_t;
    const uint8_t *act = (const uint8_t *)(uintptr_t)d_active;
    bool ok = d_active != 0;
    for (size_t t = 0; t < sizes.size() && ok; ++t) ok = tt[t] == 1 && act[t] == 1;
    check(ok && act[sizes.size()] == 1 && act[sizes.size() + 1] == 1,
          "tensors' steps t = 1 and the active mask (every tensor, both groups) on the device");
  }
  const zopt_gpu_segment *segs = (const zopt_gpu_segment *)(uintptr_t)d_segs;
  const unsigned long long *ptrs = (const unsigned long long *)(uintptr_t)d_states;
  bool segs_ok = true, ptrs_ok = true;
  for (size_t t = 0; t < sizes.size(); ++t) {
    segs_ok &= segs[t].n == sizes[t] && segs[t].group == t % 2 && segs[t].tensor == t;
    for (uint32_t k = 0; k < d->num_states; ++k) {
      unsigned long long p = ptrs[t * d->num_states + k];
      uint32_t kind = d->states[k].kind;
      if (kind == ZOPT_STATE_PARAM) ptrs_ok &= p == su.dp[t];
      else if (kind == ZOPT_STATE_GRAD) ptrs_ok &= p == su.dg[t];
      // A q8 absmax (PER_BLOCK): the f32 of the tensor's block 0.
      else if (d->states[k].flags & ZOPT_STATE_PER_BLOCK) ptrs_ok &= p != 0 && p % 4 == 0;
      else ptrs_ok &= p != 0 && p % 16 == 0;  // owned, for 16-byte aligned params: 16-byte aligned
    }
  }
  // q8 moments (abi.h "q8 moments"): each tensor's codes start at a q8
  // block of its group's buffer (the group's first tensor at block 0) and
  // its absmax entry is that block's f32; every chunk is whole blocks.
  {
    bool q8 = false, ok = true;
    for (uint32_t k = 0; k < d->num_states; ++k) {
      if (!(d->states[k].flags & ZOPT_STATE_PER_BLOCK)) continue;
      q8 = true;
      uint32_t code = 0;
      for (uint32_t j = 0; j < d->num_states; ++j)
        if (d->states[j].dtype == ZOPT_DTYPE_Q8 &&
            d->states[j].kind == (d->states[k].kind == ZOPT_STATE_EXP_AVG_ABSMAX ? ZOPT_STATE_EXP_AVG : ZOPT_STATE_EXP_AVG_SQ))
          code = j;
      for (size_t t = 2; t < sizes.size(); ++t) {  // against the group's first tensor (t % 2)
        const unsigned long long c0 = ptrs[(t % 2) * d->num_states + code], c = ptrs[t * d->num_states + code];
        const unsigned long long a0 = ptrs[(t % 2) * d->num_states + k], a = ptrs[t * d->num_states + k];
        ok &= c > c0 && (c - c0) % ZOPT_Q8_BLOCK == 0 && a - a0 == (c - c0) / ZOPT_Q8_BLOCK * 4;
      }
    }
    const zopt_gpu_chunk *ch = (const zopt_gpu_chunk *)(uintptr_t)d_chunks;
    for (unsigned long long c = 0; q8 && c < nchunks; ++c) ok &= ch[c].begin % ZOPT_Q8_BLOCK == 0;
    if (q8) {
      check(ok, "q8 moments: each tensor's codes at a q8 block boundary of its group's buffer, its absmax entry that "
                "block's, every chunk whole blocks of its tensor");
      // memory_info: per group and owned state its buffer (each tensor at a
      // whole number of q8 blocks; an absmax one f32 per block), to 64 bytes.
      uint64_t want = 0;
      for (int g = 0; g < 2; ++g) {
        int64_t padded = 0;
        for (size_t t = g; t < sizes.size(); t += 2) padded += (sizes[t] + ZOPT_Q8_BLOCK - 1) / ZOPT_Q8_BLOCK * ZOPT_Q8_BLOCK;
        for (uint32_t k = 0; k < d->num_states; ++k)
          if (d->states[k].kind != ZOPT_STATE_PARAM && d->states[k].kind != ZOPT_STATE_GRAD)
            want += (state_bytes(d, k, padded) + 63) & ~(uint64_t)63;
      }
      zopt_memory_info mi{};
      Z(zopt_optimizer_memory_info(o, &mi));
      check(mi.state_bytes == want, "q8 moments: memory_info counts " + std::to_string(mi.state_bytes) +
                                        " state bytes on the GPU (an absmax 4 bytes per block of 256)");
    }
  }
  check(segs_ok, "segment table: n, group and tensor index of every tensor");
  check(ptrs_ok, "state table: the user's param/grad pointers, 16-byte aligned owned states");
  // Every pointer of the table spans n elements of its state's dtype inside
  // one device allocation (the user's param and grad buffers, the owned
  // states' flat buffers): the kernels stay in bounds.
  {
    bool in = true;
    std::string dts;
    for (uint32_t k = 0; k < d->num_states; ++k)
      dts += std::string(k ? ", " : "") + state_kind_name_of(d->states[k].kind) + " " + dtype_name(d->states[k].dtype);
    for (size_t t = 0; t < sizes.size(); ++t)
      for (uint32_t k = 0; k < d->num_states; ++k)
        in &= f.in_alloc(ptrs[t * d->num_states + k], state_bytes(d, k, sizes[t])) != 0;
    check(in, "state table: every pointer spans its tensor's elements of its state's dtype inside one device "
              "allocation (" + dts + ")");
  }
  int64_t chunk = 0;
  check(chunks_cover((const zopt_gpu_chunk *)(uintptr_t)d_chunks, (int64_t)nchunks, sizes, &chunk),
        "work list: " + std::to_string(nchunks) + " chunks of at most " + std::to_string(chunk) +
            " elements cover every element once, in order");
  const unsigned resident = 2 * 132;  // the stand-in: 2 blocks of 256 threads per SM, 132 SMs
  check(update_grid == std::min<unsigned long long>(nchunks, resident) &&
            (!si.has_sumsq || sumsq_grid == std::min<unsigned long long>(nchunks, resident)),
        "grids sized by occupancy and the work list, not by the largest tensor: UPDATE " +
            std::to_string(update_grid) + (si.has_sumsq ? ", SUMSQ " + std::to_string(sumsq_grid) : std::string()) +
            " blocks");
  double *hy = (double *)(uintptr_t)d_hypers;
  const int lr_i = si.lr_i;
  check(lr_i >= 0 && hy[lr_i] == 1e-3 && hy[d->num_hypers + lr_i] == 3e-3, "hyperparameter table: lr per group");
  double *gl = (double *)(uintptr_t)d_globals;
  check(gl[ZOPT_GLOBAL_STEP] == 1 && gl[ZOPT_GLOBAL_CLIP_COEF] == 1 &&
            gl[ZOPT_GLOBAL_GRAD_SCALE] == (si.ls ? 1.0 / 1024 : 1.0) && gl[ZOPT_NUM_GLOBALS + ZOPT_GLOBAL_STEP] == 1,
        "globals table on the device: t = 1, clip 1, 1/S for each group");
  if (si.ls) {
    const zopt_gpu_scaler *sc = (const zopt_gpu_scaler *)(uintptr_t)d_scaler;
    check(sc->scale == 1024 && sc->growth_factor == 2 && sc->backoff_factor == 0.5 && sc->growth_interval == 3 &&
              sc->min_scale == 1 && sc->dynamic == 1 && sc->good_steps == 0,
          "loss scaler on the device: the configured scaler");
  }
  // maximize (ZOPT_GROUP_MAXIMIZE) on group 1: its gradient scale in the
  // device's globals table is negative, group 0's and the step counts stay
  // (FINISH keeps each group's sign when it rewrites the scale, checked on
  // its IR in test/Conversion/ZKToGPU); cleared, positive again.
  {
    const double inv = si.ls ? 1.0 / 1024 : 1.0;
    const double t0 = gl[ZOPT_GLOBAL_STEP], t1 = gl[ZOPT_NUM_GLOBALS + ZOPT_GLOBAL_STEP];
    uint32_t fl = 0;
    Z(zopt_optimizer_set_group_flags(o, 1, ZOPT_GROUP_MAXIMIZE));
    Z(zopt_optimizer_get_group_flags(o, 1, &fl));
    bool on = fl == ZOPT_GROUP_MAXIMIZE && gl[ZOPT_GLOBAL_GRAD_SCALE] == inv &&
              gl[ZOPT_NUM_GLOBALS + ZOPT_GLOBAL_GRAD_SCALE] == -inv && gl[ZOPT_GLOBAL_STEP] == t0 &&
              gl[ZOPT_NUM_GLOBALS + ZOPT_GLOBAL_STEP] == t1;
    Z(zopt_optimizer_set_group_flags(o, 1, 0));
    bool off = gl[ZOPT_GLOBAL_GRAD_SCALE] == inv && gl[ZOPT_NUM_GLOBALS + ZOPT_GLOBAL_GRAD_SCALE] == inv;
    check(on && off, "set_group_flags(MAXIMIZE): that group's gradient scale on the device is -1/S, the other "
                     "group's and the step counts unchanged; cleared: 1/S again");
  }

  // ---- the grad through the API, in its own dtype ------------------------------
  {
    bool ok = true;
    for (size_t t = 0; t < sizes.size(); ++t) {
      std::vector<float> w = exact_values(sizes[t], (int)t), r(sizes[t]);
      Z(zopt_optimizer_write_state_f32(o, (int)t, ZOPT_STATE_GRAD, w.data(), sizes[t]));
      Z(zopt_optimizer_read_state_f32(o, (int)t, ZOPT_STATE_GRAD, r.data(), sizes[t]));
      std::vector<unsigned char> want = storage_of(w, si.gdt);
      ok &= r == w && memcmp((void *)(uintptr_t)su.dg[t], want.data(), want.size()) == 0;
    }
    check(ok, std::string("write/read_state_f32(GRAD) address the device grad in its dtype (") + dtype_name(si.gdt) +
                  ", param " + dtype_name(si.pdt) + ")");
  }

  // ---- a second step: only the launches; a changed lr is written at once ------
  c0 = f.num_calls();
  Z(zopt_optimizer_step(o, nullptr));
  int copies = 0, launches = 0;
  for (int i = c0; i < f.num_calls(); ++i) {
    copies += !strncmp(f.call(i), "cuMemcpy", 8) || !strncmp(f.call(i), "cuMemset", 8) ||
              !strcmp(f.call(i), "cuStreamSynchronize");
    launches += !strcmp(f.call(i), "cuLaunchKernel");
  }
  check(copies == 0 && launches == (si.has_sumsq ? 4 : 3),
        "step 2: only the launches (no copy, no sync) when no hyperparameter changed");
  c0 = f.num_calls();
  Z(zopt_optimizer_set_hyper(o, su.gid[0], "lr", 1e-3));  // same value
  check(f.num_calls() == c0, "setting lr to its current value writes nothing");
  Z(zopt_optimizer_set_hyper(o, su.gid[0], "lr", 5e-4));
  check(calls_since(f, c0, "cuMemsetD32Async") == 2 && calls_since(f, c0, "cuMemcpyHtoDAsync") == 0 &&
            calls_since(f, c0, "cuStreamSynchronize") == 0 && calls_since(f, c0, "cuEventRecord") == 1 &&
            hy[lr_i] == 5e-4 && hy[d->num_hypers + lr_i] == 3e-3,
        "a changed lr is written into the device's table at once, on the stream, by value (two 32-bit memsets, "
        "no host buffer, no sync), after the steps already enqueued");
  c0 = f.num_calls();
  Z(zopt_optimizer_step(o, nullptr));
  check(calls_since(f, c0, "cuStreamWaitEvent") == 1 && calls_since(f, c0, "cuMemcpyHtoDAsync") == 0,
        "the next step waits for the hyperparameter write (its event), uploads nothing");
  // max_norm: the SUMSQ/FINISH kernels read it from the step globals,
  // written as a hyperparameter is (by value, on the stream, no sync).
  if (si.d->flags & ZOPT_FLAG_CLIP) {
    const zopt_gpu_step_globals *sgm = (const zopt_gpu_step_globals *)(uintptr_t)d_sg;
    f.drain_all();
    check(sgm->max_norm == si.d->max_norm,
          "the step globals hold the compiled max_norm after finalize: " + std::to_string(sgm->max_norm));
    c0 = f.num_calls();
    Z(zopt_optimizer_set_max_norm(o, si.d->max_norm));  // same value
    check(f.num_calls() == c0, "setting max_norm to its current value writes nothing");
    const double mn = 0.3125 * si.d->max_norm;
    Z(zopt_optimizer_set_max_norm(o, mn));
    f.drain_all();
    double got = 0;
    Z(zopt_optimizer_get_max_norm(o, &got));
    check(calls_since(f, c0, "cuMemsetD32Async") == 2 && calls_since(f, c0, "cuMemcpyHtoDAsync") == 0 &&
              calls_since(f, c0, "cuStreamSynchronize") == 0 && calls_since(f, c0, "cuEventRecord") == 1 &&
              memcmp(&sgm->max_norm, &mn, 8) == 0 && got == mn,
          "set_max_norm on a GPU step is written into the device's step globals at once, by value (two 32-bit "
          "memsets, no sync): the bytes of " + std::to_string(mn));
    c0 = f.num_calls();
    Z(zopt_optimizer_step(o, nullptr));
    check(calls_since(f, c0, "cuStreamWaitEvent") == 1 && calls_since(f, c0, "cuMemcpyHtoDAsync") == 0,
          "the next step waits for the max_norm write (its event), uploads nothing");
    // A write that fails half way (the second memset): the call fails, the
    // optimizer keeps its max_norm, and the next step writes that value
    // again before its kernels (the device held half of the new double).
    f.fail_memset(2);
    const double half = 0.7071067811865476 * si.d->max_norm;  // both 32-bit words differ from mn's
    const zopt_status st_half = zopt_optimizer_set_max_norm(o, half);
    f.drain_all();
    double kept = 0;
    Z(zopt_optimizer_get_max_norm(o, &kept));
    const bool torn = memcmp(&sgm->max_norm, &mn, 8) != 0;
    c0 = f.num_calls();
    Z(zopt_optimizer_step(o, nullptr));
    f.drain_all();
    check(st_half == ZOPT_ERR_INTERNAL && kept == mn && torn && memcmp(&sgm->max_norm, &mn, 8) == 0 &&
              calls_since(f, c0, "cuMemcpyHtoDAsync") == 1,
          "a set_max_norm whose second write fails: INTERNAL, max_norm unchanged, and the next step writes it "
          "to the device again (the half-written value never reaches a kernel)");
    Z(zopt_optimizer_set_max_norm(o, si.d->max_norm));
  } else {
    check(zopt_optimizer_set_max_norm(o, 1.0) == ZOPT_ERR_UNSUPPORTED,
          "set_max_norm on a step compiled without clipping: UNSUPPORTED");
  }

  // ---- the step state is the device's: emulate FINISH, read it back ---------
  // 4 steps ran; the fake runs no kernel, so write what FINISH would have:
  // 3 applied, 1 skipped (t_next = 4) and, with loss scaling, a backoff.
  gl[ZOPT_GLOBAL_STEP] = 4;
  gl[ZOPT_NUM_GLOBALS + ZOPT_GLOBAL_STEP] = 4;
  zopt_gpu_step_globals *sgp = (zopt_gpu_step_globals *)(uintptr_t)d_sg;
  if (si.has_sumsq) {
    sgp->norm = 2.5;
    sgp->skip = 1;
  }
  if (si.ls) {
    zopt_gpu_scaler *sc = (zopt_gpu_scaler *)(uintptr_t)d_scaler;
    sc->last_scale = 1024;
    sc->scale = 512;
    sc->good_steps = 0;
  }
  int64_t cnt = -1;
  c0 = f.num_calls();
  Z(zopt_optimizer_get_step_count(o, 1, &cnt));
  syncs = calls_since(f, c0, "cuStreamSynchronize");
  check(cnt == 3 && syncs == 1 && calls_since(f, c0, "cuStreamWaitEvent") >= 1,
        "get_step_count reads the device's count after the last step's event (one stream sync): " +
            std::to_string(cnt));
  zopt_step_result gr{};
  Z(zopt_optimizer_gpu_result(o, &gr));
  if (si.has_sumsq)
    check(gr.grad_norm == 2.5 && gr.skipped == 1, "gpu_result: the device's norm and skip flag");
  else
    check(std::isnan(gr.grad_norm) && gr.skipped == 0, "gpu_result without a norm reduction: NaN, not skipped");
  double scale = 0;
  Z(zopt_optimizer_get_loss_scale(o, &scale));
  check(gr.loss_scale == (si.ls ? 1024 : 1) && scale == (si.ls ? 512 : 1),
        "loss scale: the step's (gpu_result) and the next step's (get_loss_scale) from the device");

  // ---- refresh_master: INIT on the tensor's chunks ---------------------------
  if (si.master) {
    l0 = f.num_launches();
    c0 = f.num_calls();
    Z(zopt_optimizer_refresh_master(o, 4, 1));
    auto rl = launches_since(f, l0);
    const zopt_gpu_chunk *ch = (const zopt_gpu_chunk *)(uintptr_t)rl[0].args[2];
    bool ok = rl.size() == 1 && rl[0].role == "INIT" && rl[0].args[3] >= 1 && ch[0].segment == 4 && ch[0].begin == 0 &&
              calls_since(f, c0, "cuMemcpyDtoHAsync") == 0;
    check(ok, "refresh_master: INIT over the tensor's chunks on the device, no copy through the host");
  }

  // ---- a failed launch is reported, not hidden --------------------------------
  f.fail_next_launch();
  zopt_status st = zopt_optimizer_step(o, nullptr);
  check(st == ZOPT_ERR_INTERNAL && strstr(zopt_last_error(), "launching PREPARE") &&
            strstr(zopt_last_error(), "LAUNCH_FAILED"),
        std::string("a failed launch returns ZOPT_ERR_INTERNAL: ") + zopt_last_error());

  // ---- checkpoints of GPU steps ---------------------------------------------
  // Fill every owned state with a pattern through the API, save, scribble,
  // load: the states, step counts and scaler come back. q8 codes and their
  // absmax (PER_BLOCK) are written and read raw.
  auto is_raw = [&](uint32_t k) {
    return d->states[k].dtype == ZOPT_DTYPE_Q8 || (d->states[k].flags & ZOPT_STATE_PER_BLOCK);
  };
  auto raw_pattern = [&](size_t t, uint32_t k, unsigned char add) {
    std::vector<unsigned char> b(state_bytes(d, k, sizes[t]));
    for (size_t i = 0; i < b.size(); ++i) b[i] = (unsigned char)(i * 7 + k * 13 + t * 29 + add);
    return b;
  };
  std::vector<std::vector<float>> want;
  for (size_t t = 0; t < sizes.size(); ++t)
    for (uint32_t k = 0; k < d->num_states; ++k) {
      uint32_t kind = d->states[k].kind;
      if (kind == ZOPT_STATE_PARAM || kind == ZOPT_STATE_GRAD) continue;
      if (is_raw(k)) {
        auto b = raw_pattern(t, k, 0);
        Z(zopt_optimizer_write_state_raw(o, (int)t, (zopt_state_kind)kind, b.data(), b.size()));
        continue;
      }
      std::vector<float> v(sizes[t]);
      for (int64_t i = 0; i < sizes[t]; ++i) v[i] = 0.25f * (float)(i % 13) + (float)k + 0.5f * (float)t;
      Z(zopt_optimizer_write_state_f32(o, (int)t, (zopt_state_kind)kind, v.data(), sizes[t]));
      want.push_back(v);
    }
  std::string ck = std::string(path) + ".host-check.ckpt";
  Z(zopt_optimizer_save(o, ck.c_str()));
  for (size_t t = 0; t < sizes.size(); ++t)
    for (uint32_t k = 0; k < d->num_states; ++k) {
      uint32_t kind = d->states[k].kind;
      if (kind == ZOPT_STATE_PARAM || kind == ZOPT_STATE_GRAD) continue;
      if (is_raw(k)) {
        auto b = raw_pattern(t, k, 1);
        Z(zopt_optimizer_write_state_raw(o, (int)t, (zopt_state_kind)kind, b.data(), b.size()));
        continue;
      }
      std::vector<float> z(sizes[t], -7.f);
      Z(zopt_optimizer_write_state_f32(o, (int)t, (zopt_state_kind)kind, z.data(), sizes[t]));
    }
  gl[ZOPT_GLOBAL_STEP] = 100;  // as if more steps ran
  hy[lr_i] = 9.0;              // and the table were scribbled on
  Z(zopt_optimizer_load(o, ck.c_str()));
  bool same = true;
  size_t w = 0;
  for (size_t t = 0; t < sizes.size(); ++t)
    for (uint32_t k = 0; k < d->num_states; ++k) {
      uint32_t kind = d->states[k].kind;
      if (kind == ZOPT_STATE_PARAM || kind == ZOPT_STATE_GRAD) continue;
      if (is_raw(k)) {
        std::vector<unsigned char> b(state_bytes(d, k, sizes[t]));
        Z(zopt_optimizer_read_state_raw(o, (int)t, (zopt_state_kind)kind, b.data(), b.size()));
        same &= b == raw_pattern(t, k, 0);
        continue;
      }
      std::vector<float> v(sizes[t]);
      Z(zopt_optimizer_read_state_f32(o, (int)t, (zopt_state_kind)kind, v.data(), sizes[t]));
      same &= v == want[w++];
    }
  check(same, "checkpoint round trip: every owned state back on the device");
  Z(zopt_optimizer_get_step_count(o, 0, &cnt));
  check(cnt == 3 && gl[ZOPT_GLOBAL_STEP] == 4 && hy[lr_i] == 5e-4,
        "checkpoint round trip: step count 3, device t_next = 4, the hyperparameter table");
  Z(zopt_optimizer_get_loss_scale(o, &scale));
  check(scale == (si.ls ? 512 : 1), "checkpoint round trip: loss scale");
  remove(ck.c_str());

  c0 = f.num_calls();
  zopt_optimizer_free(o);
  check(calls_since(f, c0, "cuStreamSynchronize") == 0 && calls_since(f, c0, "cuEventSynchronize") >= 1,
        "zopt_optimizer_free waits for its own events, not for the caller's stream (it may be destroyed)");
  for (size_t i = 0; i < sizes.size(); ++i) {
    f.mem_free(su.dp[i]);
    f.mem_free(su.dg[i]);
  }
  check(f.num_allocs() == 0, "zopt_optimizer_free releases every device buffer it allocated");
  return 0;
}

}  // namespace ghc
