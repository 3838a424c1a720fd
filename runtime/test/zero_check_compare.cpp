// zero_check_compare.cpp - what a rank of zopt-zero-check must hold: every
// result, param, state, count and grad of a step against the one-rank
// reference's, bit for bit, and the runtime-held bytes against the layout
// docs/DISTRIBUTED.md documents, computed here independently of
// runtime/src/layout.
#include "zero_check.h"

namespace zc {

bool same_bits(double a, double b) { return memcmp(&a, &b, 8) == 0; }

// The documented layout (docs/DISTRIBUTED.md "The layout" and "Memory"),
// computed here from the description, not by runtime/src/layout: per group
// the tensors in reverse add order, each non-empty segment at a multiple of
// `align`; the norm block B, the largest power of two <= (elements / 128)
// in [max(64, align), 32768]; the flat space cut into buckets of `bucket`
// elements (0: the default picked from the model) rounded up to a multiple
// of W blocks; each bucket padded to a multiple of W blocks and cut into W
// equal shards; rank r owns shard r of every bucket. A step with q8
// moments (abi.h "q8 moments") lays out with align >= 256, and its
// PER_BLOCK states (a q8 absmax) hold one f32 per 256 elements of that
// layout (a rank's buffer: its local elements / 256).
int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }
bool per_block(const zopt_state_desc &sd) { return (sd.flags & ZOPT_STATE_PER_BLOCK) != 0; }
int64_t layout_align(const zopt_step_descriptor *d) {
  int64_t a = d->align < 1 ? 1 : d->align;
  for (uint32_t s = 0; s < d->num_states; ++s)
    if (per_block(d->states[s])) a = std::max<int64_t>(a, 256);
  return a;
}
// Elements of state sd for n elements of a tensor.
int64_t state_elems(const zopt_state_desc &sd, int64_t n) { return per_block(sd) ? (n + 255) / 256 : n; }
int64_t model_elems() {
  int64_t n = 0;
  for (int64_t x : kSizes) n += x;
  return n;
}
int64_t model_block(int64_t align) {
  const int64_t lo = std::max<int64_t>(64, align);
  int64_t b = lo;
  while (b < 32768 && b * 2 <= model_elems() / 128) b *= 2;
  return b;
}
// The widest dtype a collective of the step moves: the states of its
// REDUCE_SCATTER and ALL_GATHER ops, the streamed gradient.
int64_t collective_esize(const zopt_step_descriptor *d, bool stream) {
  int64_t es = 0;
  for (uint32_t i = 0; i < d->num_program; ++i) {
    const zopt_program_op &op = d->program[i];
    if (op.code == ZOPT_OP_REDUCE_SCATTER || op.code == ZOPT_OP_ALL_GATHER)
      es = std::max<int64_t>(es, esize(d->states[op.state].dtype));
  }
  for (uint32_t s = 0; s < d->num_states; ++s)
    if (stream && d->states[s].kind == ZOPT_STATE_GRAD) es = std::max<int64_t>(es, esize(d->states[s].dtype));
  return es;
}
// The default bucket at W: the scratch (two buckets of the collectives'
// dtype) at most half of what sharding saves a rank, in [W blocks, 8Mi].
int64_t model_default_bucket(const zopt_step_descriptor *d, int world, bool stream) {
  const int64_t es_c = collective_esize(d, stream), B = model_block(layout_align(d)), W = world;
  int64_t saved_w = 0;  // bytes per element, times W
  for (uint32_t s = 0; s < d->num_states; ++s) {
    const zopt_state_desc &sd = d->states[s];
    const int64_t es = esize(sd.dtype);
    const bool part = (sd.flags & ZOPT_STATE_PARTITIONED) != 0;
    if (per_block(sd)) continue;  // 4/256 bytes per element: not counted
    if (sd.kind == ZOPT_STATE_PARAM) saved_w -= part ? es : 0;
    else if (sd.kind == ZOPT_STATE_GRAD) saved_w += stream ? es * (W - 1) : 0;
    else if (part) saved_w += es * (W - 1);
  }
  const int64_t kMax = int64_t(1) << 23;
  if (W == 1 || es_c == 0 || saved_w <= 0) return kMax;
  const int64_t fit = (int64_t)((__int128)saved_w * model_elems() / (4 * es_c * W));
  return std::max(std::min(fit, kMax) / (W * B) * (W * B), W * B);
}
struct LayoutModel {
  struct Bucket {
    int group;
    int64_t begin, len, shard;
  };
  int64_t block = 0;
  std::vector<int64_t> flat;  // per tensor: its element 0 in its group's flat space
  std::vector<int64_t> group_len;
  std::vector<Bucket> buckets;
  int64_t local = 0;          // elements of a rank's buffer of a sharded state
  int64_t max_padded = 0, blocks_per_rank = 0;
  // The rank owning element i of tensor t.
  int owner(size_t t, int64_t i) const {
    const int64_t f = flat[t] + i;
    for (const Bucket &b : buckets)
      if (b.group == kGroups[t] && f >= b.begin && f < b.begin + b.len) return (int)((f - b.begin) / b.shard);
    return -1;
  }
};
// `world`'s layout; `bucket` as set (0: the default for `d` at `default_world`
// ranks, which a one-rank layout of the W-rank model keeps).
LayoutModel model_layout(int world, const zopt_step_descriptor *d, int64_t bucket, size_t T, bool stream,
                         int default_world) {
  LayoutModel L;
  const int64_t align = layout_align(d);
  L.block = model_block(align);
  L.flat.assign(T, 0);
  if (bucket <= 0) bucket = model_default_bucket(d, default_world, stream);
  const int64_t quantum = (int64_t)world * L.block, B = round_up(bucket, quantum);
  int groups = 0;
  for (size_t t = 0; t < T; ++t) groups = std::max(groups, kGroups[t] + 1);
  for (int g = 0; g < groups; ++g) {
    int64_t off = 0;
    for (size_t t = T; t-- > 0;) {
      if (kGroups[t] != g) continue;
      if (kSizes[t] > 0) off = round_up(off, align);
      L.flat[t] = off;
      off += kSizes[t];
    }
    L.group_len.push_back(off);
    for (int64_t b = 0; b < off; b += B) {
      const int64_t len = std::min(B, off - b), padded = round_up(len, quantum);
      L.buckets.push_back({g, b, len, padded / world});
      L.local += padded / world;
      L.blocks_per_rank += padded / world / L.block;
      L.max_padded = std::max(L.max_padded, padded);
    }
  }
  return L;
}

// What a rank's grad memory holds after a step, read from the step program:
// a step that all-gathers the grad leaves every rank the whole reduced
// (rank-order summed) gradient (ZeRO-0 and 1); one that only
// reduce-scatters it leaves the reduced gradient in the rank's own shards
// and the rank's own gradient elsewhere (ZeRO-2 and 3).
enum class GradKeep { kOwn, kShards, kWhole };
GradKeep grad_keep(const zopt_step_descriptor *d) {
  bool reduced = false, gathered = false;
  for (uint32_t i = 0; i < d->num_program; ++i) {
    const zopt_program_op &op = d->program[i];
    const bool grad = d->states[op.state].kind == ZOPT_STATE_GRAD;
    reduced |= op.code == ZOPT_OP_REDUCE_SCATTER && grad;
    gathered |= op.code == ZOPT_OP_ALL_GATHER && grad;
  }
  return gathered ? GradKeep::kWhole : reduced ? GradKeep::kShards : GradKeep::kOwn;
}

// Compares everything a step produces. `own` (NULL after a load: no step
// ran) is this rank's gradients as handed to the step: the grad memory is
// compared with the reference's (the rank-order sum, which a one-rank step
// leaves as it is) where the program leaves the reduced gradient.
bool compare(int rank, Model &m, Model &ref, const zopt_step_result &a, const zopt_step_result &b, int k,
             const Options &opt, const char *tag, const std::vector<std::vector<unsigned char>> *own) {
  bool ok = true;
  char what[160];
  snprintf(what, sizeof what, "%s step %d", tag, k);
  if (!(same_bits(a.grad_norm, b.grad_norm) || (std::isnan(a.grad_norm) && std::isnan(b.grad_norm))) ||
      a.skipped != b.skipped || a.loss_scale != b.loss_scale) {
    report(rank, false, "%s: result (norm %.17g, skipped %d, scale %g) != one rank's (%.17g, %d, %g)", what,
           a.grad_norm, a.skipped, a.loss_scale, b.grad_norm, b.skipped, b.loss_scale);
    ok = false;
  }
  const zopt_step_descriptor *d = m.d;
  const bool zero3 = [&] {
    for (uint32_t i = 0; i < d->num_states; ++i)
      if (d->states[i].kind == ZOPT_STATE_PARAM) return (d->states[i].flags & ZOPT_STATE_PARTITIONED) != 0;
    return false;
  }();
  // Params in user memory (ZeRO-3: gathered first, a collective).
  if (zero3) CK(zopt_optimizer_gather_params(m.o, 0, (int)kSizes.size(), nullptr));
  if (zero3) CK(zopt_optimizer_gather_params(ref.o, 0, (int)kSizes.size(), nullptr));
  for (size_t t = 0; t < m.p.size(); ++t)
    if (memcmp(m.p[t].data(), ref.p[t].data(), (size_t)kSizes[t] * esize(m.pdt)) != 0) {
      size_t i = 0;
      while (i < (size_t)kSizes[t] && load(m.p[t].data(), m.pdt, i) == load(ref.p[t].data(), m.pdt, i)) ++i;
      report(rank, false, "%s: param of tensor %zu differs from one rank's at element %zu (%.9g vs %.9g)", what, t, i,
             i < (size_t)kSizes[t] ? load(m.p[t].data(), m.pdt, i) : 0.0f,
             i < (size_t)kSizes[t] ? load(ref.p[t].data(), m.pdt, i) : 0.0f);
      ok = false;
    }
  // Every optimizer state, whole (sharded states: gathered, a collective).
  for (uint32_t s = 0; s < d->num_states; ++s) {
    uint32_t kind = d->states[s].kind;
    if (kind == ZOPT_STATE_GRAD) continue;
    size_t es = esize(d->states[s].dtype);
    for (size_t t = 0; t < m.p.size(); ++t) {
      const size_t n = (size_t)state_elems(d->states[s], kSizes[t]) * es;
      std::vector<unsigned char> x(n + 1), y(n + 1);
      CK(zopt_optimizer_read_state_raw(m.o, (int)t, (zopt_state_kind)kind, x.data(), n));
      CK(zopt_optimizer_read_state_raw(ref.o, (int)t, (zopt_state_kind)kind, y.data(), n));
      if (x != y) {
        report(rank, false, "%s: state %u of tensor %zu differs from one rank's", what, kind, t);
        ok = false;
      }
    }
  }
  for (size_t t = 0; t < m.p.size(); ++t) {
    int64_t c1 = -1, c2 = -2;
    CK(zopt_optimizer_get_tensor_step(m.o, (int)t, &c1));
    CK(zopt_optimizer_get_tensor_step(ref.o, (int)t, &c2));
    if (c1 != c2) {
      report(rank, false, "%s: tensor %zu took %lld steps, one rank's %lld", what, t, (long long)c1, (long long)c2);
      ok = false;
    }
  }
  // The grad memory (none registered when streaming).
  if (own && !opt.stream) {
    const GradKeep keep = grad_keep(d);
    const LayoutModel L = model_layout(opt.world, d, opt.bucket, m.g.size(), opt.stream, opt.world);
    const size_t es = esize(m.gdt);
    for (size_t t = 0; t < m.g.size(); ++t)
      for (int64_t i = 0; i < kSizes[t]; ++i) {
        const bool reduced =
            keep == GradKeep::kWhole || (keep == GradKeep::kShards && L.owner(t, i) == rank);
        const unsigned char *want = (reduced ? ref.g[t].data() : (*own)[t].data()) + (size_t)i * es;
        if (memcmp(m.g[t].data() + (size_t)i * es, want, es) != 0) {
          report(rank, false,
                 "%s: grad of tensor %zu element %lld is %.9g, want %.9g (%s; element owned by rank %d)", what, t,
                 (long long)i, load(m.g[t].data(), m.gdt, (size_t)i), load(want, m.gdt, 0),
                 reduced ? "the reduced gradient: one rank's rank-order sum" : "this rank's own gradient",
                 L.owner(t, i));
          ok = false;
          break;
        }
      }
  }
  return ok;
}

// The runtime-owned bytes this rank holds are what the layout assigns it:
// per state the runtime holds (the optimizer states; ZeRO-3 params), its
// shards of every bucket (a partitioned state) or the whole padded flat
// space (one that is not), in the state's dtype, each buffer rounded up to
// 64 bytes (its allocation); streamed gradients likewise in grad_bytes. So
// a sharded state takes 1/W of the flat elements plus less than one norm
// block per group (docs/DISTRIBUTED.md "Memory"). The collective scratch
// (W > 1 only) is one bucket of the collectives' dtype to receive, one to
// send where the program reduces, and every rank's norm partials;
// bytes_cpu adds the user's params and registered grads. With the default
// bucket, no rank holds more than one rank of the same step at stage 0
// (the reference's bytes, less a ZeRO-3 param copy).
bool check_memory(int rank, Model &m, Model &ref, const Options &opt, const char *tag) {
  zopt_memory_info mi, mr;
  CK(zopt_optimizer_memory_info(m.o, &mi));
  CK(zopt_optimizer_memory_info(ref.o, &mr));
  const int W = opt.world;
  const size_t T = m.g.size();
  const LayoutModel L = model_layout(W, m.d, opt.bucket, T, opt.stream, W),
                    L1 = model_layout(1, m.d, opt.bucket, T, opt.stream, W);
  auto alloc = [](uint64_t b) { return (b + 63) & ~(uint64_t)63; };
  int64_t flat = 0, groups = 0;
  for (int64_t n : L.group_len) flat += n, groups += n > 0;
  uint64_t lo = 0, lo1 = 0, ref_lo1 = 0, grads = 0, ref_param = 0, pg = 0;
  bool ok = true;
  for (uint32_t s = 0; s < m.d->num_states; ++s) {
    const zopt_state_desc &sd = m.d->states[s];
    const uint64_t es = esize(sd.dtype);
    const bool part = (sd.flags & ZOPT_STATE_PARTITIONED) != 0;
    if (sd.kind == ZOPT_STATE_GRAD) {
      pg += opt.stream ? 0 : (uint64_t)model_elems() * es;  // registered grad memory
      if (opt.stream) grads = alloc((uint64_t)L.local * es);
      continue;
    }
    if (sd.kind == ZOPT_STATE_PARAM) pg += (uint64_t)model_elems() * es;
    if (sd.kind == ZOPT_STATE_PARAM && !part) continue;
    const int64_t q = per_block(sd) ? 256 : 1;
    lo += alloc((uint64_t)((part ? L.local : L1.local) / q) * es);
    lo1 += alloc((uint64_t)(L1.local / q) * es);
    ref_lo1 += alloc((uint64_t)(L1.local / q) * es);
    if (sd.kind == ZOPT_STATE_PARAM) ref_param = alloc((uint64_t)L1.local * es);
    // 1/W of the flat elements plus less than one block per group.
    if (part && W > 1) ok = ok && L.local * W >= flat && L.local * W < flat + (int64_t)W * L.block * groups;
  }
  ok = ok && mi.state_bytes == lo && mi.state_bytes_one_rank == lo1 && mr.state_bytes == ref_lo1 &&
       mr.state_bytes_one_rank == ref_lo1 && mi.grad_bytes == grads && mr.grad_bytes == 0;
  bool reduces = opt.stream;
  for (uint32_t i = 0; i < m.d->num_program; ++i) reduces |= m.d->program[i].code == ZOPT_OP_REDUCE_SCATTER;
  const uint64_t es_c = (uint64_t)collective_esize(m.d, opt.stream);
  const uint64_t scratch =
      W > 1 ? (reduces ? 2 : 1) * (uint64_t)L.max_padded * es_c + (uint64_t)L.blocks_per_rank * W * 8 : 0;
  ok = ok && mi.scratch_bytes == scratch && mr.scratch_bytes == 0;
  ok = ok && mi.bytes_cpu == pg + lo + grads + scratch;
  report(rank, ok,
         "%smemory: %llu state bytes on this rank (the layout's shards: %llu; block %lld), %llu on one rank (%llu), "
         "gradient shards %llu, scratch %llu (the layout's %llu), world %d",
         tag, (unsigned long long)mi.state_bytes, (unsigned long long)lo, (long long)L.block,
         (unsigned long long)mi.state_bytes_one_rank, (unsigned long long)lo1, (unsigned long long)mi.grad_bytes,
         (unsigned long long)mi.scratch_bytes, (unsigned long long)scratch, W);
  if (opt.bucket <= 0 && m.d->zero_stage >= 1 && W > 1) {
    // The guarantee (ZeRO-1/2/3 at W > 1; ZeRO-0 there is DDP, whose
    // reduction needs its scratch): one rank of the same step at stage 0
    // holds the reference's bytes without its ZeRO-3 param copy.
    const uint64_t stage0 = mr.bytes_cpu - ref_param;
    const double n = (double)model_elems();
    const bool fits = mi.bytes_cpu <= stage0;
    report(rank, fits, "%smemory: %.2f B/param on this rank of %d, at most stage 0 at one rank (%.2f B/param)", tag,
           (double)mi.bytes_cpu / n, W, (double)stage0 / n);
    ok = ok && fits;
  }
  return ok;
}

}  // namespace zc
