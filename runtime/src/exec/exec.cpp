// exec/exec.cpp - the step driver every backend runs (run_begin / run_end:
// the program op by op, split at the NORM, the decision by the step's
// CONTROL) and the host executor's step (backend/cpu, backend/offload):
// the ranks' agreement, each op on the pool and the communicator, FINISH.
// docs/DISTRIBUTED.md describes the layout and the collectives.
#include "exec/exec_internal.h"

#include "agree.h"
#include "backend/backend.h"
#include "comm/comm_internal.h"

#include <chrono>
#include <cmath>
#include <cstring>

namespace zopt {
namespace exec {

namespace {

// ---- kernels on the pool --------------------------------------------------

void run_sumsq(zopt_optimizer *o, Blocks &B) {
  Program &P = *o->prog;
  zopt_sumsq_fn f = o->step->sumsq;
  zopt_sumsq2_fn f2 = o->step->sumsq2;
  parallel(o->pool, [&](int tid) {
    const size_t end = B.sumsq.thread_begin[tid + 1];
    for (size_t i = B.sumsq.thread_begin[tid]; i < end; ++i) {
      const Chunk &c = B.sumsq.chunks[i];
      // A tensor without a gradient contributes +0.0: no sum changes.
      if (!active(P, c.tensor)) {
        B.chunk_partials[i] = 0.0;
        continue;
      }
      // Two chunks in one loop where the step has the pair entry (abi.h
      // "SUMSQ pairs"): each chunk's partial is the same bits, with two
      // read streams in flight (docs/benchmarks/cpu.md).
      if (f2 && i + 1 < end && active(P, B.sumsq.chunks[i + 1].tensor)) {
        const Chunk &d = B.sumsq.chunks[i + 1];
        f2(c.ptrs, c.len, coeffs_of(P, c.tensor), d.ptrs, d.len, coeffs_of(P, d.tensor), &B.chunk_partials[i]);
        ++i;
        continue;
      }
      B.chunk_partials[i] = f(c.ptrs, c.len, coeffs_of(P, c.tensor));
    }
  });
  for (size_t k = 0; k + 1 < B.first.size(); ++k) {
    double s = 0;
    for (size_t i = B.first[k]; i < B.first[k + 1]; ++i) s += B.chunk_partials[i];
    B.partials[k] = s;
  }
}

void run_update(zopt_optimizer *o, Work &w) {
  Program &P = *o->prog;
  const bool sr = o->d->flags & ZOPT_FLAG_STOCHASTIC;
  // Each thread's chunks, or the same elements in fewer calls (coalesce.cpp).
  const bool j = use_joined(o, w);
  const std::vector<Chunk> &calls = j ? w.joined : w.chunks;
  const std::vector<size_t> &begin = j ? w.joined_begin : w.thread_begin;
  parallel(o->pool, [&](int tid) {
    for (size_t i = begin[tid]; i < begin[tid + 1]; ++i) {
      const Chunk &c = calls[i];
      if (!active(P, c.tensor)) continue;
      const float *co = coeffs_of(P, c.tensor);
      if (sr) {
        // abi.h "Stochastic rounding": the key of (seed, the tensor's step
        // being taken, tensor, high half of the chunk's first index).
        uint64_t t = (uint64_t)o->tensors[c.tensor].steps + 1;
        uint32_t key = zopt_sr_key(o->seed, t, (uint32_t)c.tensor, (uint32_t)((uint64_t)c.start >> 32));
        ((zopt_update_sr_fn)(void *)o->step->update)(c.ptrs, c.ptrs, c.len, co, key, (uint32_t)c.start);
      } else {
        o->step->update(c.ptrs, c.ptrs, c.len, co);
      }
    }
  });
}

}  // namespace

zopt_control decide(const zopt_optimizer *o, double sumsq) {
  zopt_control c;
  memset(&c, 0, sizeof c);
  c.sumsq = sumsq;
  c.max_norm = o->max_norm;
  c.scale = o->scaler.scale;
  c.growth_factor = o->scaler.cfg.growth_factor;
  c.backoff_factor = o->scaler.cfg.backoff_factor;
  c.min_scale = o->scaler.cfg.min_scale;
  c.growth_interval = o->scaler.cfg.growth_interval;
  c.good_steps = o->scaler.good_steps;
  c.dynamic = o->scaler.cfg.dynamic ? 1u : 0u;
  o->step->control(&c);
  return c;
}

namespace {

// ---- agreement between ranks -----------------------------------------------

// The hash of step_settings() (agree.h): the same fields, without building
// their names every step.
uint64_t hash_step_settings(const zopt_optimizer *o) {
  uint64_t h = fnv1a64(&o->seed, sizeof o->seed);
  for (const Group &g : o->groups) {
    h = fnv1a64(&g.step_count, sizeof g.step_count, h);
    h = fnv1a64(g.hypers.data(), g.hypers.size() * sizeof(double), h);
    h = fnv1a64(&g.flags, sizeof g.flags, h);
  }
  double D = grad_divisor(o);
  h = fnv1a64(&D, sizeof D, h);
  double S = loss_scale(o);
  h = fnv1a64(&S, sizeof S, h);
  double m = (o->d->flags & ZOPT_FLAG_CLIP) ? o->max_norm : 0;
  h = fnv1a64(&m, sizeof m, h);
  return h;
}

}  // namespace

// Every rank's gradient mask (OR) and a check that every rank steps with the
// same hyperparameters, group flags, step counts, seed, divisor, loss scale
// and max_norm.
zopt_status agree_step(zopt_optimizer *o, bool first) {
  Program &P = *o->prog;
  const size_t T = o->tensors.size();
  if (o->stream_grads) {
    // The local mask is what the caller handed to reduce_bucket (empty
    // tensors, in no bucket: what zopt_optimizer_set_active said, all by
    // default); there is no grad memory.
    std::vector<uint8_t> local(T);
    bool all = true;
    for (size_t t = 0; t < T; ++t) {
      local[t] = o->tensors[t].numel == 0 ? (o->active.empty() || o->active[t]) : P.stream_given[t] == 1;
      all = all && local[t];
    }
    if (all) local.clear();
    o->active.swap(local);
  } else if (o->world == 1) {
    for (size_t t = 0; t < T; ++t)
      if (!o->tensors[t].grad && o->tensors[t].numel && (o->active.empty() || o->active[t]))
        return fail(ZOPT_ERR_INVALID_ARGUMENT,
                    "zopt_optimizer_step: tensor %zu has no gradient memory (zopt_optimizer_set_tensor_memory with "
                    "grad NULL) but is active: mark it inactive with zopt_optimizer_set_active",
                    t);
    P.global_active = o->active;
    return ZOPT_OK;
  }
  if (o->world == 1) {
    P.global_active = o->active;
    return ZOPT_OK;
  }
  const size_t msg = 8 + T;
  std::vector<unsigned char> mine(msg), all(msg * o->world);
  uint64_t h = hash_step_settings(o);
  memcpy(mine.data(), &h, 8);
  // Per tensor: 1 a gradient, 0 none, 2 none and no gradient memory (the
  // reduced gradient of a tensor another rank updates lands in it).
  for (size_t t = 0; t < T; ++t) {
    uint8_t a = o->active.empty() ? 1 : o->active[t];
    mine[8 + t] = a ? 1 : (o->tensors[t].grad || !o->tensors[t].numel || o->stream_grads) ? 0 : 2;
  }
  // The step's first collective: nothing changed yet (kSigUnchanged).
  if (zopt_status st = comm_all_gather(o->comm, mine.data(), all.data(), msg, "STEP settings and gradient mask",
                                       first ? kSigUnchanged : 0))
    return st;
  // Rank 0's values are the reference: name every rank that differs.
  uint64_t h0;
  memcpy(&h0, all.data(), 8);
  std::string bad;
  for (int q = 1; q < o->world; ++q) {
    uint64_t hq;
    memcpy(&hq, all.data() + q * msg, 8);
    if (hq != h0) bad += (bad.empty() ? "" : ", ") + std::to_string(q);
  }
  if (!bad.empty()) return explain_step_disagreement(o);  // every rank saw it: names the settings
  P.global_active.assign(T, 0);
  bool all_on = true;
  for (size_t t = 0; t < T; ++t) {
    for (int q = 0; q < o->world; ++q) P.global_active[t] |= all[q * msg + 8 + t] & 1;
    all_on = all_on && P.global_active[t];
  }
  for (size_t t = 0; t < T; ++t)
    for (int q = 0; q < o->world && P.global_active[t]; ++q)
      if (all[q * msg + 8 + t] == 2)
        return fail(ZOPT_ERR_INVALID_ARGUMENT,
                    "zopt_optimizer_step: tensor %zu has a gradient on some rank but rank %d registered no gradient "
                    "memory for it (zopt_optimizer_set_tensor_memory with grad NULL): the reduced gradient needs it",
                    t, q);
  if (all_on) P.global_active.clear();
  return ZOPT_OK;
}

// One op of the program on the host (NORM only sums: run_end decides).
zopt_status run_host_op(zopt_optimizer *o, StepState *st, size_t i) {
  Program &P = *o->prog;
  const zopt_step_descriptor *d = o->d;
  const zopt_program_op &op = P.ops[i];
  using clock = std::chrono::steady_clock;
  struct Timer {
    double *out;
    clock::time_point t = clock::now();
    ~Timer() { *out = std::chrono::duration<double>(clock::now() - t).count(); }
  } timer{&P.op_seconds[i]};
  switch (op.code) {
    case ZOPT_OP_COPY: {
      // Staged user tensors (validate allows COPY only then): to the host,
      // wait after the last of a run of such copies (the CPU reads them
      // next); to the device, asynchronous, ordered before the caller's
      // next work on the stream.
      const bool to_host = op.dst == ZOPT_PLACE_CPU;
      const bool more = i + 1 < P.ops.size() && P.ops[i + 1].code == ZOPT_OP_COPY && P.ops[i + 1].dst == op.dst;
      P.copy_bytes[to_host ? 0 : 1] += copy_size(o, (int)op.state);
      return o->backend->copy_staged(o, (int)op.state, !to_host, to_host && !more);
    }
    case ZOPT_OP_REDUCE_SCATTER:
      // Streaming: the caller reduced the buckets (run_begin checked).
      if (o->stream_grads) return ZOPT_OK;
      return o->world > 1 ? reduce_scatter(o, op) : ZOPT_OK;
    case ZOPT_OP_ALL_GATHER:
      return o->world > 1 ? all_gather(o, op) : ZOPT_OK;
    case ZOPT_OP_PREPARE:
      prepare_rows(o, true, 1.0, st->S);
      return ZOPT_OK;
    case ZOPT_OP_NORM_PARTIALS:
      run_sumsq(o, op.range == ZOPT_RANGE_OWNED ? P.norm_owned : P.norm_all);
      return ZOPT_OK;
    case ZOPT_OP_NORM: {
      // Every rank's partials, added in (bucket, block) order: the same
      // bits on every rank, at any world size, thread count and ISA.
      double sum = 0;
      if (P.norm_range == ZOPT_RANGE_OWNED) {
        const std::vector<double> *all = &P.norm_owned.partials;
        if (o->world > 1) {
          if (zopt_status s = comm_all_gather(o->comm, P.norm_owned.partials.data(), P.gathered.data(),
                                              P.norm_owned.partials.size() * sizeof(double), "NORM partials"))
            return s;
          all = &P.gathered;
        }
        const int64_t bpr = P.L.blocks_per_rank, NB = P.L.block;
        for (const layout::Bucket &k : P.L.buckets) {
          const int64_t nb = k.shard / NB;
          for (int q = 0; q < o->world; ++q)
            for (int64_t j = 0; j < nb; ++j) {
              if ((q * nb + j) * NB >= k.len) break;
              sum += (*all)[(size_t)(q * bpr + k.block_offset + j)];
            }
        }
      } else {
        const int64_t NB = P.L1.block;
        for (const layout::Bucket &k : P.L1.buckets)
          for (int64_t j = 0; j < k.shard / NB && j * NB < k.len; ++j)
            sum += P.norm_all.partials[(size_t)(k.block_offset + j)];
      }
      st->sumsq = sum;
      st->has_norm = true;
      return ZOPT_OK;
    }
    case ZOPT_OP_UPDATE:
      run_update(o, op.range == ZOPT_RANGE_OWNED ? P.update_owned : P.update_all);
      return ZOPT_OK;
    case ZOPT_OP_FINISH:
      // What CONTROL decided at run_end: the counts of the updated
      // tensors and their groups, the loss scaler's next state.
      if (st->ctl.advance) {
        std::vector<uint8_t> touched(o->groups.size(), 0);
        for (size_t t = 0; t < o->tensors.size(); ++t)
          if (active(P, (int)t)) {
            o->tensors[t].steps++;
            touched[o->tensors[t].group] = 1;
          }
        for (size_t g = 0; g < o->groups.size(); ++g) o->groups[g].step_count += touched[g];
      }
      if ((d->flags & ZOPT_FLAG_LOSS_SCALE) && st->any_active) {
        o->scaler.scale = st->ctl.new_scale;
        o->scaler.good_steps = st->ctl.new_good_steps;
      }
      return ZOPT_OK;
  }
  return ZOPT_OK;
}

// ---- run --------------------------------------------------------------------

// The step driver, the same for every backend (backend/backend.h): the
// ops before the update, from the backend's begin_step through the NORM
// op's sum of every rank's partials (or, without a norm, up to the
// UPDATE), leaving S and the sum of squares in `st` (validate puts NORM
// before any UPDATE; the zprog verifier FINISH last).
zopt_status run_begin(zopt_optimizer *o, StepState *st, bool first) {
  const zopt_step_descriptor *d = o->d;
  const bool linked = st->linked;
  *st = StepState();
  st->linked = linked;
  st->S = loss_scale(o);
  Backend *B = o->backend;
  if (zopt_status s = B->begin_step(o, st, first)) return s;
  for (size_t i = 0; i < d->num_program; ++i) {
    const uint32_t code = d->program[i].code;
    if (code == ZOPT_OP_UPDATE || code == ZOPT_OP_FINISH) break;  // no norm: up to the update
    st->pc = i + 1;
    if (zopt_status s = B->run_op(o, st, i)) return s;
    if (code == ZOPT_OP_NORM) break;
  }
  return ZOPT_OK;
}

// The rest of the program, deciding with the sum of squares `sumsq` (the
// step's own, or several optimizers' in zopt_optimizer_step_linked). The
// UPDATE and the ops flagged UNLESS_SKIPPED do not run on a skipped step.
zopt_status run_end(zopt_optimizer *o, StepState *st, double sumsq, zopt_step_result *result) {
  const zopt_step_descriptor *d = o->d;
  Backend *B = o->backend;
  B->decide(o, st, sumsq);
  for (size_t i = st->pc; i < d->num_program; ++i) {
    const zopt_program_op &op = d->program[i];
    if (st->skipped && (op.code == ZOPT_OP_UPDATE || (op.flags & ZOPT_OPF_UNLESS_SKIPPED))) continue;
    if (zopt_status s = B->run_op(o, st, i)) return s;
  }
  B->end_step(o, st, result);
  return ZOPT_OK;
}

zopt_status run(zopt_optimizer *o, zopt_step_result *result) {
  StepState st;
  if (zopt_status s = run_begin(o, &st)) return s;
  return run_end(o, &st, st.sumsq, result);
}

// ---- the host executor's step (backend/cpu) ------------------------------

zopt_status host_begin(zopt_optimizer *o, StepState *st, bool first) {
  Program &P = *o->prog;
  if (P.rebind_pending) {
    try {
      rebind(o);
    } catch (...) {
      return fail(ZOPT_ERR_OUT_OF_MEMORY, "zopt_optimizer_step: out of memory rebuilding the work lists");
    }
    P.rebind_pending = false;
  }
  if (o->stream_grads) {
    // Every bucket reduced since the last step (zopt_optimizer_reduce_bucket),
    // checked before any collective of the step.
    for (size_t b = 0; b < P.bucket_reduced.size(); ++b)
      if (!P.bucket_reduced[b]) {
        std::vector<int> ts;
        bucket_tensors(o, (int)b, &ts);
        return fail(ZOPT_ERR_BAD_STATE,
                    "zopt_optimizer_step: gradient bucket %zu of %zu (tensors %s) was not reduced "
                    "(zopt_optimizer_reduce_bucket) since the last step",
                    b, P.bucket_reduced.size(), tensor_list(ts).c_str());
      }
  }
  P.step_start = now_seconds();
  P.copy_bytes[0] = P.copy_bytes[1] = 0;
  using clock = std::chrono::steady_clock;
  auto t0 = clock::now();
  if (zopt_status s = agree_step(o, first)) return s;
  st->any_active = false;
  for (size_t t = 0; t < o->tensors.size() && !st->any_active; ++t) st->any_active = active(P, (int)t);
  P.agree_seconds = std::chrono::duration<double>(clock::now() - t0).count();
  P.op_seconds.assign(P.ops.size(), 0.0);
  return ZOPT_OK;
}

void host_decide(zopt_optimizer *o, StepState *st, double sumsq) {
  // The step's CONTROL decides (validate: a NORM op exactly when the step
  // has a SUMSQ kernel, so without one sumsq is not read).
  st->ctl = decide(o, st->has_norm ? sumsq : 0.0);
  st->norm = st->ctl.norm;
  st->skipped = st->ctl.skip != 0;
  st->clip = st->ctl.clip_coef;
  if (!st->skipped && (o->d->flags & ZOPT_FLAG_CLIP)) prepare_rows(o, false, st->clip, st->S);
}

void host_end(zopt_optimizer *o, StepState *st, zopt_step_result *result) {
  Program &P = *o->prog;
  if (o->stream_grads) {  // the next step needs every bucket again
    std::fill(P.bucket_reduced.begin(), P.bucket_reduced.end(), 0);
    std::fill(P.bucket_queued.begin(), P.bucket_queued.end(), 0);
    std::fill(P.stream_given.begin(), P.stream_given.end(), 0);
  }
  if (result) {
    result->grad_norm = st->norm;
    result->skipped = st->skipped ? 1 : 0;
    result->loss_scale = st->S;
  }
  record_stats(o);
}
}  // namespace exec
}  // namespace zopt
