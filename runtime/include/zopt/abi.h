/*===- zopt/abi.h - The step.so contract ----------------------*- C -*-===*
 *
 * The one reviewed contract between zopt-compile (the writer) and the zopt
 * runtime (the reader). Everything a runtime needs to drive a compiled step
 * is in a step.so as:
 *
 *   1. one exported, read-only object named ZOPT_DESC_SYMBOL of type
 *      zopt_step_descriptor (magic, ABI version, size, checksum, states,
 *      hyperparameter slots, kernel table), and
 *   2. the kernels the descriptor's kernel table names, exported with the C
 *      signatures below.
 *
 * Plain C99, no dependency: the compiler includes it to fill the descriptor,
 * the runtime to validate it. Any change to a layout or a signature bumps
 * ZOPT_ABI_VERSION. docs/ABI.md explains every field.
 *===----------------------------------------------------------------------===*/
#ifndef ZOPT_ABI_H
#define ZOPT_ABI_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define ZOPT_ABI_VERSION 4u
#define ZOPT_DESC_MAGIC "ZOPTDSC1" /* 8 bytes, no terminator stored */
#define ZOPT_DESC_SYMBOL "zopt_step_descriptor"

#define ZOPT_MAX_STATES 12
#define ZOPT_MAX_HYPERS 16
#define ZOPT_MAX_COEFFS 64
#define ZOPT_MAX_KERNELS 16
#define ZOPT_MAX_PROGRAM 16
#define ZOPT_NAME_LEN 64

/* Element types of stored state. */
typedef enum zopt_dtype {
  ZOPT_DTYPE_F32 = 1,
  ZOPT_DTYPE_BF16 = 2,
  ZOPT_DTYPE_F16 = 3,
  ZOPT_DTYPE_I16 = 4, /* a remainder master's low half: see "Remainder masters" */
  ZOPT_DTYPE_Q8 = 5,  /* a q8 moment's codes, one uint8_t each: see "q8 moments" */
} zopt_dtype;

/* Where a state lives. */
typedef enum zopt_placement {
  ZOPT_PLACE_CPU = 1,
  ZOPT_PLACE_GPU = 2,
} zopt_placement;

/* What a state is. The runtime owns every kind but PARAM and GRAD, which are
 * the user's tensors. */
typedef enum zopt_state_kind {
  ZOPT_STATE_PARAM = 1,
  ZOPT_STATE_GRAD = 2,
  ZOPT_STATE_MASTER = 3,
  ZOPT_STATE_EXP_AVG = 4,
  ZOPT_STATE_EXP_AVG_SQ = 5,
  ZOPT_STATE_MAX_EXP_AVG_SQ = 6,
  ZOPT_STATE_MOMENTUM_BUFFER = 7,
  /* The per-block absmax (f32, ZOPT_STATE_PER_BLOCK) of a q8 EXP_AVG /
   * EXP_AVG_SQ: see "q8 moments". Not a state of the dialect. */
  ZOPT_STATE_EXP_AVG_ABSMAX = 8,
  ZOPT_STATE_EXP_AVG_SQ_ABSMAX = 9,
  /* The compensation (bf16) of a param declared `kahan`: see "Kahan-
   * compensated params". Not a state of the dialect. */
  ZOPT_STATE_KAHAN_COMP = 10,
} zopt_state_kind;

/* Rounding of a narrowing store into the state. */
typedef enum zopt_rounding {
  ZOPT_ROUND_NEAREST_EVEN = 1,
  ZOPT_ROUND_STOCHASTIC = 2, /* bf16 states: see "Stochastic rounding" */
} zopt_rounding;

/* How the runtime initializes a state it owns at finalize. */
typedef enum zopt_state_init {
  ZOPT_INIT_USER = 1,       /* PARAM, GRAD: the user's memory */
  ZOPT_INIT_ZERO = 2,       /* moments */
  ZOPT_INIT_FROM_PARAM = 3, /* master: the param, widened */
} zopt_state_init;

/* Access bits of a state in the update kernel. */
#define ZOPT_ACCESS_READ 1u
#define ZOPT_ACCESS_WRITE 2u

/* State flags. PARTITIONED: under ZeRO the state is sharded across the W
 * ranks (stage >= 1: the optimizer states; stage >= 2 the grad; stage 3 the
 * param): rank r holds (and updates) only its shards. A partitioned PARAM
 * (ZeRO-3) is held by the runtime, initialized from the user's param at
 * finalize and gathered into user memory on request. */
#define ZOPT_STATE_PARTITIONED 1u
/* PER_BLOCK: the state has one element per ZOPT_Q8_BLOCK elements of the
 * tensor (the last block may be partial): a q8 absmax ("q8 moments"). */
#define ZOPT_STATE_PER_BLOCK 2u

/* Hyperparameter slots of a parameter group. Values are doubles. */
typedef enum zopt_hyper_kind {
  ZOPT_HYPER_LR = 1,
  ZOPT_HYPER_BETA1 = 2,
  ZOPT_HYPER_BETA2 = 3,
  ZOPT_HYPER_EPS = 4,
  ZOPT_HYPER_WEIGHT_DECAY = 5,
  ZOPT_HYPER_MOMENTUM = 6,
  ZOPT_HYPER_DAMPENING = 7,
  ZOPT_HYPER_BIAS_CORRECTION = 8, /* 0 = off, otherwise on */
} zopt_hyper_kind;

/* The step-level scalars the runtime hands the prepare kernel, by index. */
typedef enum zopt_global {
  ZOPT_GLOBAL_STEP = 0,           /* the group's 1-based step count t */
  ZOPT_GLOBAL_CLIP_COEF = 1,      /* min(1, max_norm / (norm + 1e-6)) or 1 */
  ZOPT_GLOBAL_GRAD_SCALE = 2,     /* 1 / (S * D): S the loss scale (1 without
                                     loss scaling), D the gradient divisor
                                     (the world size W by default: the
                                     reduced gradient is the ranks' mean) */
  ZOPT_NUM_GLOBALS = 3,
} zopt_global;

/* Kernel roles and their C signatures. A pointer table holds one pointer per
 * descriptor state (in descriptor order) to the first element the call
 * covers (NULL for a state the kernel does not touch); `n` elements are
 * processed; pointers need no alignment.
 *
 * PREPARE: per group and step, computes in double from the group's
 *   hyperparameters (descriptor order) and the globals the float
 *   coefficients of the elementwise kernels.
 *     void prepare(const double *hypers, const double *globals, float *coeffs);
 * UPDATE: the fused elementwise update, one pass over memory. Every state
 *   the update reads (ZOPT_ACCESS_READ) is loaded through `in`, every state
 *   it writes (ZOPT_ACCESS_WRITE) is stored through `out`; in place is
 *   in[s] == out[s]. All loads of an element happen before its stores.
 *     void update(void *const *in, void *const *out, int64_t n,
 *                 const float *coeffs);
 *   With ZOPT_FLAG_STOCHASTIC (some bf16 state rounds stochastically) it
 *   takes two more arguments, see "Stochastic rounding" below:
 *     void update(void *const *in, void *const *out, int64_t n,
 *                 const float *coeffs, uint32_t key, uint32_t first);
 * SUMSQ: the sum over n elements of x*x, where x (f32) is the value the
 *   description's global-norm/non-finite check is taken over (after
 *   unscaling), in this exact order, on every ISA:
 *     a[l] = +0.0 for l < ZOPT_SUMSQ_LANES;
 *     for i = 0 .. n-1:  a[i % ZOPT_SUMSQ_LANES] += (double)x_i * (double)x_i;
 *     return ((a[0] + a[1]) + a[2]) + ... + a[ZOPT_SUMSQ_LANES - 1];
 *   (the product is exact in double, so each step rounds once). The result
 *   depends on the element values and n only, never on the ISA variant:
 *   with the runtime's fixed blocks (docs/DISTRIBUTED.md) the global norm
 *   is the same bits on every ISA, thread count and world size.
 *   Non-finite inputs make the result non-finite.
 *     double sumsq(void *const *states, int64_t n, const float *coeffs);
 * CONTROL: the step's control semantics (docs/NUMERICS.md sections 3, 5,
 *   6), on the host, once per step: from the reduced sum of squares, the
 *   max_norm and the loss scaler it decides the norm, the clip coefficient,
 *   the non-finite skip, the scaler's next state and whether the step
 *   counts advance (zopt_control below). A pure function of the `in`
 *   fields; it writes every `out` field. Every step.so has one (isa NONE,
 *   device CPU); the GPU kernels inline the same IR (SUMSQ's last block,
 *   FINISH), so the runtime holds no arithmetic of any of these rules.
 *     void control(zopt_control *c);
 */
#define ZOPT_SUMSQ_LANES 32
typedef enum zopt_kernel_role {
  ZOPT_KERNEL_PREPARE = 1,
  ZOPT_KERNEL_UPDATE = 2,
  ZOPT_KERNEL_SUMSQ = 3,
  ZOPT_KERNEL_GPU_IMAGE = 4, /* a GPU code image; see "GPU kernels" below */
  ZOPT_KERNEL_FINISH = 5,    /* GPU only: step bookkeeping after UPDATE */
  ZOPT_KERNEL_CONTROL = 6,   /* host: norm, clip, skip, loss scaler, counts */
} zopt_kernel_role;

/* The argument of CONTROL. The step's flags decide which fields matter:
 * with a norm (ZOPT_FLAG_SUMSQ) `sumsq`; with ZOPT_FLAG_CLIP `max_norm`;
 * with ZOPT_FLAG_LOSS_SCALE the scaler's. Without a norm: norm = NaN,
 * skip = 0. Without loss scaling: new_scale = scale, new_good_steps =
 * good_steps. */
typedef struct zopt_control {
  /* in */
  double sumsq;           /* the step's sum of squares (every rank, every
                             linked part), abi.h "SUMSQ" order */
  double max_norm;        /* ZOPT_FLAG_CLIP: the max_norm of this step */
  double scale;           /* S of this step (the loss scale) */
  double growth_factor;   /* the loss scaler's configuration (zopt.h) */
  double backoff_factor;
  double min_scale;
  int64_t growth_interval;
  int64_t good_steps;     /* finite steps since the last change of S */
  uint32_t dynamic;       /* 0: a static S */
  uint32_t reserved0;
  /* out */
  double norm;            /* sqrt(sumsq); NaN without a norm */
  double clip_coef;       /* ZOPT_GLOBAL_CLIP_COEF of the update: with
                             ZOPT_FLAG_CLIP and not skipped
                             min(1, max_norm / (norm + 1e-6)), else 1 */
  double new_scale;       /* S of the next step */
  int64_t new_good_steps;
  uint32_t skip;          /* the step is skipped: nothing but the scaler
                             changes (sumsq not finite) */
  uint32_t advance;       /* the step counts advance (!skip) */
} zopt_control; /* 112 bytes */

/* Instruction-set variant of a CPU kernel. Each value's instructions are a
 * superset of the one before, so the runtime picks the highest variant the
 * CPU supports (zopt/cpu.h); NONE means baseline x86-64 (used for PREPARE).
 * AVX512BF16 variants are emitted only for kernels that store bf16 (they
 * round with VCVTNEPS2BF16); other kernels' best variant is AVX512. */
typedef enum zopt_isa {
  ZOPT_ISA_NONE = 0,
  ZOPT_ISA_AVX2 = 1,       /* x86-64-v3: AVX2, FMA, F16C */
  ZOPT_ISA_AVX512 = 2,     /* x86-64-v4: AVX-512 F/BW/DQ/VL */
  ZOPT_ISA_AVX512BF16 = 3, /* x86-64-v4 + AVX512_BF16 */
  ZOPT_ISA_MAX = ZOPT_ISA_AVX512BF16,
} zopt_isa;

typedef void (*zopt_prepare_fn)(const double *hypers, const double *globals,
                                float *coeffs);
typedef void (*zopt_update_fn)(void *const *in, void *const *out,
                               int64_t n, const float *coeffs);
typedef double (*zopt_sumsq_fn)(void *const *states, int64_t n,
                                const float *coeffs);
/* SUMSQ pairs: a SUMSQ kernel `sym` may come with an exported companion
 * `sym_x2` (not in the kernel table; the runtime looks it up by name, and
 * a step.so without it runs with `sym` alone):
 *   out[j] = sym(s_j, n_j, c_j) for j = 0, 1, the same bits,
 * computed in one loop so that two read streams are in flight per thread.
 * zopt-compile emits it for the AVX-512 variants. */
typedef void (*zopt_sumsq2_fn)(void *const *s0, int64_t n0, const float *c0,
                               void *const *s1, int64_t n1, const float *c1,
                               double *out);
typedef void (*zopt_update_sr_fn)(void *const *in, void *const *out,
                                  int64_t n, const float *coeffs,
                                  uint32_t key, uint32_t first);
typedef void (*zopt_control_fn)(zopt_control *c);

/* Descriptor flags. */
#define ZOPT_FLAG_CLIP 1u       /* global-norm clipping; max_norm is valid */
#define ZOPT_FLAG_LOSS_SCALE 2u /* grads are loss-scaled; skip non-finite */
#define ZOPT_FLAG_SUMSQ 4u      /* a SUMSQ kernel exists */
#define ZOPT_FLAG_STOCHASTIC 8u /* UPDATE takes (key, first): stochastic rounding */
/* What the update rule is (the runtime does not read these; a binding checks
 * torch.optim's rule keys against them). RULE_STATED: this descriptor states
 * NESTEROV and DECOUPLED_DECAY (a zopt-compile that predates them left all
 * three clear). AMSGrad is visible from the states (MAX_EXP_AVG_SQ). */
#define ZOPT_FLAG_NESTEROV 16u        /* SGD momentum is Nesterov's (zopt.nesterov) */
#define ZOPT_FLAG_DECOUPLED_DECAY 32u /* weight decay is decoupled (zopt.decoupled_decay) */
#define ZOPT_FLAG_RULE_STATED 64u     /* NESTEROV and DECOUPLED_DECAY are stated */
/* The GPU FINISH kernel strides its per-tensor counts over any grid (block
 * 0 does the per-group counts and the scaler): the runtime launches one
 * block per ZOPT_GPU_FINISH_BLOCK tensors. Without it (an older step.so)
 * FINISH runs as one block. */
#define ZOPT_FLAG_FINISH_GRID 128u

/*===-- Remainder masters -------------------------------------------------===*
 *
 * An f32 master declared `remainder` (docs/NUMERICS.md §9) is a state of
 * kind MASTER, dtype I16, beside a bf16 PARAM on the same placement: the
 * param holds the high half of the master, the I16 state the low half, as
 * the signed difference of the master and the param (in units of the f32
 * bit pattern):
 *     bits(master) = (bits(param) << 16) + (int32_t)rem      (mod 2^32)
 * which is the f32 master exactly. A new master x is split as
 *     rem   = low 16 bits of bits(x)
 *     param = (bits(x) >> 16) + (rem < 0)    (x not NaN: nearest, ties away)
 *     param = (bits(x) | 0x400000) >> 16     (x NaN: quiet, as RNE)
 * so the param is x rounded to nearest bf16 with ties away from zero (it
 * differs from RNE only on an exact tie with an even high half), and
 * rebuilding gives bits(x) back (a NaN rebuilds to a NaN). A master
 * initialized from the param has rem = 0. These two functions are the
 * definition.
 */
static inline uint32_t zopt_remainder_join(uint16_t param, uint16_t rem) {
  return ((uint32_t)param << 16) + (uint32_t)(int32_t)(int16_t)rem;
}
static inline void zopt_remainder_split(uint32_t bits, uint16_t *param,
                                        uint16_t *rem) {
  *rem = (uint16_t)bits;
  if ((bits & 0x7FFFFFFFu) > 0x7F800000u) /* NaN */
    *param = (uint16_t)((bits | 0x400000u) >> 16);
  else
    *param = (uint16_t)((bits >> 16) + ((bits >> 15) & 1u));
}

/*===-- Kahan-compensated params -----------------------------------------===*
 *
 * A bf16 param declared `kahan` (docs/NUMERICS.md §11; `zopt.state param :
 * bf16 on cpu kahan`) has a compensation: a state of kind KAHAN_COMP, dtype
 * BF16, on the param's placement, initialized to zero, partitioned as the
 * optimizer states are. The update kernel computes the param's new value v
 * in f32 from the bf16 param p as without `kahan`; the store is then, in f32
 * arithmetic (each operation rounded to nearest even, none fused):
 *     u  = v - p              the step's update (weight decay included)
 *     y  = u + c
 *     p' = bf16(p + y)        round to nearest even (a NaN: quiet)
 *     c' = bf16(y - (p' - p))
 * (optimi's kahan_sum with y, p + y and the error kept in f32). This
 * function is the definition.
 */
static inline uint16_t zopt_kahan_bf16(float x) {
  union { float f; uint32_t u; } b;
  b.f = x;
  if ((b.u & 0x7FFFFFFFu) > 0x7F800000u) /* NaN */
    return (uint16_t)((b.u | 0x400000u) >> 16);
  return (uint16_t)((b.u + 0x7FFFu + ((b.u >> 16) & 1u)) >> 16);
}
static inline float zopt_kahan_f32(uint16_t h) {
  union { float f; uint32_t u; } b;
  b.u = (uint32_t)h << 16;
  return b.f;
}
static inline void zopt_kahan_store(uint16_t p, uint16_t c, float v,
                                    uint16_t *p_out, uint16_t *c_out) {
  const float pf = zopt_kahan_f32(p);
  const float u = v - pf;
  const float y = u + zopt_kahan_f32(c);
  const uint16_t np = zopt_kahan_bf16(pf + y);
  *p_out = np;
  *c_out = zopt_kahan_bf16(y - (zopt_kahan_f32(np) - pf));
}

/*===-- q8 moments --------------------------------------------------------===*
 *
 * An Adam moment declared `q8` (docs/NUMERICS.md §10; `zopt.state exp_avg :
 * f32 on cpu q8`, likewise exp_avg_sq) is stored as one code per element
 * (dtype Q8, a uint8_t) and one f32 absmax per block of ZOPT_Q8_BLOCK
 * elements of the tensor: a second descriptor state of kind
 * EXP_AVG_ABSMAX (of the q8 EXP_AVG) or EXP_AVG_SQ_ABSMAX (of the q8
 * EXP_AVG_SQ), dtype F32, flags PER_BLOCK, the same placement, access and
 * partitioning as its moment, init ZERO: the runtime starts every code at
 * the map's zero code and every absmax at 0 (any code decodes to +-0 with
 * absmax 0). EXP_AVG uses the signed map, EXP_AVG_SQ the unsigned one
 * (zopt/q8_maps.h, generated by scripts/gen-q8-maps.py):
 *     decode:  x = map[code] * absmax                 (one f32 multiply)
 *     encode:  absmax = max |x| over the block's elements (NaN if any x is
 *              NaN); zopt_q8_encode below for each element.
 * A block whose absmax is 0 holds zeros; one whose absmax is not finite
 * stores the zero code everywhere and so decodes to NaN everywhere.
 *
 * UPDATE kernels with q8 states: the `in`/`out` entries of a q8 state point
 * at the code of the call's first element, those of its absmax at that
 * element's block's absmax; the first element of a call is at a block
 * boundary of the tensor (a multiple of ZOPT_Q8_BLOCK), n is any (the last
 * block of the call may be partial: its absmax covers only the call's
 * elements). Per block the kernel loads the codes and the absmax, decodes,
 * runs the rule with the decoded moments, updates the params with the new
 * unquantized moments, reduces the block's new absmax, encodes and stores
 * codes and absmax: one pass over memory.
 *
 * The GPU UPDATE ("GPU kernels" below) runs one block of ZOPT_GPU_BLOCK
 * (= ZOPT_Q8_BLOCK) threads per q8 block: every chunk of its work list must
 * begin at a block boundary of its segment (a multiple of ZOPT_Q8_BLOCK),
 * and the absmax pointer of a segment is that tensor's block 0.
 *
 * The runtime lays a step with q8 states out with align >= ZOPT_Q8_BLOCK
 * (docs/DISTRIBUTED.md "The layout"), so every chunk and ZeRO shard starts
 * at a block boundary (the CUDA backend: every segment and chunk). A step
 * with a q8 state or any kernel on the GPU loads only with
 * ZOPT_EXPERIMENTAL_GPU_Q8=1 until its kernels have been checked on a GPU
 * (docs/GPU.md "q8 moments on the GPU"); otherwise ZOPT_ERR_UNSUPPORTED.
 */
#define ZOPT_Q8_BLOCK 256
#define ZOPT_Q8_SIGNED_ZERO 127  /* the code of 0 in the signed map */
#define ZOPT_Q8_UNSIGNED_ZERO 0  /* the code of 0 in the unsigned map */
#include "zopt/q8_maps.h"
static inline float zopt_q8_decode(uint8_t code, float absmax, int is_unsigned) {
  return (is_unsigned ? zopt_q8_unsigned_map : zopt_q8_signed_map)[code] * absmax;
}
/* The code of element x of a block with absmax `absmax`: r = x / absmax in
 * f32, rounded to the nearest map value (ties toward the smaller
 * magnitude: the thresholds of q8_maps.h); with the unsigned map a nonzero
 * x never takes the zero code (it takes code 1 at least: a nonzero v never
 * decodes to 0). absmax 0 or not finite: the zero code. */
static inline uint8_t zopt_q8_encode(float x, float absmax, int is_unsigned) {
  const float *t = is_unsigned ? zopt_q8_unsigned_thresholds : zopt_q8_signed_thresholds;
  const uint8_t zero = is_unsigned ? ZOPT_Q8_UNSIGNED_ZERO : ZOPT_Q8_SIGNED_ZERO;
  if (!(absmax > 0.0f && absmax <= 0x1.fffffep+127f)) return zero;
  float r = x / absmax;
  unsigned c = 0, s;
  for (s = 128; s; s >>= 1)
    if (r > t[c + s - 1]) c += s;
  if (is_unsigned && c == 0 && x != 0.0f) c = 1;
  return (uint8_t)c;
}

/*===-- Stochastic rounding -----------------------------------------------===*
 *
 * A bf16 state declared `rounding stochastic` is stored as
 *     bf16 = (bits(x) + r) >> 16          (x finite or infinite; 32-bit add)
 *     bf16 = RNE(x)                       (x NaN: quiet, as for nearest_even)
 * where r in [0, 2^16) is 16 bits of a counter-based hash of the run's
 * seed, the group's step t (1-based, the step being taken), the tensor (its
 * index in the optimizer, in add order), the element's index i in the
 * tensor and the state's descriptor slot: the same bits on every thread
 * count, chunking, ISA and run. E[bf16] = x for finite x below the largest
 * finite bf16 (values beyond it may round to infinity, in proportion).
 *
 * The runtime passes key = zopt_sr_key(seed, t, tensor, i0 >> 32) and
 * first = (uint32_t)i0 for a call whose states[*] point at element i0 of one
 * tensor (calls never straddle a multiple of 2^32 elements); the kernel
 * rounds element first + j (mod 2^32) of slot s with zopt_sr_bits(key, s,
 * first + j). These functions are the definition (the tests' reference
 * uses them too).
 */
static inline uint32_t zopt_fmix32(uint32_t h) {
  h ^= h >> 16;
  h *= 0x85EBCA6Bu;
  h ^= h >> 13;
  h *= 0xC2B2AE35u;
  h ^= h >> 16;
  return h;
}
static inline uint32_t zopt_sr_key(uint64_t seed, uint64_t t, uint32_t tensor,
                                   uint32_t index_hi) {
  uint32_t k = zopt_fmix32((uint32_t)seed ^ zopt_fmix32((uint32_t)(seed >> 32) + 0x9E3779B9u));
  k = zopt_fmix32(k ^ (uint32_t)t ^ zopt_fmix32((uint32_t)(t >> 32) + 0x7F4A7C15u));
  k = zopt_fmix32(k ^ tensor);
  return zopt_fmix32(k ^ index_hi);
}
static inline uint32_t zopt_sr_bits(uint32_t key, uint32_t slot, uint32_t i) {
  return zopt_fmix32((i * 0x9E3779B1u) ^ (key + slot * 0x27D4EB2Fu)) >> 16;
}

typedef struct zopt_state_desc {
  uint32_t kind;      /* zopt_state_kind */
  uint32_t dtype;     /* zopt_dtype */
  uint32_t placement; /* zopt_placement */
  uint32_t rounding;  /* zopt_rounding of narrowing stores */
  uint32_t init;      /* zopt_state_init */
  uint32_t access;    /* ZOPT_ACCESS_* bits in the UPDATE kernel */
  uint32_t flags;     /* ZOPT_STATE_* */
  uint32_t reserved;  /* 0 */
} zopt_state_desc;

typedef struct zopt_hyper_desc {
  uint32_t kind; /* zopt_hyper_kind */
  uint32_t reserved;
  double default_value; /* used when the user sets no value */
  double min_value;     /* valid range, inclusive */
  double max_value;     /* valid range; max_exclusive says if exclusive */
  uint32_t max_exclusive;
  uint32_t reserved2;
} zopt_hyper_desc;

typedef struct zopt_kernel_desc {
  uint32_t role;   /* zopt_kernel_role */
  uint32_t isa;    /* zopt_isa */
  uint32_t device; /* zopt_placement the kernel runs on */
  uint32_t reserved;
  char symbol[ZOPT_NAME_LEN]; /* exported symbol, NUL-terminated */
} zopt_kernel_desc;

/*===-- The step program --------------------------------------------------===*
 *
 * What a step does, in order, on every rank: the plan phase decides it from
 * the description (ZeRO stage, placements, clipping, loss scaling) and the
 * runtime executes it as written, at any world size W (docs/DISTRIBUTED.md
 * defines the layout: per group a flat space of the tensors' segments, cut
 * into buckets; rank r owns shard r of every bucket). Ops flagged
 * ZOPT_OPF_UNLESS_SKIPPED do not run on a step that NORM skipped.
 *
 *   COPY            state `state` of every tensor from placement `src` to
 *                   `dst` (offload: user GPU memory <-> pinned host staging)
 *   REDUCE_SCATTER  state `state` (the grad), per bucket: every rank's
 *                   values of rank r's shard go to rank r (wire dtype
 *                   `dtype`), which adds them in `accum` (f32) in rank
 *                   order, ((g_0 + g_1) + g_2) + ..., rounds to `dtype` and
 *                   stores the result in its own shard. W = 1: nothing.
 *   ALL_GATHER      state `state`, per bucket: every rank's shard to every
 *                   rank (the full tensors in user memory afterwards).
 *   PREPARE         the coefficient table (per group and step count) with a
 *                   clip coefficient of 1.
 *   NORM_PARTIALS   SUMSQ over the fixed norm blocks of `range` (OWNED: this
 *                   rank's shards, ALL: everything), one partial per block.
 *   NORM            every rank's partials to every rank, added in block
 *                   order: norm, clip coefficient, skip (non-finite); with
 *                   clipping the coefficient table is recomputed with the
 *                   clip coefficient.
 *   UPDATE          the UPDATE kernel over `range`.
 *   FINISH          step counts advance (unless skipped); the loss scaler.
 *
 * `src` is where an op runs (and dst = src), except for COPY.
 */
typedef enum zopt_op_code {
  ZOPT_OP_COPY = 1,
  ZOPT_OP_REDUCE_SCATTER = 2,
  ZOPT_OP_ALL_GATHER = 3,
  ZOPT_OP_NORM_PARTIALS = 4,
  ZOPT_OP_NORM = 5,
  ZOPT_OP_PREPARE = 6,
  ZOPT_OP_UPDATE = 7,
  ZOPT_OP_FINISH = 8,
} zopt_op_code;

typedef enum zopt_range {
  ZOPT_RANGE_OWNED = 1, /* this rank's shards (W = 1: everything) */
  ZOPT_RANGE_ALL = 2,   /* every element, on every rank */
} zopt_range;

#define ZOPT_OPF_UNLESS_SKIPPED 1u

typedef struct zopt_program_op {
  uint32_t code;  /* zopt_op_code */
  uint32_t state; /* descriptor state index (COPY, REDUCE_SCATTER,
                     ALL_GATHER), else 0 */
  uint32_t range; /* zopt_range (NORM_PARTIALS, UPDATE), else 0 */
  uint32_t dtype; /* wire dtype (REDUCE_SCATTER, ALL_GATHER, COPY), else 0 */
  uint32_t accum; /* REDUCE_SCATTER: the dtype it adds in (F32), else 0 */
  uint32_t src;   /* zopt_placement: where the op runs; COPY's source */
  uint32_t dst;   /* COPY's destination; = src otherwise */
  uint32_t flags; /* ZOPT_OPF_* */
} zopt_program_op; /* 32 bytes */

typedef struct zopt_step_descriptor {
  char magic[8];        /* ZOPT_DESC_MAGIC */
  uint32_t abi_version; /* ZOPT_ABI_VERSION */
  uint32_t size;        /* sizeof(zopt_step_descriptor) */
  uint64_t checksum;    /* zopt_desc_checksum() of the struct */
  char name[ZOPT_NAME_LEN]; /* the step's symbol name */
  uint32_t zero_stage;  /* 0..3 */
  uint32_t align;       /* partition alignment in elements, power of two */
  uint32_t flags;       /* ZOPT_FLAG_* */
  uint32_t num_states;
  uint32_t num_hypers;
  uint32_t num_coeffs;
  uint32_t num_kernels;
  uint32_t reserved0;
  double max_norm; /* with ZOPT_FLAG_CLIP */
  zopt_state_desc states[ZOPT_MAX_STATES];
  zopt_hyper_desc hypers[ZOPT_MAX_HYPERS];
  zopt_kernel_desc kernels[ZOPT_MAX_KERNELS];
  uint32_t num_program; /* ops in `program` */
  uint32_t reserved1;
  zopt_program_op program[ZOPT_MAX_PROGRAM];
} zopt_step_descriptor;

/* FNV-1a 64 (offset basis 14695981039346656037, prime 1099511628211) over
 * the descriptor's bytes with the checksum field read as zero. Writer and
 * reader call this same function. (ABI version 1 used a wrong offset basis,
 * 1469598103934665603.) */
static inline uint64_t zopt_desc_checksum(const zopt_step_descriptor *d) {
  const unsigned char *p = (const unsigned char *)d;
  uint64_t h = 14695981039346656037ull;
  const uint64_t off = (uint64_t)((const char *)&d->checksum - (const char *)d);
  for (uint64_t i = 0; i < sizeof(*d); ++i) {
    unsigned char c = (i >= off && i < off + sizeof(d->checksum)) ? 0 : p[i];
    h = (h ^ c) * 1099511628211ull;
  }
  return h;
}

/*===-- GPU kernels -------------------------------------------------------===*
 *
 * A step whose optimizer states live on the GPU (zopt.step with gpu_arch)
 * has its elementwise kernels compiled for the device. Its kernel table then
 * holds, besides the host PREPARE entry (device = CPU, as above):
 *
 *   - one entry per compiled architecture with role = ZOPT_KERNEL_GPU_IMAGE,
 *     device = ZOPT_PLACE_GPU, isa = the SM number (80 for sm_80, 90 for
 *     sm_90), symbol = an exported, read-only byte array holding a CUDA
 *     fatbinary (magic 0xBA55ED50) with the cubin for that SM *and* the PTX,
 *     uncompressed (so a newer GPU can JIT it, and a driver that cannot read
 *     CUDA 13's zstd-compressed entries can load it). Its size in bytes is
 *     the exported `const uint64_t <symbol>_size`, and the CUDA version of
 *     the toolkit that built it (1000 * major + 10 * minor, as
 *     cuDriverGetVersion counts; 0 if unknown) is `const uint32_t
 *     <symbol>_cuda_version` (absent in step.so files compiled before it was
 *     added). The runtime loads the image with the highest isa <= the
 *     device's compute capability (cuModuleLoadData) and refuses a driver
 *     older than the toolkit's major version (a CUDA 13 cubin needs a CUDA
 *     13 driver, R580 or newer).
 *   - entries with role PREPARE, SUMSQ (when ZOPT_FLAG_SUMSQ), UPDATE and
 *     FINISH, device = ZOPT_PLACE_GPU, isa = ZOPT_ISA_NONE, whose symbol
 *     names the `.entry` of that kernel inside every image
 *     (cuModuleGetFunction); these are not symbols of the step.so.
 *   - INIT, which has no kernel-table role: every image holds `.entry
 *     <name>_init_gpu` (name = the descriptor's name). A runtime that does
 *     not find it initializes the states from the params through the host.
 *
 * Every kernel declares its block size (PTX .reqntid): the runtime launches
 * it with exactly that many threads, ZOPT_GPU_BLOCK for SUMSQ, UPDATE and
 * INIT, ZOPT_GPU_PREPARE_BLOCK for PREPARE, ZOPT_GPU_FINISH_BLOCK for FINISH.
 *
 * The step's running state lives on the device, so that a step is a fixed
 * sequence of launches with no host synchronisation and nothing the host
 * must compute per step (it can be captured in a CUDA graph and replayed):
 * the globals table (per group: the group's step count + 1, a clip
 * coefficient of 1, 1/(S*D)), the tensors' steps (tensor_t, per segment:
 * the 1-based step t of the tensor's *next* step, the t its coefficients
 * and stochastic rounding use), the hyperparameter table (read by every
 * launch, so a value the runtime writes between replays is the one the next
 * replay uses), the active mask (`const uint8_t *active`: [num_segments]
 * whether the step updates each tensor, then [num_groups] whether it
 * updates any tensor of each group; zopt_optimizer_set_active writes it)
 * and, with loss scaling, the dynamic loss scaler (zopt_gpu_scaler). The
 * runtime initializes them and reads them back on demand; FINISH advances
 * them. The coefficient table has one row per segment: its group's
 * hyperparameters and globals at the tensor's own t.
 *
 * The elementwise kernels run over a WORK LIST of chunks (zopt_gpu_chunk):
 * each chunk is a range of elements of one segment (one tensor), and block b
 * of the grid processes chunks b, b + gridDim.x, b + 2 * gridDim.x, ...
 * with all its threads, so the work of a launch is proportional to the
 * elements, never to (segments x threads), and the grid is sized to the
 * device (occupancy), not to the largest tensor. Chunks never straddle a
 * multiple of 2^32 elements of their segment (stochastic rounding's
 * index_hi is constant inside a chunk). Within a chunk of n elements at
 * element `begin`, a thread handles a scalar head of h < lanes elements,
 * after which every used state pointer is 16-byte aligned (h exists when
 * all pointers have the same alignment phase; otherwise the chunk is all
 * scalar), 16-byte vector loads/stores (4 x f32, 8 x 16-bit lanes; f32
 * states beside 16-bit ones as 2 x 16 bytes) over the middle, and a scalar
 * tail. Each element gets the same arithmetic on every path, so its result
 * does not depend on the chunking, the grid or the pointers' alignment.
 *
 * All pointers below are device pointers; every launch goes on one stream,
 * in the order PREPARE, SUMSQ, UPDATE, FINISH:
 *
 * PREPARE (grid-stride over segments, any grid; ZOPT_GPU_PREPARE_BLOCK):
 *     void prepare(const double *hypers,   // [num_groups][num_hypers]
 *                  const double *globals,  // [num_groups][ZOPT_NUM_GLOBALS]
 *                  const zopt_gpu_segment *segs,
 *                  const double *tensor_t, // [num_segments]
 *                  int64_t num_segments,
 *                  float *coeffs);         // out: [num_segments][num_coeffs]
 *   The host PREPARE run on the device for every segment s: the
 *   hyperparameters and globals of its group segs[s].group, with STEP =
 *   tensor_t[s]. The CLIP_COEF global is taken from `globals` here (pass
 *   1); with clipping, SUMSQ recomputes the table with the device-computed
 *   coefficient.
 *
 * SUMSQ (gridDim.x <= ZOPT_GPU_MAX_BLOCKS; ZOPT_GPU_BLOCK):
 *     void sumsq(void *const *states,          // [num_segments][num_states]
 *                const zopt_gpu_segment *segs, // [num_segments]
 *                const zopt_gpu_chunk *chunks, // [num_chunks]
 *                int64_t num_chunks,
 *                float *coeffs,                // [num_segments][num_coeffs]
 *                double *partials,             // [gridDim.x] scratch
 *                zopt_gpu_step_globals *sg,
 *                const double *hypers, const double *globals,
 *                int64_t num_segments,
 *                const double *tensor_t, const uint8_t *active);
 *   Two-stage, deterministic for a given grid and work list (both fixed at
 *   finalize): every block writes its f64 partial sum of squares to
 *   partials[blockIdx.x] (a chunk of a tensor the step does not update,
 *   active[s] == 0, adds nothing); the last block to finish (atomic counter
 *   sg->blocks_done, reset to 0 by that block) adds the partials in block
 *   order and writes sg: sumsq, and the norm, clip_coef and skip of the
 *   step's CONTROL (the same IR as the host function, with max_norm =
 *   sg->max_norm), nonfinite = skip. The same block then re-runs PREPARE
 *   for every segment with that clip_coef. The runtime zero-fills *sg once
 *   when allocating it and writes sg->max_norm (the optimizer's max_norm)
 *   before the first step and whenever it changes.
 *
 * UPDATE (any grid; ZOPT_GPU_BLOCK):
 *     void update(void *const *states,          // [num_segments][num_states]
 *                 const zopt_gpu_segment *segs,
 *                 const zopt_gpu_chunk *chunks,
 *                 int64_t num_chunks,
 *                 const float *coeffs,          // [num_segments][num_coeffs]
 *                 const zopt_gpu_step_globals *sg, // NULL: never skip
 *                 const uint8_t *active);
 *   With ZOPT_FLAG_STOCHASTIC two more arguments follow:
 *                 const double *tensor_t,       // [num_segments]
 *                 uint64_t seed);
 *   and element i of segment s rounds with zopt_sr_bits(zopt_sr_key(seed,
 *   tensor_t[s], segs[s].tensor, i >> 32), slot, (uint32_t)i), the same
 *   bits as on the CPU.
 *   ONE launch for all tensors of the step. Returns at once when sg->skip;
 *   leaves the chunks of a segment with active[s] == 0 untouched.
 *   Segment s has segs[s].n elements at the pointers states[s * num_states
 *   + k] (k = descriptor state index; unused states may be NULL); pointers
 *   need only be aligned to their element size.
 *
 * FINISH (ZOPT_GPU_FINISH_BLOCK threads a block; with ZOPT_FLAG_FINISH_GRID
 * any grid: all threads share the per-segment counts, block 0 the group
 * counts, its thread 0 the scaler; without it one block):
 *     void finish(double *globals,              // [num_groups][ZOPT_NUM_GLOBALS]
 *                 int64_t num_groups,
 *                 zopt_gpu_step_globals *sg,    // NULL: no SUMSQ, never skipped
 *                 zopt_gpu_scaler *sc,          // NULL: no loss scaling
 *                 double *tensor_t,             // [num_segments]
 *                 const uint8_t *active,
 *                 int64_t num_segments);
 *   The step's CONTROL (the same IR as the host function) on sumsq =
 *   sg ? sg->sumsq : 0, max_norm = sg ? sg->max_norm : the descriptor's,
 *   and the scaler *sc: when it advances, tensor_t[s]
 *   of every segment with active[s] advances by 1, the STEP global of
 *   every group with active[num_segments + g] by 1, and
 *   sg->steps_applied by 1 (when sg). With
 *   sc, sc->last_scale = sc->scale first, then sc->scale and
 *   sc->good_steps become CONTROL's new_scale and new_good_steps, and every
 *   group's GRAD_SCALE global becomes 1 / (sc->scale * sc->grad_divisor)
 *   with the group's sign.
 *
 * INIT (any grid; ZOPT_GPU_BLOCK; once, at finalize and refresh_master):
 *     void init(void *const *states, const zopt_gpu_segment *segs,
 *               const zopt_gpu_chunk *chunks, int64_t num_chunks);
 *   Every state with init ZOPT_INIT_FROM_PARAM gets the param's values,
 *   converted as the runtime's host conversion (widening exactly; narrowing
 *   to nearest even; the same dtype bit for bit).
 */
#define ZOPT_GPU_BLOCK 256        /* SUMSQ, UPDATE, INIT block size, power of two */
#define ZOPT_GPU_PREPARE_BLOCK 64 /* PREPARE block size */
#define ZOPT_GPU_FINISH_BLOCK 32  /* FINISH block size */
#define ZOPT_GPU_MAX_BLOCKS 65535

typedef struct zopt_gpu_segment {
  int64_t n;       /* elements */
  uint32_t group;  /* parameter group: its row of the hyperparameter and globals tables */
  uint32_t tensor; /* the tensor's index in the optimizer (stochastic rounding) */
} zopt_gpu_segment; /* 16 bytes */

typedef struct zopt_gpu_chunk {
  int64_t begin;    /* first element, an index into the segment */
  uint32_t segment; /* index into the segment table */
  uint32_t n;       /* elements, 1 .. 2^31; begin + n <= segs[segment].n */
} zopt_gpu_chunk; /* 16 bytes */

typedef struct zopt_gpu_step_globals {
  double sumsq;         /* sum over all segments of x*x */
  double norm;          /* sqrt(sumsq) */
  double clip_coef;     /* min(1, max_norm / (norm + 1e-6)), or 1 */
  uint32_t nonfinite;   /* sumsq is NaN or Inf */
  uint32_t skip;        /* UPDATE does nothing this step */
  uint32_t blocks_done; /* SUMSQ's internal counter; 0 between launches */
  uint32_t steps_applied; /* FINISH: steps not skipped (wraps at 2^32) */
  double max_norm;      /* the clip threshold CONTROL reads (ABI 4): the
                           runtime writes it (the descriptor's max_norm, or
                           zopt_optimizer_set_max_norm's) */
} zopt_gpu_step_globals; /* 48 bytes */

typedef struct zopt_gpu_scaler {
  double scale;           /* S: the grads of the next step are scaled by S */
  double growth_factor;
  double backoff_factor;
  double min_scale;
  int64_t growth_interval;
  int64_t good_steps;     /* finite steps since the last change */
  double last_scale;      /* FINISH: the S of the step it ran after */
  uint32_t dynamic;       /* 0: static S */
  uint32_t reserved;
  double grad_divisor;    /* D of ZOPT_GLOBAL_GRAD_SCALE = 1 / (S * D) */
} zopt_gpu_scaler; /* 72 bytes */

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* ZOPT_ABI_H */
