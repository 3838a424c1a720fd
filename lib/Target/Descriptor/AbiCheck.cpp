//===- AbiCheck.cpp - the .td enums against abi.h, at compile time --------===//
//
// The dialects' enums (state kinds, placements, rounding, hyperparameter
// and global slots, ranges, kernel roles) are written into the descriptor
// as the numbers of runtime/include/zopt/abi.h, which the .td files copy by
// hand. This translation unit makes a copy that disagrees fail the build:
//   - every mirrored .td case equals its abi.h value (static_assert);
//   - every enumerator of a mirrored abi.h enum is mapped to a .td case (an
//     exhaustive switch compiled with -Wswitch as an error), so a value
//     added to abi.h fails here until the .td has it;
//   - the largest .td case is abi.h's largest value, so a case added to the
//     .td alone fails too.
// python/zopt/_lib.py's copies are checked by scripts/check-abi-python.py.
//
//===----------------------------------------------------------------------===//
#include "zopt/Dialect/Program/IR/ProgramOps.h"
#include "zopt/Dialect/ZK/IR/ZKOps.h"
#include "zopt/Dialect/Zopt/IR/ZoptOps.h"
#include "zopt/abi.h"

#include <cstdint>

#pragma GCC diagnostic error "-Wswitch"

using namespace mlir;

namespace {

// Each list names an abi.h enumerator and the .td case that mirrors it.
#define ZOPT_STATE_KINDS(X)                                                   \
  X(ZOPT_STATE_PARAM, zopt::StateKind::param)                                 \
  X(ZOPT_STATE_GRAD, zopt::StateKind::grad)                                   \
  X(ZOPT_STATE_MASTER, zopt::StateKind::master)                               \
  X(ZOPT_STATE_EXP_AVG, zopt::StateKind::exp_avg)                             \
  X(ZOPT_STATE_EXP_AVG_SQ, zopt::StateKind::exp_avg_sq)                       \
  X(ZOPT_STATE_MAX_EXP_AVG_SQ, zopt::StateKind::max_exp_avg_sq)               \
  X(ZOPT_STATE_MOMENTUM_BUFFER, zopt::StateKind::momentum_buffer)
#define ZOPT_PLACEMENTS(X)                                                    \
  X(ZOPT_PLACE_CPU, zopt::Placement::cpu)                                     \
  X(ZOPT_PLACE_GPU, zopt::Placement::gpu)
#define ZOPT_ROUNDINGS(X)                                                     \
  X(ZOPT_ROUND_NEAREST_EVEN, zopt::Rounding::nearest_even)                    \
  X(ZOPT_ROUND_STOCHASTIC, zopt::Rounding::stochastic)
#define ZOPT_HYPER_KINDS(X)                                                   \
  X(ZOPT_HYPER_LR, zopt::HyperKind::lr)                                       \
  X(ZOPT_HYPER_BETA1, zopt::HyperKind::beta1)                                 \
  X(ZOPT_HYPER_BETA2, zopt::HyperKind::beta2)                                 \
  X(ZOPT_HYPER_EPS, zopt::HyperKind::eps)                                     \
  X(ZOPT_HYPER_WEIGHT_DECAY, zopt::HyperKind::weight_decay)                   \
  X(ZOPT_HYPER_MOMENTUM, zopt::HyperKind::momentum)                           \
  X(ZOPT_HYPER_DAMPENING, zopt::HyperKind::dampening)                         \
  X(ZOPT_HYPER_BIAS_CORRECTION, zopt::HyperKind::bias_correction)
#define ZOPT_GLOBALS(X)                                                       \
  X(ZOPT_GLOBAL_STEP, zopt::GlobalKind::step)                                 \
  X(ZOPT_GLOBAL_CLIP_COEF, zopt::GlobalKind::clip_coef)                       \
  X(ZOPT_GLOBAL_GRAD_SCALE, zopt::GlobalKind::grad_scale)
#define ZOPT_RANGES(X)                                                        \
  X(ZOPT_RANGE_OWNED, zprog::Range::owned)                                    \
  X(ZOPT_RANGE_ALL, zprog::Range::all)
// zk.kernel's roles are the elementwise ones of zopt_kernel_role.
#define ZOPT_KERNEL_ROLES(X)                                                  \
  X(ZOPT_KERNEL_UPDATE, zk::KernelRole::update)                               \
  X(ZOPT_KERNEL_SUMSQ, zk::KernelRole::sumsq)

#define ZOPT_SAME_VALUE(C, E)                                                 \
  static_assert(static_cast<uint32_t>(E) == static_cast<uint32_t>(C),         \
                #E " must equal " #C " of runtime/include/zopt/abi.h");
#define ZOPT_CASE(C, E)                                                       \
  case C:                                                                     \
    return true;

ZOPT_STATE_KINDS(ZOPT_SAME_VALUE)
ZOPT_PLACEMENTS(ZOPT_SAME_VALUE)
ZOPT_ROUNDINGS(ZOPT_SAME_VALUE)
ZOPT_HYPER_KINDS(ZOPT_SAME_VALUE)
ZOPT_GLOBALS(ZOPT_SAME_VALUE)
ZOPT_RANGES(ZOPT_SAME_VALUE)
ZOPT_KERNEL_ROLES(ZOPT_SAME_VALUE)

// Exhaustive over abi.h: an enumerator missing from a list above is a
// -Wswitch error here.
[[maybe_unused]] constexpr bool mirrored(zopt_state_kind v) {
  switch (v) {
    ZOPT_STATE_KINDS(ZOPT_CASE)
  case ZOPT_STATE_EXP_AVG_ABSMAX:    // a q8 moment's companion (abi.h "q8
  case ZOPT_STATE_EXP_AVG_SQ_ABSMAX: // moments"), written by zopt-fuse
  case ZOPT_STATE_KAHAN_COMP: // a kahan param's compensation (abi.h), too
    return false;
  }
  return false;
}
[[maybe_unused]] constexpr bool mirrored(zopt_placement v) {
  switch (v) { ZOPT_PLACEMENTS(ZOPT_CASE) }
  return false;
}
[[maybe_unused]] constexpr bool mirrored(zopt_rounding v) {
  switch (v) { ZOPT_ROUNDINGS(ZOPT_CASE) }
  return false;
}
[[maybe_unused]] constexpr bool mirrored(zopt_hyper_kind v) {
  switch (v) { ZOPT_HYPER_KINDS(ZOPT_CASE) }
  return false;
}
[[maybe_unused]] constexpr bool mirrored(zopt_global v) {
  switch (v) {
    ZOPT_GLOBALS(ZOPT_CASE)
  case ZOPT_NUM_GLOBALS: // the count, not a slot
    return false;
  }
  return false;
}
[[maybe_unused]] constexpr bool mirrored(zopt_range v) {
  switch (v) { ZOPT_RANGES(ZOPT_CASE) }
  return false;
}

// The largest .td case is abi.h's largest enumerator.
static_assert(zopt::getMaxEnumValForStateKind() == ZOPT_STATE_MOMENTUM_BUFFER,
              "zopt::StateKind has a case abi.h lacks");
static_assert(zopt::getMaxEnumValForPlacement() == ZOPT_PLACE_GPU,
              "zopt::Placement has a case abi.h lacks");
static_assert(zopt::getMaxEnumValForRounding() == ZOPT_ROUND_STOCHASTIC,
              "zopt::Rounding has a case abi.h lacks");
static_assert(zopt::getMaxEnumValForHyperKind() == ZOPT_HYPER_BIAS_CORRECTION,
              "zopt::HyperKind has a case abi.h lacks");
static_assert(zopt::getMaxEnumValForGlobalKind() + 1 == ZOPT_NUM_GLOBALS,
              "zopt::GlobalKind and abi.h's ZOPT_NUM_GLOBALS disagree");
static_assert(zprog::getMaxEnumValForRange() == ZOPT_RANGE_ALL,
              "zprog::Range has a case abi.h lacks");

} // namespace
