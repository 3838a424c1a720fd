// state/tensors.cpp - tensors added to an optimizer, also after finalize
// (zopt_optimizer_add_tensors; zopt.h).
//
// This subsystem owns the rebuild of a finalized CPU-updated optimizer
// around more tensors: the step program is built again for every tensor
// (exec::build: the layout, new held buffers, the new tensors' states as at
// finalize), the ranks agree on what was added, and the old tensors'
// held states are carried over element by element into the new layout
// (at W > 1 each sharded state's old buckets are all-gathered and every
// rank keeps what its new shards hold). Until then the old program is
// untouched, so a failure at any point puts it back: the optimizer is as
// it was.
#include "internal.h"

#include "agree.h"
#include "backend/backend.h"
#include "checkpoint/set.h"
#include "comm/comm_internal.h"
#include "exec/exec.h"

#include <algorithm>
#include <string>
#include <unordered_set>
#include <vector>

using namespace zopt;

namespace {

const char *const kFn = "zopt_optimizer_add_tensors";

// Runs f with o->prog = P (the state_ptr / exec::runs of another program).
template <class F>
void with_prog(zopt_optimizer *o, exec::Program *P, F &&f) {
  exec::Program *cur = o->prog;
  o->prog = P;
  f();
  o->prog = cur;
}

// Frees program P's host buffers (not the backend's staging: rebuild frees
// that through Backend::free_staging).
void drop_program(zopt_optimizer *o, exec::Program *P) {
  with_prog(o, P, [&] { exec::destroy(o); });
}

// W > 1: every rank added the same groups and tensors with the same param
// values (as finalize checks; the old tensors were checked then).
zopt_status agree_added(zopt_optimizer *o, size_t T0) {
  Settings s;
  s.add_int("group count", (int64_t)o->groups.size());
  s.add_int("tensor count", (int64_t)o->tensors.size());
  uint64_t h = kFnvBasis, ph = kFnvBasis;
  const int pi = o->step->param_index;
  const size_t es = dtype_size(o->d->states[pi].dtype);
  for (size_t t = T0; t < o->tensors.size(); ++t) {
    const Tensor &x = o->tensors[t];
    int64_t v[2] = {x.group, x.numel};
    h = fnv1a64(v, sizeof v, h);
    // The params as this rank's host sees them (user memory, or the backend's staging).
    if (x.numel) ph = fnv1a64(o->backend->param_on_host(o, (int)t), (size_t)x.numel * es, ph);
  }
  s.add_hex("added tensors' sizes and groups", h);
  s.add_hex("added tensors' param values", ph);
  std::vector<uint64_t> all(s.size() * (size_t)o->world);
  if (zopt_status st = comm_all_gather(o->comm, s.words().data(), all.data(), s.size() * 8,
                                       "ADD_TENSORS layout and param check", kSigUnchanged))
    return st;
  std::string msg = s.diff(all.data(), o->world);
  if (!msg.empty())
    return fail(ZOPT_ERR_INVALID_ARGUMENT,
                "%s: the ranks added different tensors: %s: every rank adds the same groups and tensors (sizes, "
                "groups, order) with the same param values (nothing changed)",
                kFn, msg.c_str());
  return ZOPT_OK;
}

// The old tensors' held states from program `old` into the current one.
zopt_status carry_states(zopt_optimizer *o, exec::Program *old, size_t T0) {
  exec::Program *P = o->prog;
  const zopt_step_descriptor *d = o->d;
  const int W = o->world;
  std::vector<std::vector<exec::Run>> fresh(T0);
  for (uint32_t s = 0; s < d->num_states; ++s) {
    if (!P->buf[s] || P->pinned[s] || d->states[s].kind == ZOPT_STATE_GRAD) continue;  // streamed grads: per step
    const size_t es = dtype_size(d->states[s].dtype);
    if (!P->sharded[s] || W == 1) {  // whole on this rank in both layouts
      for (size_t t = 0; t < T0; ++t) {
        const size_t bytes = (size_t)state_numel(d, (int)s, o->tensors[t].numel) * es;
        if (!bytes) continue;
        const void *src = nullptr;
        with_prog(o, old, [&] { src = state_ptr(o, (int)t, (int)s); });
        memcpy(state_ptr(o, (int)t, (int)s), src, bytes);
      }
      continue;
    }
    // Sharded: each old bucket's shards from every rank (through the old
    // program's collective scratch, in pieces of `cap` elements per rank);
    // this rank keeps the elements of its new runs.
    for (size_t t = 0; t < T0; ++t) exec::runs(o, (int)t, (int)s, &fresh[t]);
    const layout::Layout &L = old->layout_of(d, (int)s, true);  // a q8 absmax: its blocks
    const size_t cap = old->recv.size() / (es * (size_t)W);
    if (cap == 0 && !L.buckets.empty()) return fail(ZOPT_ERR_INTERNAL, "%s: no collective scratch", kFn);
    for (int b = 0; b < (int)L.buckets.size(); ++b) {
      const layout::Bucket &k = L.buckets[b];
      for (int64_t off = 0; off < k.shard;) {
        const int64_t c = std::min<int64_t>((int64_t)cap, k.shard - off);
        const char *send = (const char *)old->buf[s] + (size_t)(k.local_offset + off) * es;
        char what[96];
        snprintf(what, sizeof what, "ADD_TENSORS %s bucket %d", state_kind_name(d->states[s].kind), b);
        if (zopt_status st = comm_all_gather(o->comm, send, old->recv.data(), (size_t)c * es, what)) return st;
        for (int q = 0; q < W; ++q) {
          const int64_t fa = k.begin + (int64_t)q * k.shard + off;  // rank q's piece: flat [fa, fa + c)
          const unsigned char *recv = old->recv.data() + (size_t)q * (size_t)c * es;
          for (const layout::Piece &p : L.pieces(k.group, fa, std::min(fa + c, k.begin + k.len)))
            for (const exec::Run &r : fresh[(size_t)p.tensor]) {
              const int64_t a = std::max(p.start, r.start), e = std::min(p.start + p.len, r.start + r.len);
              if (a < e)
                memcpy((char *)r.ptr + (size_t)(a - r.start) * es, recv + (size_t)(p.flat - fa + a - p.start) * es,
                       (size_t)(e - a) * es);
            }
        }
        off += c;
      }
    }
  }
  return ZOPT_OK;
}

// The rebuild after finalize (the groups and tensors are appended to o
// already; T0, G0 the counts before).
zopt_status rebuild(zopt_optimizer *o, size_t T0) {
  exec::Program *old = o->prog;
  Backend *be = o->backend;
  const size_t staging0 = be->staging_count(o);
  o->prog = nullptr;
  zopt_status st = exec::build(o);  // on failure it frees what it built (not the pinned staging)
  if (o->world > 1) {  // every rank built its program (nothing changed yet), then the same one
    st = ckpt::agree_status(o, st, "ADD_TENSORS status", kSigUnchanged);
    if (!st) st = agree_added(o, T0);
  }
  if (!st) st = carry_states(o, old, T0);
  if (st) {  // back to the old program
    if (o->prog) exec::destroy(o);
    be->free_staging(o, staging0, be->staging_count(o));
    o->prog = old;
    return st;
  }
  drop_program(o, old);
  be->free_staging(o, 0, staging0);
  return ZOPT_OK;
}

// Every entry checked as add_tensor checks it, before anything changes:
// the tensors to append into `add`, their params into `seen`.
zopt_status check_entries(const zopt_optimizer *o, int new_groups, int n, const int *groups, void *const *params,
                          void *const *grads, const int64_t *numels, uint32_t dt, std::vector<Tensor> *add,
                          std::unordered_set<const void *> *seen) {
  const char *fn = kFn;
  if (new_groups < 0 || n < 0 || (n > 0 && (!groups || !params || !numels)))
    return fail(ZOPT_ERR_INVALID_ARGUMENT, "%s: new_groups = %d, n = %d with %s", fn, new_groups, n,
                new_groups < 0 || n < 0 ? "a negative count" : "a NULL array (groups, params and numels are needed)");
  if (!grads && n > 0 && !o->stream_grads)
    return fail(ZOPT_ERR_INVALID_ARGUMENT,
                "%s: grads is NULL (only with streamed gradients, zopt_optimizer_set_grad_streaming)", fn);
  const size_t G0 = o->groups.size(), T0 = o->tensors.size();
  if (G0 + (size_t)new_groups > (1u << 20)) return fail(ZOPT_ERR_INVALID_ARGUMENT, "%s: too many groups", fn);
  if (T0 + (size_t)n >= (size_t)0x7fffffff) return fail(ZOPT_ERR_INVALID_ARGUMENT, "%s: too many tensors", fn);
  if (o->finalized && o->stream_grads && o->prog)
    for (size_t b = 0; b < o->prog->bucket_reduced.size(); ++b)
      if (o->prog->bucket_reduced[b] || o->prog->bucket_queued[b])
        return fail(ZOPT_ERR_BAD_STATE,
                    "%s: gradient bucket %zu was reduced for the next step: add tensors before reducing (or after "
                    "the step)",
                    fn, b);
  const uint32_t pdt = o->d->states[o->step->param_index].dtype;
  if (dt != pdt)
    return fail(ZOPT_ERR_INVALID_ARGUMENT, "%s: dtype %s (%u) does not match the step's param dtype %s", fn,
                dtype_name(dt), dt, dtype_name(pdt));
  const ChecksScope checks{o};
  try {
    for (int i = 0; i < n; ++i) {
      const int g = groups[i];
      const int64_t numel = numels[i];
      void *param = params[i], *grad = grads ? grads[i] : nullptr;
      if (g < 0 || (size_t)g >= G0 + (size_t)new_groups)
        return fail(ZOPT_ERR_INVALID_ARGUMENT, "%s: entry %d: group id %d out of range (have %zu groups)", fn, i, g,
                    G0 + (size_t)new_groups);
      if (numel < 0 || numel > ((int64_t)1 << 48))
        return fail(ZOPT_ERR_INVALID_ARGUMENT, "%s: entry %d: numel = %lld out of range [0, 2^48]", fn, i,
                    (long long)numel);
      if (numel > 0 && (!param || (!grad && !o->stream_grads)))
        return fail(ZOPT_ERR_INVALID_ARGUMENT, "%s: entry %d: %s pointer is NULL", fn, i, !param ? "param" : "grad");
      if (numel > 0 && param == grad)
        return fail(ZOPT_ERR_INVALID_ARGUMENT, "%s: entry %d: param and grad are the same memory", fn, i);
      if (numel > 0)
        if (zopt_status st = o->backend->check_tensor(o, (int)(T0 + (size_t)i), param, grad, fn)) return st;
      if (numel > 0 && (o->params.count(param) || !seen->insert(param).second))
        return fail(ZOPT_ERR_INVALID_ARGUMENT, "%s: entry %d: param pointer %p is already registered", fn, i, param);
      add->push_back(Tensor{g, param, grad, numel, 0, 0});
    }
  } catch (...) {
    return fail(ZOPT_ERR_OUT_OF_MEMORY, "%s: out of memory", fn);
  }
  return ZOPT_OK;
}

}  // namespace

extern "C" {

ZOPT_API zopt_status zopt_optimizer_add_tensors(zopt_optimizer *o, int new_groups, int n, const int *groups,
                                                void *const *params, void *const *grads, const int64_t *numels,
                                                zopt_dtype dtype, int *first_group, int *first_tensor) {
  const char *fn = kFn;
  ZOPT_ENTER_CALL(o, fn);
  if (zopt_status st = check_idle(o, fn)) return st;
  if (o->finalized)
    if (zopt_status st = o->backend->supports(o, Feature::AddTensors, fn)) return st;
  const size_t G0 = o->groups.size(), T0 = o->tensors.size();
  std::vector<Tensor> add;
  std::unordered_set<const void *> seen;
  zopt_status checked = check_entries(o, new_groups, n, groups, params, grads, numels, raw_enum(dtype), &add, &seen);
  // With several ranks (after finalize, a collective) a refusal on one rank
  // is every rank's (nothing changed yet).
  if (o->finalized && o->world > 1) checked = ckpt::agree_status(o, checked, "ADD_TENSORS request", kSigUnchanged);
  if (checked) return checked;
  // Append; undone below on any failure.
  auto undo = [&] {
    o->tensors.resize(T0);
    o->groups.resize(G0);
    for (Group &g : o->groups)
      while (!g.tensors.empty() && (size_t)g.tensors.back() >= T0) g.tensors.pop_back();
  };
  try {
    for (int i = 0; i < new_groups; ++i) {
      Group g;
      for (uint32_t h = 0; h < o->d->num_hypers; ++h) g.hypers.push_back(o->d->hypers[h].default_value);
      g.buffers.assign(o->d->num_states, nullptr);
      o->groups.push_back(std::move(g));
    }
    for (const Tensor &x : add) {
      o->tensors.push_back(x);
      o->groups[(size_t)x.group].tensors.push_back((int)o->tensors.size() - 1);
    }
  } catch (...) {
    undo();
    return fail(ZOPT_ERR_OUT_OF_MEMORY, "%s: out of memory", fn);
  }
  std::vector<uint8_t> active = o->active;
  auto unregister = [&] {
    for (const void *p : seen) o->params.erase(p);
  };
  try {
    if (!active.empty()) active.resize(o->tensors.size(), 1);  // the new tensors have a gradient
    for (const void *p : seen) o->params.insert(p);
  } catch (...) {
    unregister();
    undo();
    return fail(ZOPT_ERR_OUT_OF_MEMORY, "%s: out of memory", fn);
  }
  if (o->finalized)
    if (zopt_status st = rebuild(o, T0)) {
      unregister();
      undo();
      return st;
    }
  o->active.swap(active);
  if (o->finalized) o->generation++;
  if (first_group) *first_group = (int)G0;
  if (first_tensor) *first_tensor = (int)T0;
  return ZOPT_OK;
}

}  // extern "C"
