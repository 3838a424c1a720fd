/*===- zopt/zopt.h - zopt runtime C API -----------------------*- C -*-===*
 *
 * The stable, versioned C API of libzopt_runtime. A training job links only
 * this library (no LLVM/MLIR). Every call returns a zopt_status; on failure
 * zopt_last_error() holds a readable message for the calling thread.
 * (Longer than ~800 lines: it is the one public header of the runtime, and
 * each entry's contract sits beside its prototype; docs/ABI.md keeps the
 * history.)
 *
 * Life of an optimizer:
 *   zopt_step_load("step.so")            -> zopt_step*
 *   zopt_optimizer_create(step)          -> zopt_optimizer*
 *   zopt_optimizer_add_group(...)         (hyperparameters per group)
 *   zopt_optimizer_add_tensor(...)        (user param/grad memory)
 *   zopt_optimizer_finalize(...)          (allocate + init master/moments)
 *   loop: zopt_optimizer_set_hyper(...); zopt_optimizer_step(...)
 *
 * Threading: the error message is per thread. One optimizer takes one call
 * at a time: while a call runs on it, a call on it from another thread is
 * refused at once with ZOPT_ERR_BAD_STATE naming the running call
 * ("zopt_optimizer_step: another call (zopt_optimizer_step) is running on
 * this optimizer on another thread ...") and changes nothing; calls from
 * several threads one after the other are fine. zopt_optimizer_free waits
 * for a call running on another thread to return, then frees (calls made
 * while it waits are refused; any call after it returns is a use after
 * free). Distinct optimizers are independent, also when they share one
 * zopt_step (created and freed on any threads). step() itself runs on a
 * persistent pool of zopt_optimizer_set_num_threads threads (default:
 * $ZOPT_NUM_THREADS, else the hardware concurrency).
 *
 * Ranks (ZeRO): an optimizer given a communicator (zopt/comm.h,
 * zopt_optimizer_set_comm) of W ranks runs the step's compiled program on
 * every rank: gradients are reduced across ranks (their mean by default),
 * each rank keeps and updates only its shards of the states the ZeRO stage
 * partitions, the global norm and the skip decision are the same on every
 * rank, and updated params are gathered (ZeRO-1/2) or stay sharded
 * (ZeRO-3: zopt_optimizer_gather_params). The result is bit-identical to a
 * one-rank step on the rank-order sum of the ranks' gradients, at any W.
 * docs/DISTRIBUTED.md has the layout and the semantics.
 *===----------------------------------------------------------------------===*/
#ifndef ZOPT_ZOPT_H
#define ZOPT_ZOPT_H

#include <stddef.h>
#include <stdint.h>

#include "zopt/abi.h"

#ifdef __cplusplus
extern "C" {
#endif

#define ZOPT_API_VERSION 3u

/* Symbol visibility: the library is built with hidden visibility; only the
 * functions declared here are exported. */
#if defined(__GNUC__) || defined(__clang__)
#define ZOPT_API __attribute__((visibility("default")))
#else
#define ZOPT_API
#endif

typedef enum zopt_status {
  ZOPT_OK = 0,
  ZOPT_ERR_INVALID_ARGUMENT = 1, /* null pointer, bad size/dtype/id/value */
  ZOPT_ERR_IO = 2,               /* file cannot be opened/read/written */
  ZOPT_ERR_ABI = 3,              /* step.so foreign, truncated, mismatched */
  ZOPT_ERR_BAD_STATE = 4,        /* call out of order (step before finalize) */
  ZOPT_ERR_CHECKPOINT = 5,       /* corrupt or mismatched checkpoint */
  ZOPT_ERR_OUT_OF_MEMORY = 6,
  ZOPT_ERR_UNSUPPORTED = 7,      /* e.g. a GPU-placed state without CUDA */
  ZOPT_ERR_INTERNAL = 8,
  ZOPT_ERR_COMM = 9,             /* a collective failed: a rank disagreed,
                                    died or timed out (zopt/comm.h); the
                                    job cannot continue */
} zopt_status;

typedef struct zopt_step zopt_step;
typedef struct zopt_optimizer zopt_optimizer;
typedef struct zopt_comm zopt_comm; /* zopt/comm.h */

/* Message of the last failed call on this thread ("" if none). */
ZOPT_API const char *zopt_last_error(void);
/* ZOPT_API_VERSION the library was built with; ZOPT_ABI_VERSION it reads. */
ZOPT_API uint32_t zopt_api_version(void);
ZOPT_API uint32_t zopt_abi_version(void);

/* ---- compiled steps ---------------------------------------------------- */

/* Loads a step.so, validates its descriptor (magic, ABI version, size,
 * checksum, field ranges) and resolves every kernel it names. */
ZOPT_API zopt_status zopt_step_load(const char *path, zopt_step **out);
ZOPT_API void zopt_step_free(zopt_step *step);
/* The validated descriptor (owned by the step). */
ZOPT_API const zopt_step_descriptor *zopt_step_get_descriptor(const zopt_step *step);
/* ISA of the UPDATE kernel picked for this CPU. The environment variable
 * ZOPT_CPU=avx512bf16|avx512|avx2 caps it (the best variant at or below it
 * is used; asking for an ISA the CPU lacks is an error at load). zopt-compile
 * emits no baseline (pre-AVX2) variants: the kernels need x86-64-v3 (AVX2,
 * FMA, F16C), so ZOPT_CPU=none makes every load of a CPU step fail with
 * ZOPT_ERR_UNSUPPORTED ("no UPDATE kernel variant runs ..."). Every variant
 * computes the same bits. ZOPT_ISA_NONE for a step whose update runs on the
 * GPU. */
ZOPT_API zopt_isa zopt_step_isa(const zopt_step *step);

/* ---- optimizer --------------------------------------------------------- */

ZOPT_API zopt_status zopt_optimizer_create(const zopt_step *step, zopt_optimizer **out);
/* Frees the optimizer; waits for a call running on it on another thread
 * (and, with buckets in flight, for the one being reduced) first. */
ZOPT_API void zopt_optimizer_free(zopt_optimizer *opt);

/* Threads used by step() (default: $ZOPT_NUM_THREADS, else the hardware
 * concurrency); 1..4096, any time. Results do not depend on it: the norm's
 * partial sums are added in a fixed order. */
ZOPT_API zopt_status zopt_optimizer_set_num_threads(zopt_optimizer *opt, int n);

/* Adds a parameter group whose hyperparameters start at the descriptor's
 * defaults; returns its id (0, 1, ...). Only before finalize (after it:
 * zopt_optimizer_add_tensors' new_groups). */
ZOPT_API zopt_status zopt_optimizer_add_group(zopt_optimizer *opt, int *group_id);
/* Sets/gets one hyperparameter of a group by name ("lr", "beta1", "beta2",
 * "eps", "weight_decay", "momentum", "dampening", "bias_correction").
 * Any time; the name must be a slot of the step; the value is range-checked
 * (lr >= 0, 0 <= beta < 1, eps > 0, ...). */
ZOPT_API zopt_status zopt_optimizer_set_hyper(zopt_optimizer *opt, int group,
                                     const char *name, double value);
ZOPT_API zopt_status zopt_optimizer_get_hyper(const zopt_optimizer *opt, int group,
                                     const char *name, double *value);

/* Per-group flags (ZOPT_GROUP_* bits; 0 for a new group). Any time, like a
 * hyperparameter: the next step uses them (GPU steps: written to the
 * device's table, ordered after the steps already enqueued; refused while
 * the stream captures a graph). Unknown bits are INVALID_ARGUMENT.
 * ZOPT_GROUP_MAXIMIZE: torch.optim's `maximize=True`: the group's gradient
 * is negated where it is read (the gradient scale of its coefficient rows
 * is -1/(S*D)), so weight decay and every rule see -g as torch does; the
 * global norm and the non-finite check do not change. */
#define ZOPT_GROUP_MAXIMIZE 1u
ZOPT_API zopt_status zopt_optimizer_set_group_flags(zopt_optimizer *opt, int group,
                                           uint32_t flags);
ZOPT_API zopt_status zopt_optimizer_get_group_flags(const zopt_optimizer *opt, int group,
                                           uint32_t *flags);

/* Tensor ids count 0, 1, ... over all groups in the order of the calls.
 * Registers a tensor: the user's param and grad memory (host pointers for
 * CPU-placed param/grad, device pointers for GPU-placed ones), its element
 * count and dtype (must equal the descriptor's param dtype). The memory
 * must stay valid. Only before finalize (after it: zopt_optimizer_add_tensors,
 * below). A param pointer registered twice
 * is an error. An empty tensor (numel 0) may pass NULL pointers. */
ZOPT_API zopt_status zopt_optimizer_add_tensor(zopt_optimizer *opt, int group,
                                      void *param, void *grad, int64_t numel,
                                      zopt_dtype dtype, int *tensor_id);

/* Several tensors at once, and `new_groups` groups first (ids after the
 * existing ones, hyperparameters at the descriptor's defaults): tensor i
 * goes into groups[i] with params[i], grads[i] (NULL arrays: none, with
 * gradient streaming), numels[i] elements of `dtype`; their ids are
 * *first_tensor, *first_tensor + 1, ... (first_tensor and first_group may
 * be NULL). Every entry is checked as add_tensor checks it before any is
 * added: a refused call changes nothing.
 * Before finalize it is n add_tensor calls. After finalize (CPU-updated
 * steps: all-CPU and offloaded; GPU steps: ZOPT_ERR_UNSUPPORTED) the
 * layout is rebuilt with every tensor: the existing tensors keep every
 * state element, step count and their memory; the new ones start as at
 * finalize (master from the param, moments zero, step count 0); the
 * result is bit-identical to an optimizer built with all the tensors into
 * which the old ones' states were loaded. With several ranks it is
 * collective (every rank adds the same groups and tensors, the same
 * param values; checked) and the sharded states are re-sharded (an
 * all-gather of each). Memory: the old and the new states side by side
 * until it returns. A failure leaves the optimizer as it was (a
 * collective's failure leaves the communicator unusable, as in a step).
 * Not while a step is begun or buckets are in flight, nor, with gradient
 * streaming, once a bucket was reduced for the next step. */
ZOPT_API zopt_status zopt_optimizer_add_tensors(zopt_optimizer *opt, int new_groups, int n, const int *groups,
                                                void *const *params, void *const *grads, const int64_t *numels,
                                                zopt_dtype dtype, int *first_group, int *first_tensor);

/* Allocates master and optimizer states (flat, aligned, per group),
 * initializes them (master from the params, moments zero). Needs at least
 * one tensor. */
ZOPT_API zopt_status zopt_optimizer_finalize(zopt_optimizer *opt);

/* ---- loss scaling (steps compiled with loss scaling) ------------------ */

typedef struct zopt_loss_scaler_config {
  double init_scale;      /* default 65536 */
  double growth_factor;   /* default 2 */
  double backoff_factor;  /* default 0.5 */
  int64_t growth_interval; /* default 2000 good steps */
  double min_scale;       /* default 1 */
  int dynamic;            /* 0: static scale, 1: dynamic (default) */
} zopt_loss_scaler_config;

ZOPT_API zopt_status zopt_optimizer_configure_loss_scaler(
    zopt_optimizer *opt, const zopt_loss_scaler_config *config);
/* configure_loss_scaler may be called any time; it (re)starts the scaler at
 * init_scale. Semantics: PyTorch GradScaler / DeepSpeed DynamicLossScaler.
 * For a step compiled without loss scaling the scaler has no effect and
 * get_loss_scale reports 1.
 * The scale S the gradients for the next step must be multiplied by. */
ZOPT_API zopt_status zopt_optimizer_get_loss_scale(const zopt_optimizer *opt,
                                          double *scale);

/* ---- the step ---------------------------------------------------------- */

typedef struct zopt_step_result {
  double grad_norm;  /* global norm of the unscaled grads; NaN if the step
                        has no reduction (no clipping, no loss scaling) */
  int skipped;       /* 1 if non-finite grads skipped the step */
  double loss_scale; /* scale used for this step (1 without scaling) */
} zopt_step_result;

/* One optimizer step over every tensor of every group. On a skipped step no
 * state changes (bit-identical), the group step counts do not advance. A
 * CPU or offloaded step where no tensor is active on any rank changes no
 * state either (the loss scaler's good steps do not advance; a linked step:
 * on no part). `result` may be NULL. */
ZOPT_API zopt_status zopt_optimizer_step(zopt_optimizer *opt, zopt_step_result *result);

/* Several optimizers stepped as one (one optimizer per parameter class, e.g.
 * bf16 weights and f32 norms, each from its own step.so): one global norm
 * over every part's gradients, one clip coefficient, one skip decision and
 * one loss-scaler update. The parts run their steps' programs up to the
 * norm in order (parts[0] first), the norm is sqrt of the parts' sums of
 * squares added in part order (each the canonical, rank-count independent
 * sum), and then the rest of each program in order. The parts must be
 * distinct, finalized, on the same world (same rank and size), and agree
 * on clipping (max_norm) and loss scaling (configuration, scale and
 * good-step count); otherwise ZOPT_ERR_INVALID_ARGUMENT naming the part,
 * before anything runs. A part may be all-CPU, offloaded or a GPU step: a
 * GPU part's sum of squares comes to the host (a copy and a wait on its
 * stream) and the shared decision goes back to its kernels, so with n > 1
 * a GPU part whose stream is capturing a CUDA graph is refused
 * (ZOPT_ERR_BAD_STATE) before anything runs. `result` (may be NULL) gets
 * the combined norm (also when parts[0] is a GPU step). n = 1 is
 * zopt_optimizer_step. A failure before the update leaves every part's
 * state as it was. */
ZOPT_API zopt_status zopt_optimizer_step_linked(zopt_optimizer *const *parts, int n, zopt_step_result *result);

/* A step in two halves (API 2, additions): zopt_optimizer_step_begin runs
 * the first half of the next step now - the ranks' agreement, the gradient
 * reduction and the global norm (collective, as the step) - and returns
 * that norm (result->grad_norm: the norm the step clips by, over all ranks;
 * NaN for a step without a norm; result->skipped: it is not finite). The
 * next zopt_optimizer_step finishes the step with it (clipping with the
 * max_norm set before the begin). In between every other call on the
 * optimizer but zopt_optimizer_get_max_norm and zopt_optimizer_free fails
 * with ZOPT_ERR_BAD_STATE. CPU-updated steps (GPU steps: UNSUPPORTED). The
 * _linked_ form begins a linked step over the same parts (the combined
 * norm; GPU parts too), finished by zopt_optimizer_step_linked with the same parts. A
 * failed begin is a failed step. */
ZOPT_API zopt_status zopt_optimizer_step_begin(zopt_optimizer *opt, zopt_step_result *result);
ZOPT_API zopt_status zopt_optimizer_step_linked_begin(zopt_optimizer *const *parts, int n,
                                                      zopt_step_result *result);

/* The max_norm of global-norm clipping for the following steps (steps
 * compiled with clipping; the compiled value until set; every backend: a
 * GPU step's kernels read it from the device, where it is written at once
 * on the optimizer's stream; refused with BAD_STATE while that stream
 * captures a CUDA graph, as set_hyper). Finite and > 0. Every rank must use
 * the same value (checked at each step). */
ZOPT_API zopt_status zopt_optimizer_set_max_norm(zopt_optimizer *opt, double max_norm);
ZOPT_API zopt_status zopt_optimizer_get_max_norm(const zopt_optimizer *opt, double *max_norm);

/* ---- gradient streaming (ZeRO-2/3 gradient memory) ---------------------
 *
 * By default a step reads every tensor's whole gradient from its registered
 * memory, so every rank holds the full gradients until the step. With
 * streaming on (before finalize; CPU-updated, non-offloaded ZeRO-2 or
 * ZeRO-3 steps: finalize refuses other programs), each rank holds only its
 * reduced gradient shards, runtime-owned, and the caller hands the
 * gradients over bucket by bucket as backward produces them:
 *
 *   zopt_optimizer_num_buckets(o, &nb);            // after finalize
 *   zopt_optimizer_bucket_tensors(o, b, ids, cap, &n);  // the tensors of
 *                                        // bucket b (a tensor may span
 *                                        // several buckets)
 *   zopt_optimizer_reduce_bucket(o, b, grads, n);  // a collective: every
 *                                        // rank, the same bucket, in the
 *                                        // same order
 *   ... then zopt_optimizer_step(o, &r);
 *
 * grads[i] is element 0 of the whole gradient of tensor ids[i] (the param's
 * the step's grad dtype), or NULL where this rank has no gradient
 * for it; after reduce_bucket returns, that memory is no longer read (free
 * or reuse it), so at most a bucket of gradients beyond the shards needs to
 * be alive. Every bucket must be reduced once between two steps, in any
 * order the ranks agree on (the checked collective signature names the
 * bucket; step fails with ZOPT_ERR_BAD_STATE, changing nothing, naming a
 * bucket that was not reduced; a second reduce of one bucket is an error).
 * The tensors given a gradient (non-NULL) on any rank are the ones the step
 * updates (the gradients say it: zopt_optimizer_set_active is read only for
 * the tensors without elements, in no bucket, active unless it says so); a
 * tensor spanning buckets is given in all of them or in none. The result
 * is bit-identical to the non-streamed step (the same rank-order f32 fold).
 * Gradient accumulation stays the caller's (accumulate micro-batches into
 * the gradients, stream the last one, like DDP's no_sync). With streaming,
 * add_tensor accepts grad = NULL. */
ZOPT_API zopt_status zopt_optimizer_set_grad_streaming(zopt_optimizer *opt, int on);
ZOPT_API zopt_status zopt_optimizer_num_buckets(const zopt_optimizer *opt, int *num_buckets);
ZOPT_API zopt_status zopt_optimizer_bucket_tensors(const zopt_optimizer *opt, int bucket, int *tensors,
                                                   int capacity, int *count);
ZOPT_API zopt_status zopt_optimizer_reduce_bucket(zopt_optimizer *opt, int bucket, const void *const *grads,
                                                  int count);

/* The same, in the background, so that the exchange overlaps the rest of
 * backward: the checks above run at the call (their errors are returned at
 * once), the reduction runs on the optimizer's own thread, one bucket at a
 * time in the order of the calls (the order every rank must use). The
 * gradients are read until zopt_optimizer_bucket_done says 1 for the bucket
 * (then free or reuse them). zopt_optimizer_wait_buckets waits for every
 * handed-over bucket and returns the first failure of one (the buckets
 * after a failed one are not reduced; hand them over again after fixing
 * the cause); zopt_optimizer_step waits first as well. While buckets are in
 * flight every other call on the optimizer but num_buckets,
 * bucket_tensors, reduce_bucket_async, bucket_done, wait_buckets and
 * step(_linked) fails with ZOPT_ERR_BAD_STATE. With MPI, the communicator
 * is used from that thread: MPI_THREAD_SERIALIZED or more (the MPI
 * communicator asks for it when it initializes MPI; MPI_THREAD_MULTIPLE if
 * the program calls MPI itself during backward). */
ZOPT_API zopt_status zopt_optimizer_reduce_bucket_async(zopt_optimizer *opt, int bucket,
                                                        const void *const *grads, int count);
ZOPT_API zopt_status zopt_optimizer_bucket_done(const zopt_optimizer *opt, int bucket, int *done);
ZOPT_API zopt_status zopt_optimizer_wait_buckets(zopt_optimizer *opt);

/* ---- offloaded steps: bucket readiness and speculation ------------------
 *
 * docs/GPU.md "Bucket readiness and speculation". For an offloaded step
 * (params and grads on the GPU, optimizer states and the update on the
 * CPU), at 1 rank or at W ranks with ZeRO-2 (every rank marks in the same
 * order: each bucket's job reduces it across ranks): the caller marks each
 * gradient bucket ready as soon as
 * its grads are final (zopt_optimizer_num_buckets / _bucket_tensors name
 * the buckets and their tensors; they are the layout's buckets, as for
 * gradient streaming). The call queues on the optimizer's stream an
 * asynchronous copy of the bucket's grads (and params, for a step without
 * a master) into the pinned staging and an event, and on the optimizer's
 * thread the bucket's CPU work once the event completes: its norm partials
 * and, within the speculation budget, its update written out of place with
 * the coefficients of "no clipping, no skip". zopt_optimizer_step then
 * needs every bucket marked (ZOPT_ERR_BAD_STATE naming those that are not,
 * changing nothing), folds the norm in the serial order, runs the step's
 * control and, per bucket, commits the speculation (its coefficient rows
 * are the step's, bit for bit), recomputes it in place from the untouched
 * states (clipping active), or discards it (a skipped step); buckets
 * beyond the budget update then. The result is bit-identical to the serial
 * step. A bucket marked twice, an index out of range, a capturing stream
 * are errors, changing nothing. Between the first mark and the step every
 * call that changes the optimizer is refused (ZOPT_ERR_BAD_STATE) but
 * zopt_optimizer_set_grad_memory for tensors none of whose buckets is
 * marked yet (a mark queues the copy from the grads' memory registered
 * then: register a bucket's fresh gradients just before marking it; a
 * tensor of a marked bucket is refused, changing nothing). Without
 * marks, zopt_optimizer_step runs serially as before.
 *
 * The budget caps the speculation buffers in bytes: per bucket, every state
 * the update writes over the bucket (e.g. 14 bytes/param for bf16 params
 * with f32 master and moments, 8 for the 6-byte cell: bf16 param, master
 * and moments). Default:
 * every bucket (that many bytes/param of host memory, allocated at the
 * first mark); 0: no speculation (the CPU work at readiness is the norm
 * only); otherwise at least the largest bucket's (ZOPT_ERR_INVALID_ARGUMENT). */
ZOPT_API zopt_status zopt_optimizer_grad_bucket_ready(zopt_optimizer *opt, int bucket);
ZOPT_API zopt_status zopt_optimizer_set_speculation_budget(zopt_optimizer *opt, uint64_t bytes);

enum { ZOPT_SPEC_NONE = 0, ZOPT_SPEC_COMMIT = 1, ZOPT_SPEC_RECOMPUTE = 2, ZOPT_SPEC_DISCARD = 3 };
/* The last pipelined step's (steps: how many there were; 0: none yet,
 * every figure 0). `size`: set it to sizeof(zopt_pipeline_stats) before the
 * call; the runtime fills min(size, its own) bytes (later fields are
 * added at the end). outcome: COMMIT (every speculated bucket committed),
 * RECOMPUTE (some recomputed: clipping active), DISCARD (skipped).
 * overlapped_seconds: the buckets' CPU work on the optimizer's thread
 * (norm partials, speculative updates); exposed_seconds: from the last
 * bucket's readiness to the end of the step (per-bucket mode: to the
 * return of zopt_optimizer_step, before its tail). */
typedef struct zopt_pipeline_stats {
  uint32_t size;
  int32_t outcome;
  int32_t buckets;
  int32_t speculated;
  int32_t committed;
  int32_t recomputed;
  int32_t late; /* beyond the budget: updated after validation */
  int32_t reserved;
  int64_t steps;
  double overlapped_seconds;
  double exposed_seconds;
  /* Added later (a caller's smaller size gets the fields above only): */
  int32_t copies_in_flight; /* buckets whose copies from the GPU were still
                               running at the last mark (end of backward) */
  int32_t reserved2;
} zopt_pipeline_stats;
ZOPT_API zopt_status zopt_optimizer_get_pipeline_stats(const zopt_optimizer *opt, zopt_pipeline_stats *stats);

/* ---- offloaded steps: the params back on the GPU, bucket by bucket -------
 *
 * docs/GPU.md "Params back early". At 1 rank an offloaded step (serial or
 * pipelined) copies the updated params back on a copy stream of the
 * optimizer's own, bucket by bucket in forward order (the last bucket
 * first: buckets are in reverse add order), each bucket followed by its
 * own event; the copies are ordered after the caller's work enqueued on the
 * optimizer's stream before the step (they overwrite params it may read).
 *
 * ZOPT_PARAM_WAIT_ALL (the default): the step makes the optimizer's stream
 * wait for every bucket's copy, so later work on it sees every param, as
 * before. ZOPT_PARAM_WAIT_PER_BUCKET: it does not; the caller must call
 * zopt_optimizer_wait_params(o, b, stream) before work on `stream` uses a
 * param of bucket b (zopt_optimizer_bucket_tensors names them): a
 * cuStreamWaitEvent of that bucket's event (stream NULL: the optimizer's
 * stream; a capturing stream gets an external event wait node, so each
 * replay waits for the copies of the last step before its launch).
 * Whatever the mode, the runtime's own later work (the next step's copies
 * or marks, read_state of a param, save, free, set_stream) waits for every
 * copy. set_param_wait is refused (ZOPT_ERR_BAD_STATE) between a step's
 * first mark and the step; ZOPT_ERR_UNSUPPORTED for steps that are not
 * offloaded. At W ranks the params go back after the ALL_GATHER on the
 * optimizer's stream, as before, whatever the mode (wait_params then waits
 * for all of them). wait_params before any step, or for a bucket whose
 * extent changed since the last copies, waits for every copy (or nothing
 * when none was made). A bucket out of range: ZOPT_ERR_INVALID_ARGUMENT.
 * get_param_wait: the mode (ZOPT_PARAM_WAIT_ALL for a step that is not
 * offloaded).
 * Per-bucket mode, a pipelined step at 1 rank: zopt_optimizer_step returns
 * once the outcome is decided (result, skip, loss scale, counts final) and
 * leaves each bucket's commit or recompute and its copy back (its tail) to
 * the optimizer's pipeline thread, in forward order; wait_params(o, b, s)
 * first blocks the host until bucket b's copy is issued; every other call
 * first waits for the whole tail, and returns ZOPT_ERR_INTERNAL naming the
 * bucket if a part of it failed (the copy issued once more; the call after
 * it works). */
#define ZOPT_PARAM_WAIT_ALL 0
#define ZOPT_PARAM_WAIT_PER_BUCKET 1
ZOPT_API zopt_status zopt_optimizer_set_param_wait(zopt_optimizer *opt, int mode);
ZOPT_API zopt_status zopt_optimizer_get_param_wait(const zopt_optimizer *opt, int *mode);
ZOPT_API zopt_status zopt_optimizer_wait_params(zopt_optimizer *opt, int bucket, void *cu_stream);

/* ---- GPU steps (docs/GPU.md) ------------------------------------------ */

/* A step compiled with GPU-placed states runs through the CUDA driver API,
 * loaded at run time (libcuda.so.1; without it zopt_optimizer_create fails
 * with ZOPT_ERR_UNSUPPORTED "no CUDA driver ..."; a driver older than the
 * toolkit that built the step, e.g. a CUDA 12 driver for a step built by
 * CUDA 13, is refused at create with both versions in the message). The
 * optimizer uses the context current on the calling thread at create (e.g.
 * PyTorch's for the current device), else device 0's primary context; every
 * call makes it current for its duration only and restores the caller's.
 * Param and grad are device pointers of that context's device (checked at
 * add_tensor: a tensor on another device is an error naming it); they need
 * only be aligned to their element size (views into flat buffers take a
 * scalar head and tail around 16-byte vector accesses). The optimizer owns
 * its state buffers in device memory (cuMemAlloc, or the caller's
 * allocator: zopt_optimizer_set_device_allocator).
 *
 * The step's running state lives on the device: the per-group step counts
 * and, with loss scaling, the dynamic loss scaler are advanced by the FINISH
 * kernel, and a step whose global norm is non-finite is skipped on the
 * device (with clipping or loss scaling, as on the CPU). So
 * zopt_optimizer_step only enqueues, on the optimizer's stream, PREPARE,
 * SUMSQ (clipping / loss scaling), UPDATE and FINISH, and records an event:
 * no allocation, no copy, no host synchronisation, so the step can be
 * captured in a CUDA graph and the graph replayed on any stream. Its result
 * reports grad_norm = NaN, skipped = 0, loss_scale = NaN: the outcome is on
 * the device.
 *
 * Every call that reads or writes the device's state (gpu_result,
 * get_step_count, get_loss_scale, get_tensor_step, configure_loss_scaler,
 * set_grad_divisor, read/write_state_*, save, load) runs its copies on the
 * optimizer's stream after the optimizer's last step, wherever that ran
 * (also a graph replay on another stream: the step's event is recorded by
 * every replay), then waits for them; during a capture they fail
 * (ZOPT_ERR_BAD_STATE). set_hyper writes the changed value into the
 * device's hyperparameter table at once, on the optimizer's stream, ordered
 * after the steps already enqueued (any stream) and before the next ones
 * (a captured step waits for the latest write when replayed): replays of a
 * captured step use the value set before each replay. set_hyper fails
 * (ZOPT_ERR_BAD_STATE) while the optimizer's stream is capturing: set
 * hyperparameters outside captures. The seed of stochastic rounding is
 * passed by value: a captured step keeps the seed it had at capture. */

/* Offloaded steps (param and grad `on gpu`, every optimizer state on the
 * CPU: ZeRO-Offload) run their CPU kernels between copies on the stream:
 * grads (and params, when the update reads them) from the GPU with one
 * synchronisation before, new params back to the GPU (asynchronous) after,
 * unless the step was skipped. The result is complete when step returns.
 * PARAM/GRAD state access addresses the device memory (synchronous copies).
 * An offloaded step needs the host in the middle of the step, so it cannot
 * be captured in a CUDA graph: step fails (ZOPT_ERR_UNSUPPORTED, saying
 * so) when the stream is capturing.
 *
 * The CUstream (a CUstream or cudaStream_t handle) steps and state copies
 * are enqueued on; NULL (the default) is the legacy default stream. A new
 * stream is ordered after the optimizer's work on the previous one (its
 * events: the previous stream may be destroyed afterwards). Pass the
 * stream of the calling code before each step and each read (PyTorch:
 * torch.cuda.current_stream()). Only for GPU and offloaded steps
 * (ZOPT_ERR_BAD_STATE otherwise). */
ZOPT_API zopt_status zopt_optimizer_set_stream(zopt_optimizer *opt, void *cu_stream);
/* Waits for the last step (wherever it ran, see above) and reads its
 * device-side result: grad_norm (NaN without a norm reduction), skipped
 * (non-finite norm), and the loss scale that step used (1 without loss
 * scaling). ZOPT_ERR_BAD_STATE before the first step. */
ZOPT_API zopt_status zopt_optimizer_gpu_result(zopt_optimizer *opt, zopt_step_result *result);

/* Device memory through the caller (GPU steps): every buffer the optimizer
 * allocates at finalize (its states, tables and scratch) comes from
 * alloc(user, bytes, cu_stream) instead of cuMemAlloc, and goes back
 * through free(user, ptr, bytes, cu_stream) at zopt_optimizer_free, after
 * the optimizer's work on it finished (cu_stream: the optimizer's stream
 * at finalize). alloc returns device memory of the optimizer's device,
 * aligned to at least 256 bytes, or NULL (finalize then fails with
 * ZOPT_ERR_OUT_OF_MEMORY). The PyTorch binding passes torch's caching
 * allocator (torch.cuda.caching_allocator_alloc / _delete), so that the
 * optimizer's memory and PyTorch's cached blocks are one pool. Before
 * finalize; NULL restores cuMemAlloc. */
typedef struct zopt_device_allocator {
  void *(*alloc)(void *user, size_t bytes, void *cu_stream);
  void (*free)(void *user, void *ptr, size_t bytes, void *cu_stream);
  void *user;
} zopt_device_allocator;
ZOPT_API zopt_status zopt_optimizer_set_device_allocator(zopt_optimizer *opt,
                                                         const zopt_device_allocator *allocator);

/* The seed of stochastic rounding (steps with a bf16 state declared
 * `rounding stochastic`; abi.h "Stochastic rounding"): the random bits of
 * an element depend on (seed, the group's step, tensor, element, state)
 * only, so a run is reproducible on any thread count, and CPU and GPU steps
 * draw the same bits. Default 0. Not part of checkpoints: to resume
 * bit-exactly, set the same seed again. A GPU step captured in a CUDA graph
 * keeps the seed it had at capture (the step counts advance on the device,
 * so the bits still change from replay to replay). */
ZOPT_API zopt_status zopt_optimizer_set_seed(zopt_optimizer *opt, uint64_t seed);
ZOPT_API zopt_status zopt_optimizer_get_seed(const zopt_optimizer *opt, uint64_t *seed);

/* Per group: the steps in which any of the group's tensors was updated (0
 * before the first). */
ZOPT_API zopt_status zopt_optimizer_get_step_count(const zopt_optimizer *opt,
                                          int group, int64_t *count);

/* ---- state access ------------------------------------------------------ */

/* PARAM and GRAD address the user's memory (allowed before finalize); the
 * other kinds exist after finalize (ZOPT_ERR_BAD_STATE before).
 * Copies state `kind` of tensor `tensor` as float32 (canonical form,
 * whatever the storage dtype); `numel` must equal the tensor's. */
ZOPT_API zopt_status zopt_optimizer_read_state_f32(const zopt_optimizer *opt,
                                          int tensor, zopt_state_kind kind,
                                          float *out, int64_t numel);
/* Writes a state from float32, rounding to its storage dtype (nearest even). */
ZOPT_API zopt_status zopt_optimizer_write_state_f32(zopt_optimizer *opt, int tensor,
                                           zopt_state_kind kind,
                                           const float *in, int64_t numel);
/* Remainder masters (abi.h "Remainder masters", the definition): n f32
 * masters from their bf16 params' bit patterns and int16 remainders, and n
 * f32 masters split into the two. For bindings that move a remainder
 * master in another layout (torch's state_dict). Any n >= 0; NULL arrays
 * with n > 0 give ZOPT_ERR_INVALID_ARGUMENT. */
ZOPT_API zopt_status zopt_remainder_join_n(const uint16_t *param, const int16_t *rem, float *master,
                                           int64_t n);
ZOPT_API zopt_status zopt_remainder_split_n(const float *master, uint16_t *param, int16_t *rem,
                                            int64_t n);
/* Storage-exact copies: `bytes` must equal numel * sizeof(storage dtype). */
ZOPT_API zopt_status zopt_optimizer_read_state_raw(const zopt_optimizer *opt,
                                          int tensor, zopt_state_kind kind,
                                          void *out, size_t bytes);
ZOPT_API zopt_status zopt_optimizer_write_state_raw(zopt_optimizer *opt, int tensor,
                                           zopt_state_kind kind,
                                           const void *in, size_t bytes);

/* ---- checkpoints (docs/CHECKPOINT.md) ---------------------------------- */

/* Both need a finalized optimizer; with several ranks both are collective
 * (every rank passes the same path). A checkpoint holds the runtime-owned
 * states (not PARAM/GRAD, which belong to the model's checkpoint), the step
 * counts (per group and per tensor), the hyperparameters and group flags,
 * the loss-scaler state and the stochastic-rounding seed; load restores all
 * of them. A save has an identity (random, agreed by the ranks) written
 * into every file: rank r of W writes the elements it holds to
 * `path.<r>-of-<W>.<identity>`, fsync'd; when every rank succeeded, rank
 * 0's rename of its file to `path` commits the set, and the files of older
 * sets are removed. A failure at any point leaves a whole set at `path`
 * and the same error on every rank (docs/CHECKPOINT.md "Saving"). Load
 * reads the files rank 0's file names and refuses files of another save. */
ZOPT_API zopt_status zopt_optimizer_save(const zopt_optimizer *opt, const char *path);
/* Validates everything before changing anything: on any error the current
 * state is untouched (on every rank: the ranks agree before applying).
 * States saved in another dtype, placement or world size are converted
 * (a checkpoint saved at W ranks loads at any W). A checkpoint of another
 * update rule (optimizer states the step lacks, or lacks states the step
 * has: e.g. AdamW's moments into SGD) is refused unless `flags` has
 * ZOPT_LOAD_ALLOW_RULE_CHANGE: then missing states start at zero (a
 * missing master from the params) and extra ones are dropped. */
#define ZOPT_LOAD_ALLOW_RULE_CHANGE 1u
/* ZOPT_LOAD_VALIDATE_ONLY: every check of a load (on every rank), nothing
 * applied: a later load of the same files applies them. Lets a caller that
 * loads several optimizers (linked parameter classes) check all of them
 * before changing any. */
#define ZOPT_LOAD_VALIDATE_ONLY 2u
ZOPT_API zopt_status zopt_optimizer_load_ex(zopt_optimizer *opt, const char *path, uint32_t flags);
/* zopt_optimizer_load_ex(opt, path, 0). */
ZOPT_API zopt_status zopt_optimizer_load(zopt_optimizer *opt, const char *path);

/* The checkpoint of an optimizer of several parts (one optimizer per
 * parameter class, as zopt_optimizer_step_linked takes them): ONE save
 * (collective; one identity, agreed with the check that every rank passed
 * the same paths) writes part i to paths[i] (its rank files beside it, as
 * zopt_optimizer_save's), and ONE rename - rank 0's of part 0's file to
 * paths[0] - commits all of them: a save that fails or dies at any point
 * leaves the previous checkpoint of every part, or this one (its files
 * flagged `linked`, docs/CHECKPOINT.md "Linked saves"). The parts must be
 * distinct, finalized and idle, of the same world and rank, the paths
 * distinct and non-empty (else ZOPT_ERR_INVALID_ARGUMENT or _BAD_STATE
 * naming the part, nothing written). n = 1 is zopt_optimizer_save. */
ZOPT_API zopt_status zopt_optimizer_save_linked(zopt_optimizer *const *parts, int n, const char *const *paths);
/* Loads the parts of one linked save (load_ex's flags and checks, every
 * part staged before any changes, on every rank): part 0's set at
 * paths[0] names the save; a part whose file at paths[i] belongs to
 * another save (and whose file of this save is not beside it: a save that
 * died after its commit) is refused with ZOPT_ERR_CHECKPOINT naming the
 * part, its path and both identities, nothing changed on any part. A part
 * 0 saved by zopt_optimizer_save (an older checkpoint): every part loads
 * the file at its path, unchecked against the others (but all or
 * nothing). */
ZOPT_API zopt_status zopt_optimizer_load_linked(zopt_optimizer *const *parts, int n, const char *const *paths,
                                                uint32_t flags);

/* ---- the state in memory (docs/CHECKPOINT.md "In memory") --------------
 *
 * The same state as a checkpoint, as the bytes of the checkpoint format
 * (the writer and the reader of the files), without a file: e.g. a
 * binding's state_dict, or a state sent elsewhere. Both need a finalized
 * optimizer; with several ranks both are collective.
 *
 * zopt_optimizer_export_state: *buf (free it with zopt_state_buffer_free)
 * and *size get an image of the state. flags 0: the elements this rank
 * holds, exactly the bytes zopt_optimizer_save writes into this rank's
 * file (world W, rank r, a save identity the ranks agree on): the W
 * ranks' buffers are one set, as the files of one save.
 * ZOPT_EXPORT_WHOLE: every element of every state, on every rank (the
 * sharded states are gathered; every rank gets the same image, world size
 * 1 and rank 0, as a one-rank save): what a caller that needs whole
 * tensors (torch's state_dict) reads. A failure on one rank fails every
 * rank's export, the same error.
 * ZOPT_EXPORT_NO_CHECKSUMS (with either): the pieces' checksums are left
 * out (0; the header's flags say so, its own checksum stays): the copy
 * without hashing every byte, for a reader in the same process (a
 * binding's state_dict). Such an image imports from memory only; a file
 * holding it is refused by load. */
#define ZOPT_EXPORT_WHOLE 1u
#define ZOPT_EXPORT_NO_CHECKSUMS 2u
ZOPT_API zopt_status zopt_optimizer_export_state(const zopt_optimizer *opt, void **buf, size_t *size,
                                                 uint32_t flags);
ZOPT_API void zopt_state_buffer_free(void *buf);
/* Loads an image exported (or a checkpoint file read into memory) with
 * load's semantics and flags (ZOPT_LOAD_ALLOW_RULE_CHANGE,
 * ZOPT_LOAD_VALIDATE_ONLY): everything is checked on every rank before
 * anything changes, a refused import changes nothing anywhere, and a
 * corrupt or truncated buffer is ZOPT_ERR_CHECKPOINT as a corrupt file is.
 * A whole image (world size 1) loads at any world size: each rank passes
 * it and keeps what it holds. The _set form takes n images of one export
 * at W ranks (any order, each rank's at most once): each rank passes
 * images holding every element it holds: the whole set always does (any
 * world size, bucket size or dtype, as a set of files); its own image
 * alone does when it loads into the world size, bucket size and tensors
 * that exported it and every saved state is sharded (ZeRO-1/2/3's, not
 * ZeRO-0's, which every rank holds whole). The buffers are read during the
 * call only. */
ZOPT_API zopt_status zopt_optimizer_import_state(zopt_optimizer *opt, const void *buf, size_t size, uint32_t flags);
ZOPT_API zopt_status zopt_optimizer_import_state_set(zopt_optimizer *opt, int n, const void *const *bufs,
                                                     const size_t *sizes, uint32_t flags);

/* A staged import (e.g. torch's load_state_dict in one transaction): the
 * whole state given piece by piece and applied at once. begin starts from
 * an empty state: every (tensor, state) not put starts as at finalize
 * (moments zero; a master from the params, or from the PARAM put into this
 * import under ZeRO-3; ZeRO-3's held params from the user's params), every
 * tensor's and group's step count at 0; the hyperparameters, group flags,
 * the loss scaler (configuration and state) and the seed start at the
 * optimizer's current values. Each call checks its arguments at once (an
 * error leaves the import as it was); nothing changes the optimizer until
 * zopt_state_import_commit, which completes the missing states, checks
 * (with several ranks, collectively: every rank imports the same step
 * counts, hyperparameters, flags, scaler and seed, each putting the same
 * whole tensors and keeping the elements it holds), then applies
 * everything, or nothing. commit (whatever it returns) and abort free the
 * import; abort must not race another call on the same import. The calls run
 * under the optimizer's call rules (zopt.h "Threading"); tensors added to
 * the optimizer after begin make commit fail (ZOPT_ERR_BAD_STATE). */
typedef struct zopt_state_import zopt_state_import;
ZOPT_API zopt_status zopt_optimizer_import_begin(zopt_optimizer *opt, zopt_state_import **out);
/* State `kind` of tensor `tensor`, numel elements of `dtype` (F32, BF16 or
 * F16: converted to the state's storage dtype, nearest even). Kinds: the
 * step's optimizer states, and PARAM where the runtime holds the params
 * (ZeRO-3). Each (tensor, kind) once. */
ZOPT_API zopt_status zopt_state_import_put(zopt_state_import *imp, int tensor, zopt_state_kind kind,
                                           zopt_dtype dtype, const void *data, int64_t numel);
ZOPT_API zopt_status zopt_state_import_set_tensor_step(zopt_state_import *imp, int tensor, int64_t steps);
ZOPT_API zopt_status zopt_state_import_set_group(zopt_state_import *imp, int group, int64_t step_count,
                                                 uint32_t flags);
ZOPT_API zopt_status zopt_state_import_set_hyper(zopt_state_import *imp, int group, const char *name,
                                                 double value);
/* `config` NULL keeps the configuration; scale and good_steps as
 * zopt_optimizer_set_loss_scaler_state. */
ZOPT_API zopt_status zopt_state_import_set_loss_scaler(zopt_state_import *imp,
                                                       const zopt_loss_scaler_config *config, double scale,
                                                       int64_t good_steps);
ZOPT_API zopt_status zopt_state_import_set_seed(zopt_state_import *imp, uint64_t seed);
ZOPT_API zopt_status zopt_state_import_commit(zopt_state_import *imp);
ZOPT_API void zopt_state_import_abort(zopt_state_import *imp);

/* ---- introspection ----------------------------------------------------- */

typedef struct zopt_memory_info {
  uint64_t bytes_cpu; /* on the CPU: the user's params and registered grads
                         (none with gradient streaming), state_bytes,
                         grad_bytes, scratch_bytes, and an offloaded step's
                         pinned param/grad staging and speculation buffers
                         (zopt_optimizer_grad_bucket_ready) */
  uint64_t bytes_gpu;
  uint64_t num_params; /* total elements */
  uint64_t state_bytes;          /* runtime-owned states this rank holds
                                    (master, moments; ZeRO-3 params) */
  uint64_t state_bytes_one_rank; /* the same for one rank holding all */
  uint64_t scratch_bytes;        /* collective buffers: at W > 1 one bucket
                                    of the collectives' dtype to receive,
                                    one to send if the step reduces, the
                                    norm partials */
  int32_t world_size, rank;      /* before finalize: the communicator's (the
                                    state figures are 0 until finalize) */
  uint64_t grad_bytes;           /* runtime-held gradient shards (gradient
                                    streaming; API version 3) */
} zopt_memory_info;
ZOPT_API zopt_status zopt_optimizer_memory_info(const zopt_optimizer *opt,
                                       zopt_memory_info *info);

/* ---- ranks (ZeRO; docs/DISTRIBUTED.md) ---------------------------------- */

/* The communicator of this rank (zopt/comm.h); before finalize. NULL (the
 * default): world size 1. It must outlive the optimizer. Every rank must
 * register the same groups and tensors in the same order, with the same
 * param values (checked at finalize, which is collective), and step with
 * the same hyperparameters, seed and loss scale (checked every step). A
 * host communicator for CPU-updated steps; GPU steps run at world size 1. */
ZOPT_API zopt_status zopt_optimizer_set_comm(zopt_optimizer *opt, zopt_comm *comm);
ZOPT_API zopt_status zopt_optimizer_get_world(const zopt_optimizer *opt, int *rank, int *world);
/* Elements per bucket of the layout: the unit of every collective and the
 * size of the collective scratch. Any size from 1 is accepted and rounded
 * up to a multiple of W norm blocks (the block is a power of two from 64 to
 * 32768 elements, picked from the model's size: docs/DISTRIBUTED.md "The
 * layout"), so that every rank's shard of a bucket is whole blocks: a rank
 * holds less than one block per group more than 1/W of every sharded
 * state. The default (0) is picked from the model's size so that the
 * scratch takes at most half of what sharding saves a rank (at most
 * 8388608; 8388608 at world size 1). Before finalize. */
ZOPT_API zopt_status zopt_optimizer_set_bucket_elems(zopt_optimizer *opt, int64_t elems);
/* The gradient divisor D: the update sees grad / (S * D) (S the loss
 * scale). 0 (the default) means the world size, so that the reduced
 * gradient is the mean over ranks, as DDP's; set W * A to also average A
 * accumulated micro-batches, 1 to sum. Any time. */
ZOPT_API zopt_status zopt_optimizer_set_grad_divisor(zopt_optimizer *opt, double divisor);
ZOPT_API zopt_status zopt_optimizer_get_grad_divisor(const zopt_optimizer *opt, double *divisor);
/* Which tensors have a gradient (active[i] = 1) for the following steps;
 * NULL: all (the default). A tensor without a gradient on every rank is
 * left alone entirely, like torch.optim skips a param whose grad is None:
 * no weight decay, no moment update, its step count does not advance, and
 * its gradient memory is not read. With several ranks a tensor active on
 * any rank is updated, the others contributing zeros. Between the marks
 * of a pipelined offloaded step (zopt_optimizer_grad_bucket_ready) the
 * mask may only drop tensors (BAD_STATE otherwise): the call first waits
 * for the bucket jobs in flight (a failed one is reported and closes the
 * pipelined step, which then runs serially); the step agrees the ranks'
 * masks again. A binding marks a bucket with zeros for a gradient this
 * rank lacks, then drops it here: the result is the serial step's. */
ZOPT_API zopt_status zopt_optimizer_set_active(zopt_optimizer *opt, const uint8_t *active, int64_t n);
/* The steps tensor `tensor` took (torch's per-param state['step']; a
 * tensor left alone by set_active does not advance). The bias corrections
 * and stochastic rounding of a tensor use its own count (GPU steps too:
 * the device holds each tensor's count). */
ZOPT_API zopt_status zopt_optimizer_get_tensor_step(const zopt_optimizer *opt, int tensor, int64_t *count);
/* Moves tensor `tensor` to new user memory after finalize (the same
 * numel and dtype; e.g. PyTorch replaced `p.data` or allocated a new
 * `.grad`): the optimizer's states stay. `grad` may be NULL for a tensor
 * this rank marks inactive (zopt_optimizer_set_active) until it gets
 * memory again; stepping an active tensor without gradient memory is an
 * error. The param's values are not read (call
 * zopt_optimizer_refresh_master to take new values into a master). Every
 * backend; GPU steps rewrite the device's pointer table on the optimizer's
 * stream, inside a CUDA graph capture by value (docs/GPU.md "Tensor
 * memory"). */
ZOPT_API zopt_status zopt_optimizer_set_tensor_memory(zopt_optimizer *opt, int tensor, void *param, void *grad);
/* Gradient memory of n tensors at once (a binding handing over the fresh
 * gradient tensors of a backward without copying them): tensors[i]'s
 * gradient is read from grads[i] from the next step on, its param memory
 * unchanged; as n calls of zopt_optimizer_set_tensor_memory, except that
 * every entry is checked before any is applied (a refused call changes
 * nothing). Every backend (GPU steps: as set_tensor_memory); on the host
 * the next step patches the moved tensors' work units in place, at a cost
 * in the number of tensors moved. Accepted between the bucket marks of a
 * pipelined offloaded step for tensors in no marked bucket
 * (zopt_optimizer_grad_bucket_ready). */
ZOPT_API zopt_status zopt_optimizer_set_grad_memory(zopt_optimizer *opt, int64_t n, const int32_t *tensors,
                                                    void *const *grads);
/* Restoring counts and the loss scaler without a checkpoint file (e.g. a
 * binding's state_dict): the steps a tensor took, a group's step count,
 * and the dynamic loss scaler's current scale and good-step counter (its
 * configuration: zopt_optimizer_configure_loss_scaler). */
ZOPT_API zopt_status zopt_optimizer_set_tensor_step(zopt_optimizer *opt, int tensor, int64_t count);
ZOPT_API zopt_status zopt_optimizer_set_step_count(zopt_optimizer *opt, int group, int64_t count);
ZOPT_API zopt_status zopt_optimizer_get_loss_scaler_state(const zopt_optimizer *opt, double *scale,
                                                          int64_t *good_steps);
ZOPT_API zopt_status zopt_optimizer_set_loss_scaler_state(zopt_optimizer *opt, double scale, int64_t good_steps);
/* The loss scaler's configuration (zopt_optimizer_configure_loss_scaler's,
 * or a loaded checkpoint's). */
ZOPT_API zopt_status zopt_optimizer_get_loss_scaler_config(const zopt_optimizer *opt,
                                                           zopt_loss_scaler_config *config);
/* zopt_optimizer_get_tensor_step of tensors [first, first + count) into
 * counts[0 .. count). */
ZOPT_API zopt_status zopt_optimizer_get_tensor_steps(const zopt_optimizer *opt, int first, int count,
                                                     int64_t *counts);
/* Makes the master (and, under ZeRO-3, the runtime's param shard) of
 * tensors [first, first + count) again the user's params, widened, as at
 * finalize: call it after writing new values into params whose step keeps
 * a master (e.g. loading pretrained weights into the model after the
 * optimizer was built), or the next step would continue from the old
 * master and overwrite them. Each rank refreshes what it holds from its
 * own params (no communication). Moments are left as they are. */
ZOPT_API zopt_status zopt_optimizer_refresh_master(zopt_optimizer *opt, int first, int count);
/* Where the last step's time went: seconds[i] is the wall time of op i of
 * the step program (zopt_step_descriptor.program; 0 for an op the step
 * skipped), seconds[num_program] the agreement between ranks that precedes
 * them. `n` is the array's length (>= num_program + 1). CPU-updated steps
 * (a GPU step's ops are asynchronous: ZOPT_ERR_UNSUPPORTED). */
ZOPT_API zopt_status zopt_optimizer_get_op_times(const zopt_optimizer *opt, double *seconds, int n);
/* The last completed step by kind of work (docs/GPU.md "Offloaded
 * steps"): the baseline of an offloaded step. All times are host wall
 * seconds. total_seconds runs from the step's checks to its result
 * (zopt_optimizer_step; a split or linked step: from its first half's
 * start to its end, the caller's time between included). The program's
 * COPY ops of an offloaded step are d2h_seconds (the grads, and params
 * when the update reads them, from the GPU into the pinned staging, until
 * they are complete; this includes waiting for the previous step's param
 * copies out of the same staging) and h2d_seconds (the new params back to
 * the GPU: the time step() spent on them; the driver runs them
 * asynchronously, so their completion overlaps the caller's next work on
 * the stream); update_seconds is every other op (norm, update,
 * collectives, finish) and the ranks' agreement. total_seconds >= the sum
 * of the parts. d2h_bytes / h2d_bytes: this rank's bytes copied.
 * `offloaded` is 1 for a step that stages its params and grads; an
 * all-CPU step reports 0 and no copies. `steps` counts the completed steps
 * of this optimizer (0: none yet, every figure 0). CPU-updated steps (a
 * GPU step's ops are asynchronous: ZOPT_ERR_UNSUPPORTED). */
typedef struct zopt_step_stats {
  double total_seconds;
  double d2h_seconds;
  double update_seconds;
  double h2d_seconds;
  uint64_t d2h_bytes;
  uint64_t h2d_bytes;
  int32_t offloaded;
  int32_t reserved;
  int64_t steps;
} zopt_step_stats;
ZOPT_API zopt_status zopt_optimizer_get_step_stats(const zopt_optimizer *opt, zopt_step_stats *stats);
/* The current params of tensors [first, first + count) into dst[i] (NULL
 * or a NULL entry: the registered param memory). Under ZeRO-3 the params
 * are held sharded by the runtime and this is a collective: every rank
 * calls it with the same tensors (e.g. before each forward). Otherwise the
 * params already are in user memory: a copy. */
ZOPT_API zopt_status zopt_optimizer_gather_params(zopt_optimizer *opt, int first, int count, void *const *dst);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* ZOPT_ZOPT_H */
