//===- Passes.td - passes of the zopt dialect --------------*- tablegen -*-===//
//
// The phases that rewrite a description: decompose (named rules into
// per-element math), plan (placement, partition, global reductions and the
// step program in the zprog dialect) and fuse (the zk descriptor, prepare
// and kernels). One pass per .cpp in lib/Dialect/Zopt/Transforms/.
//
//===----------------------------------------------------------------------===//
#ifndef ZOPT_DIALECT_ZOPT_TRANSFORMS_PASSES_TD
#define ZOPT_DIALECT_ZOPT_TRANSFORMS_PASSES_TD

include "mlir/Pass/PassBase.td"

def ZoptDecompose : Pass<"zopt-decompose", "ModuleOp"> {
  let summary = "Expands named rules and primitives into per-element math";
  let description = [{
    Named rules (`zopt.adam`) become primitives; primitives become `arith`
    and `math` ops: f32 math per element, with the coefficients that depend
    only on hyperparameters and the step count computed in f64 from
    `zopt.hyper` / `zopt.global` values. `zopt.unscale` and
    `zopt.clip_by_global_norm` are left for `zopt-plan`. The ops that say
    which rule it is are recorded on the step before they are expanded
    (`zopt.nesterov`, `zopt.decoupled_decay`: unit attributes of the same
    names), for the descriptor's rule flags (`zopt-fuse`).

    ```mlir
    %m1 = zopt.ema %m, %g, %b1 : f32, f32
    // becomes
    %one = arith.constant 1.0 : f64
    %c = arith.subf %one, %b1 : f64
    %b1f = arith.truncf %b1 : f64 to f32
    %cf = arith.truncf %c : f64 to f32
    %0 = arith.mulf %b1f, %m : f32
    %1 = arith.mulf %cf, %g : f32
    %m1 = arith.addf %0, %1 : f32
    ```
  }];
  let dependentDialects = ["::mlir::arith::ArithDialect", "::mlir::math::MathDialect"];
  let statistics = [
    Statistic<"numRules", "rules", "Named rules expanded">,
    Statistic<"numPrimitives", "primitives", "Primitives expanded">
  ];
}

def ZoptPlan : Pass<"zopt-plan", "ModuleOp"> {
  let summary = "Decides placement, partitioning, the global reductions and the step program";
  let description = [{
    Decides where the fused update runs (where the optimizer states live),
    records the ZeRO partition of the flat per-group buffers
    (`zopt.partitioned`), numbers the state slots of the descriptor, and
    turns `zopt.clip_by_global_norm` and `zopt.unscale` into multiplications
    by runtime globals plus one `zopt.reduce_sumsq` over the value the global
    norm / non-finite check is taken of. Writes the step program beside the
    step: a `zprog.program` of the collectives, copies, norm and update one
    step runs on every rank (the zprog dialect).

    ```mlir
    %gc = zopt.clip_by_global_norm %g max 1.0 : f32
    // becomes
    zopt.reduce_sumsq %g : f32
    %c = zopt.global clip_coef
    %cf = arith.truncf %c : f64 to f32
    %gc = arith.mulf %g, %cf : f32
    ...
    zprog.program for "s" {
      zprog.reduce_scatter grad : f32 accumulate f32
      zprog.all_gather grad : f32
      zprog.prepare on cpu
      zprog.norm_partials all on cpu
      zprog.norm
      zprog.update all on cpu
      zprog.finish on cpu
    }
    ```
  }];
  let dependentDialects = ["::mlir::arith::ArithDialect",
                           "::mlir::zprog::ZProgDialect"];
}

def ZoptFuse : Pass<"zopt-fuse", "ModuleOp"> {
  let summary = "Splits the step into a descriptor, a prepare function and fused kernels";
  let description = [{
    Values that do not depend on any state are uniform per group: they move
    into `zk.prepare` (computed in f64 once per group and step) and reach
    the kernels as `zk.coeff` slots. What depends on state becomes the body
    of one `zk.kernel ... update` (one pass over memory) and, when the plan
    asked for a reduction, one `zk.kernel ... sumsq`. The step's control
    semantics (norm, clip, skip, loss scaler, counts: docs/NUMERICS.md)
    become one `zk.control`.

    ```mlir
    zopt.step @s { ... }
    // becomes
    zk.descriptor {...}
    zk.prepare @s_prepare { ... }
    zk.control @s_control { ... }
    zk.kernel @s_update update { ... }
    ```
  }];
  let dependentDialects = ["::mlir::zk::ZKDialect", "::mlir::arith::ArithDialect"];
  let statistics = [
    Statistic<"numCoeffs", "coefficients", "Uniform values passed as coefficients">
  ];
}

#endif
