// zopt-bench-zero: a ZeRO step at W MPI ranks against raw MPI moving the
// same bytes, in the same run.
//
//   mpirun -np W zopt-bench-zero STEP.so [--params N] [--tensors T] [--steps K]
//
// Every rank registers N parameters (T tensors) with its own gradients and
// runs K steps over the MPI communicator (checks off, as a trusted job
// would). Per rank it reports the runtime-owned state bytes/param against
// one rank's, the median step time and its ops. For the collectives it
// reports the bytes each rank sends — REDUCE_SCATTER's all-to-all and
// ALL_GATHER's all-gather move (W-1)/W of the bucket bytes, the theoretical
// minimum of a reduce-scatter and an all-gather — and times raw
// MPI_Alltoall / MPI_Allgather of exactly those bytes per bucket (the
// transport alone: no packing, no fold) in the same run, with the ratio
// raw / zopt (1.0: zopt's collective ops cost what the transport costs).
//
// --overlap MS (ZeRO-2/3 steps): gradient streaming with a simulated
// backward that leaves the CPU free (a GPU's, or one waiting on data): per
// bucket, last first, MS ms of backward, then the bucket handed over:
// zopt_optimizer_reduce_bucket (on this thread) against
// zopt_optimizer_reduce_bucket_async (on the optimizer's thread, while the
// next MS ms run), then the step. Reports the time from the start of
// backward to the end of the step for both, in the same run, against
// backward alone plus the step's own update.
#include <mpi.h>

#include "zopt/comm.h"
#include "zopt/zopt.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

namespace {

double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }
double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}
size_t esize(uint32_t dt) { return dt == ZOPT_DTYPE_F32 ? 4 : 2; }

#define CK(call)                                                                     \
  do {                                                                               \
    zopt_status st_ = (call);                                                        \
    if (st_ != ZOPT_OK) {                                                            \
      std::fprintf(stderr, "rank %d: %s failed: %s\n", rank, #call, zopt_last_error()); \
      MPI_Abort(MPI_COMM_WORLD, 1);                                                  \
    }                                                                                \
  } while (0)

// The transport inside the program's collective ops: a communicator that
// forwards to the MPI one and times each call, so that the report can hold
// the transport alone (against raw MPI of the same bytes) apart from the
// packing of shards and the fold in rank order around it.
struct Timed {
  zopt_comm *inner;
  double a2a = 0, ag = 0;
};
int timed_a2a(void *ctx, const void *send, void *recv, size_t bytes) {
  Timed *t = (Timed *)ctx;
  double t0 = now();
  int rc = zopt_comm_all_to_all(t->inner, send, recv, bytes) == ZOPT_OK ? 0 : 1;
  t->a2a += now() - t0;
  return rc;
}
int timed_ag(void *ctx, const void *send, void *recv, size_t bytes) {
  Timed *t = (Timed *)ctx;
  double t0 = now();
  int rc = zopt_comm_all_gather(t->inner, send, recv, bytes) == ZOPT_OK ? 0 : 1;
  t->ag += now() - t0;
  return rc;
}
const char *timed_error(void *) { return zopt_last_error(); }

}  // namespace

int main(int argc, char **argv) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_SERIALIZED, &provided);
  int rank = 0, world = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  if (argc < 2) {
    if (!rank) std::fprintf(stderr, "usage: mpirun -np W zopt-bench-zero STEP.so [--params N] [--tensors T] [--steps K]\n");
    MPI_Finalize();
    return 2;
  }
  int64_t nParams = int64_t(64) << 20;
  int nTensors = 64, steps = 5, threads = 1;
  double overlapMs = -1;
  for (int i = 2; i + 1 < argc; i += 2) {
    std::string a = argv[i];
    long long v = std::atoll(argv[i + 1]);
    if (a == "--params") nParams = v;
    else if (a == "--tensors") nTensors = (int)v;
    else if (a == "--steps") steps = (int)v;
    else if (a == "--threads") threads = (int)v;
    else if (a == "--overlap") overlapMs = std::atof(argv[i + 1]);
  }
  zopt_step *step = nullptr;
  CK(zopt_step_load(argv[1], &step));
  const zopt_step_descriptor *d = zopt_step_get_descriptor(step);
  uint32_t pdt = 0, gdt = 0;
  for (uint32_t i = 0; i < d->num_states; ++i) {
    if (d->states[i].kind == ZOPT_STATE_PARAM) pdt = d->states[i].dtype;
    if (d->states[i].kind == ZOPT_STATE_GRAD) gdt = d->states[i].dtype;
  }
  zopt_comm *mpi = nullptr, *comm = nullptr;
  MPI_Comm world_comm = MPI_COMM_WORLD;
  CK(zopt_comm_create_mpi(&world_comm, &mpi));
  CK(zopt_comm_set_checks(mpi, 0));
  Timed timed{mpi};
  zopt_comm_ops ops{};
  ops.version = ZOPT_COMM_OPS_VERSION;
  ops.memory = ZOPT_COMM_MEM_HOST;
  ops.name = "mpi (timed)";
  ops.all_to_all = timed_a2a;
  ops.all_gather = timed_ag;
  ops.last_error = timed_error;
  CK(zopt_comm_create(&ops, &timed, rank, world, &comm));
  CK(zopt_comm_set_checks(comm, 0));
  zopt_optimizer *o = nullptr;
  CK(zopt_optimizer_create(step, &o));
  CK(zopt_optimizer_set_num_threads(o, threads));
  int g, id;
  CK(zopt_optimizer_add_group(o, &g));
  std::vector<std::vector<uint16_t>> p(nTensors), gr(nTensors);
  std::vector<std::vector<float>> pf(nTensors), gf(nTensors);
  for (int t = 0; t < nTensors; ++t) {
    size_t n = (size_t)(nParams / nTensors + (t < nParams % nTensors ? 1 : 0));
    void *pp, *gp;
    if (pdt == ZOPT_DTYPE_F32) {
      pf[t].assign(n, 0.01f * (float)(t + 1));
      pp = pf[t].data();
    } else {
      p[t].assign(n, 0x3c23);  // bf16/f16 bits of a small value
      pp = p[t].data();
    }
    if (gdt == ZOPT_DTYPE_F32) {
      gf[t].assign(n, 1e-3f * (float)(rank + 1));
      gp = gf[t].data();
    } else {
      gr[t].assign(n, (uint16_t)(0x3a83 + rank));
      gp = gr[t].data();
    }
    CK(zopt_optimizer_add_tensor(o, g, pp, gp, (int64_t)n, (zopt_dtype)pdt, &id));
  }
  CK(zopt_optimizer_set_comm(o, comm));
  CK(zopt_optimizer_finalize(o));
  std::vector<double> times, op(d->num_program + 1), sum_op(d->num_program + 1, 0.0);
  zopt_step_result r;
  CK(zopt_optimizer_step(o, &r));  // warm-up
  timed.a2a = timed.ag = 0;
  for (int k = 0; k < steps; ++k) {
    MPI_Barrier(MPI_COMM_WORLD);
    double t0 = now();
    CK(zopt_optimizer_step(o, &r));
    times.push_back(now() - t0);
    CK(zopt_optimizer_get_op_times(o, op.data(), (int)op.size()));
    for (size_t i = 0; i < op.size(); ++i) sum_op[i] += op[i] / steps;
  }
  double reduce_s = 0, gather_s = 0, update_s = 0, norm_s = 0;
  for (uint32_t i = 0; i < d->num_program; ++i) {
    if (d->program[i].code == ZOPT_OP_REDUCE_SCATTER) reduce_s += sum_op[i];
    if (d->program[i].code == ZOPT_OP_ALL_GATHER) gather_s += sum_op[i];
    if (d->program[i].code == ZOPT_OP_UPDATE) update_s += sum_op[i];
    if (d->program[i].code == ZOPT_OP_NORM_PARTIALS || d->program[i].code == ZOPT_OP_NORM) norm_s += sum_op[i];
  }
  zopt_memory_info mi;
  CK(zopt_optimizer_memory_info(o, &mi));

  // The bytes the program's collectives move per rank: per bucket, the
  // all-to-all sends W-1 of W shards; the all-gather sends this rank's
  // shard to W-1 ranks. Buckets of 8Mi elements (the default), each padded
  // to a multiple of W * 32768.
  const int64_t bucket = int64_t(1) << 23, quantum = (int64_t)world * 32768;
  std::vector<int64_t> shards;
  for (int64_t b = 0; b < nParams; b += bucket) {
    int64_t len = std::min(bucket, nParams - b);
    shards.push_back((len + quantum - 1) / quantum * quantum / world);
  }
  bool gathers_param = false, reduces = false, gathers_grad = false;
  for (uint32_t i = 0; i < d->num_program; ++i) {
    const zopt_program_op &pop = d->program[i];
    if (pop.code == ZOPT_OP_REDUCE_SCATTER) reduces = true;
    if (pop.code == ZOPT_OP_ALL_GATHER) (d->states[pop.state].kind == ZOPT_STATE_PARAM ? gathers_param : gathers_grad) = true;
  }
  double sent_reduce = 0, sent_gather = 0;
  for (int64_t s : shards) {
    if (reduces) sent_reduce += (double)(world - 1) * s * esize(gdt);
    if (gathers_param) sent_gather += (double)(world - 1) * s * esize(pdt);
    if (gathers_grad) sent_gather += (double)(world - 1) * s * esize(gdt);
  }
  // Raw MPI of the same bytes, same buckets, same run.
  size_t maxb = 0;
  for (int64_t s : shards) maxb = std::max(maxb, (size_t)s * 4);
  std::vector<char> sb(maxb * world), rb(maxb * world);
  std::memset(sb.data(), 1, sb.size());
  std::vector<double> raw_a2a, raw_ag;
  for (int k = 0; k < steps; ++k) {
    MPI_Barrier(MPI_COMM_WORLD);
    double t0 = now();
    if (reduces)
      for (int64_t s : shards)
        MPI_Alltoall(sb.data(), (int)(s * esize(gdt)), MPI_BYTE, rb.data(), (int)(s * esize(gdt)), MPI_BYTE, MPI_COMM_WORLD);
    double t1 = now();
    for (int64_t s : shards) {
      if (gathers_param)
        MPI_Allgather(sb.data(), (int)(s * esize(pdt)), MPI_BYTE, rb.data(), (int)(s * esize(pdt)), MPI_BYTE, MPI_COMM_WORLD);
      if (gathers_grad)
        MPI_Allgather(sb.data(), (int)(s * esize(gdt)), MPI_BYTE, rb.data(), (int)(s * esize(gdt)), MPI_BYTE, MPI_COMM_WORLD);
    }
    raw_a2a.push_back(t1 - t0);
    raw_ag.push_back(now() - t1);
  }
  double ra = median(raw_a2a), rg = median(raw_ag);
  struct Row {
    double v[14];
  } mine{{mi.state_bytes / (double)mi.num_params, mi.state_bytes_one_rank / (double)mi.num_params,
          median(times) * 1e3, reduce_s * 1e3, norm_s * 1e3, update_s * 1e3, gather_s * 1e3,
          sent_reduce / (double)nParams, sent_gather / (double)nParams, ra * 1e3, rg * 1e3, r.grad_norm,
          timed.a2a / steps * 1e3, timed.ag / steps * 1e3}};
  std::vector<Row> rows(world);
  MPI_Gather(&mine, sizeof(Row), MPI_BYTE, rows.data(), sizeof(Row), MPI_BYTE, 0, MPI_COMM_WORLD);
  if (rank == 0) {
    std::printf("step %s (ZeRO stage %u), %lld params in %d tensors, W = %d MPI ranks x %d thread(s), median of %d "
                "steps\n",
                d->name, d->zero_stage, (long long)nParams, nTensors, world, threads, steps);
    // Per op: its time, and (in parentheses) the transport inside it; the
    // ratios: raw MPI / transport (the engine against MPI itself), and raw
    // MPI / the whole op (packing of shards and the fold included).
    std::printf("%4s %9s %9s %8s %16s %8s %9s %16s | %12s %12s %8s %8s %13s %13s\n", "rank", "state B/p",
                "1-rank B/p", "step ms", "reduce (a2a) ms", "norm ms", "update ms", "gather (ag) ms",
                "sent B/p red", "sent B/p gat", "raw a2a", "raw ag", "a2a r tr/op", "ag r tr/op");
    for (int q = 0; q < world; ++q) {
      const double *v = rows[q].v;
      auto ratio = [](double a, double b) { return b > 1e-3 ? a / b : 0.0; };  // ms; W = 1 has no collectives
      std::printf("%4d %9.2f %9.2f %8.1f %8.1f (%5.1f) %8.1f %9.1f %8.1f (%5.1f) | %12.3f %12.3f %8.1f %8.1f %6.2f %6.2f "
                  "%6.2f %6.2f\n",
                  q, v[0], v[1], v[2], v[3], v[12], v[4], v[5], v[6], v[13], v[7], v[8], v[9], v[10],
                  ratio(v[9], v[12]), ratio(v[9], v[3]), ratio(v[10], v[13]), ratio(v[10], v[6]));
    }
    std::printf("theoretical bytes/param sent per rank: reduce-scatter (W-1)/W x %zu = %.3f, all-gather (W-1)/W x %zu "
                "= %.3f (plus padding to W x 32768 per bucket)\n",
                esize(gdt), (world - 1.0) / world * esize(gdt), esize(pdt), (world - 1.0) / world * esize(pdt));
  }
  if (overlapMs >= 0 && d->zero_stage >= 2) {
    // The streamed twin: its own params, the same gradients handed over.
    zopt_optimizer *so = nullptr;
    CK(zopt_optimizer_create(step, &so));
    CK(zopt_optimizer_set_num_threads(so, threads));
    CK(zopt_optimizer_set_grad_streaming(so, 1));
    CK(zopt_optimizer_add_group(so, &g));
    std::vector<std::vector<uint16_t>> p2 = p;
    std::vector<std::vector<float>> pf2 = pf;
    std::vector<const void *> gptr(nTensors);
    for (int t = 0; t < nTensors; ++t) {
      void *pp = pdt == ZOPT_DTYPE_F32 ? (void *)pf2[t].data() : (void *)p2[t].data();
      int64_t n = pdt == ZOPT_DTYPE_F32 ? (int64_t)pf2[t].size() : (int64_t)p2[t].size();
      gptr[t] = gdt == ZOPT_DTYPE_F32 ? (const void *)gf[t].data() : (const void *)gr[t].data();
      CK(zopt_optimizer_add_tensor(so, g, pp, nullptr, n, (zopt_dtype)pdt, &id));
    }
    CK(zopt_optimizer_set_comm(so, comm));
    CK(zopt_optimizer_finalize(so));
    int nb = 0;
    CK(zopt_optimizer_num_buckets(so, &nb));
    std::vector<std::vector<const void *>> bg(nb);
    for (int b = 0; b < nb; ++b) {
      int n = 0;
      CK(zopt_optimizer_bucket_tensors(so, b, nullptr, 0, &n));
      std::vector<int> ids(n);
      CK(zopt_optimizer_bucket_tensors(so, b, ids.data(), n, &n));
      for (int t : ids) bg[b].push_back(gptr[t]);
    }
    double upd = 0;  // the step's own update (no exchange): from the op times
    std::vector<double> t_sync, t_async;
    for (int k = 0; k < steps + 1; ++k)
      for (int async = 0; async < 2; ++async) {
        MPI_Barrier(MPI_COMM_WORLD);
        double t0 = now();
        for (int b = nb - 1; b >= 0; --b) {
          std::this_thread::sleep_for(std::chrono::duration<double, std::milli>(overlapMs));
          if (async)
            CK(zopt_optimizer_reduce_bucket_async(so, b, bg[b].data(), (int)bg[b].size()));
          else
            CK(zopt_optimizer_reduce_bucket(so, b, bg[b].data(), (int)bg[b].size()));
        }
        CK(zopt_optimizer_step(so, &r));
        double dt = now() - t0;
        if (k == 0) continue;  // warm-up
        (async ? t_async : t_sync).push_back(dt);
        CK(zopt_optimizer_get_op_times(so, op.data(), (int)op.size()));
        double u = 0;
        for (uint32_t i = 0; i < d->num_program; ++i)
          if (d->program[i].code != ZOPT_OP_REDUCE_SCATTER) u += op[i];
        upd += u / (2.0 * steps);
      }
    double row[3] = {median(t_sync) * 1e3, median(t_async) * 1e3, upd * 1e3}, all[3 * 4096];
    MPI_Gather(row, 3, MPI_DOUBLE, all, 3, MPI_DOUBLE, 0, MPI_COMM_WORLD);
    if (rank == 0) {
      const double bw = nb * overlapMs;
      std::printf("streamed gradients, %d buckets, a simulated backward of %.1f ms per bucket (%.1f ms; the CPU "
                  "free), then the step; backward start to step end, median of %d:\n",
                  nb, overlapMs, bw, steps);
      std::printf("%4s %12s %12s %14s %16s %14s\n", "rank", "sync ms", "async ms", "async/sync",
                  "floor ms (bw+st)", "async/floor");
      for (int q = 0; q < world; ++q) {
        const double *v = all + 3 * q;
        std::printf("%4d %12.1f %12.1f %14.2f %16.1f %14.2f\n", q, v[0], v[1], v[1] / v[0], bw + v[2],
                    v[1] / (bw + v[2]));
      }
      std::printf("(floor: the backward alone plus the step's ops other than the exchange; sync: each bucket "
                  "exchanged on the backward thread)\n");
    }
    zopt_optimizer_free(so);
  }
  zopt_optimizer_free(o);
  zopt_comm_free(comm);
  zopt_step_free(step);
  MPI_Finalize();
  return 0;
}
