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
#include "zopt/comm.h"
#include "zopt/zopt.h"
#include "rank_test_util.h"
#include "zopt_reference.h"

#include <algorithm>
#include <cmath>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <chrono>
#include <thread>
#include <vector>

namespace {

struct Options {
  std::string step, other, linked, comm = "loopback", save, load, mismatch;
  bool begin = false, stall = false;
  int world = 2, steps = 4, threads = 1, accum = 1, inf_at = -1, from_world = 1, loaded_steps = 0;
  int64_t bucket = 65536, params = 0;
  double grad_scale = 0.05;
  bool mask = false, delay = false, stream = false, async = false, misorder = false, async_free = false;
};

std::mutex g_print_mu;
int g_failures = 0, g_passes = 0;

void report(int rank, bool ok, const char *fmt, ...) {
  char m[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(m, sizeof m, fmt, ap);
  va_end(ap);
  std::lock_guard<std::mutex> lk(g_print_mu);
  if (ok) {
    ++g_passes;
    if (rank == 0) printf("PASS %s\n", m);
  } else {
    ++g_failures;
    printf("FAIL rank %d: %s\n", rank, m);
  }
  fflush(stdout);
}

#define CK(call)                                                                      \
  do {                                                                                \
    zopt_status st_ = (call);                                                         \
    if (st_ != ZOPT_OK) {                                                             \
      report(rank, false, "%s -> %d: %s", #call, (int)st_, zopt_last_error());       \
      return false;                                                                   \
    }                                                                                 \
  } while (0)

size_t esize(uint32_t dt) { return rtu::dtype_size(dt); }
using rtu::load;
using rtu::mix;
using rtu::store;

// A deterministic value in +-[0.1, 1.1) * scale (never zero).
float value(uint64_t a, uint64_t b, uint64_t c, uint64_t i, double scale) {
  uint64_t h = mix(a * 0x9E3779B97F4A7C15ull ^ mix(b * 31 + c * 1000003 + i * 7919 + 17));
  double u = (double)(h >> 11) / 9007199254740992.0;
  return (float)((h & 1 ? 1.0 : -1.0) * (0.1 + u) * scale);
}

std::vector<int64_t> kSizes = {0, 1, 3, 5, 1000, 33333, 70001, 130000, 7};  // --params scales it
const std::vector<int> kGroups = {0, 0, 1, 0, 1, 0, 1, 0, 1};

struct Model {
  const zopt_step *step;
  const zopt_step_descriptor *d;
  uint32_t pdt, gdt;
  std::vector<std::vector<unsigned char>> p, g;
  zopt_optimizer *o = nullptr;
  ~Model() { zopt_optimizer_free(o); }
};

uint32_t dtype_of(const zopt_step_descriptor *d, uint32_t kind) {
  for (uint32_t i = 0; i < d->num_states; ++i)
    if (d->states[i].kind == kind) return d->states[i].dtype;
  return 0;
}

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

bool same_bits(double a, double b) { return memcmp(&a, &b, 8) == 0; }

// The documented layout (docs/DISTRIBUTED.md "The layout" and "Memory"),
// computed here from the description, not by runtime/src/layout: per group
// the tensors in reverse add order, each non-empty segment at a multiple of
// `align`; the norm block B, the largest power of two <= (elements / 128)
// in [max(64, align), 32768]; the flat space cut into buckets of `bucket`
// elements (0: the default picked from the model) rounded up to a multiple
// of W blocks; each bucket padded to a multiple of W blocks and cut into W
// equal shards; rank r owns shard r of every bucket.
int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }
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
  const int64_t es_c = collective_esize(d, stream), B = model_block(d->align), W = world;
  int64_t saved_w = 0;  // bytes per element, times W
  for (uint32_t s = 0; s < d->num_states; ++s) {
    const zopt_state_desc &sd = d->states[s];
    const int64_t es = esize(sd.dtype);
    const bool part = (sd.flags & ZOPT_STATE_PARTITIONED) != 0;
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
  const int64_t align = d->align < 1 ? 1 : d->align;
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
             const Options &opt, const char *tag, const std::vector<std::vector<unsigned char>> *own = nullptr) {
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
      std::vector<unsigned char> x((size_t)kSizes[t] * es + 1), y((size_t)kSizes[t] * es + 1);
      CK(zopt_optimizer_read_state_raw(m.o, (int)t, (zopt_state_kind)kind, x.data(), (size_t)kSizes[t] * es));
      CK(zopt_optimizer_read_state_raw(ref.o, (int)t, (zopt_state_kind)kind, y.data(), (size_t)kSizes[t] * es));
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
    lo += alloc((uint64_t)(part ? L.local : L1.local) * es);
    lo1 += alloc((uint64_t)L1.local * es);
    ref_lo1 += alloc((uint64_t)L1.local * es);
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
