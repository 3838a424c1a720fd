//===- ProgramOps.td - zprog operations --------------------*- tablegen -*-===//
#ifndef ZOPT_DIALECT_PROGRAM_PROGRAMOPS_TD
#define ZOPT_DIALECT_PROGRAM_PROGRAMOPS_TD

include "zopt/Dialect/Program/IR/ProgramDialect.td"
include "zopt/Dialect/Program/IR/ProgramEnums.td"
include "zopt/Dialect/Zopt/IR/ZoptEnums.td"
include "mlir/IR/RegionKindInterface.td"

def ZProg_ProgramOp : ZProg_Op<"program", [IsolatedFromAbove, SingleBlock,
                                           NoTerminator]> {
  let summary = "what one step does on every rank, in order";
  let description = [{
    Made by the plan phase from the step's ZeRO stage, placements, clipping
    and loss scaling: the collectives, norm, update and copies one step runs,
    in the order every rank runs them (abi.h "The step program"). Shapes and
    the world size are run-time values; the runtime instantiates the program
    at finalize and executes it as written. `step` names the zopt.step (the
    descriptor's name).

    The verifier checks the order the runtime's executor relies on
    (docs/Dialects/Program.md): one `prepare`, `update` and `finish`, the
    last; the gradient reduced before it is read; the norm between its
    partials and the update; the params gathered after the update; copies
    in before and copies out after the update; `unless_skipped` only after
    the update.

    ```mlir
    zprog.program for "adamw" {
      zprog.reduce_scatter grad : bf16 accumulate f32
      zprog.prepare on cpu
      zprog.norm_partials owned on cpu
      zprog.norm
      zprog.update owned on cpu
      zprog.all_gather param : bf16 unless_skipped
      zprog.finish on cpu
    }
    ```
  }];
  let arguments = (ins StrAttr:$step);
  let regions = (region SizedRegion<1>:$body);
  let assemblyFormat = "`for` $step attr-dict-with-keyword $body";
  let hasRegionVerifier = 1;
  let extraClassDeclaration = [{
    /// The program's zprog.update (the verifier makes it unique), or null.
    UpdateOp getUpdate();
  }];
}

class ZProg_StepOp<string mnemonic, list<Trait> traits = []>
    : ZProg_Op<mnemonic, !listconcat(traits, [HasParent<"ProgramOp">])>;

def ZProg_CopyOp : ZProg_StepOp<"copy"> {
  let summary = "copies a state of every tensor between placements";
  let description = [{
    Offloaded steps (param and grad on the GPU, the update on the CPU): the
    grads (and the params, when the update reads them) from the GPU into
    pinned host staging before the update, the new params back after it,
    unless the step was skipped.

    ```mlir
    zprog.copy grad : bf16 from gpu to cpu
    zprog.copy param : bf16 from cpu to gpu unless_skipped
    ```
  }];
  let arguments = (ins Zopt_StateKindAttr:$state, TypeAttr:$type,
                   Zopt_PlacementAttr:$src, Zopt_PlacementAttr:$dst,
                   UnitAttr:$unless_skipped);
  let assemblyFormat = [{
    `` $state `:` $type `from` `` $src `to` `` $dst (`unless_skipped` $unless_skipped^)? attr-dict
  }];
}

def ZProg_ReduceScatterOp : ZProg_StepOp<"reduce_scatter"> {
  let summary = "adds every rank's values of each shard into its owner, in rank order";
  let description = [{
    Per bucket, every rank sends rank r its values of shard r (as `type`);
    rank r adds the W pieces in `accumulate` in rank order and stores the
    rounded sum into its shard. At world size 1 it does nothing. Only the
    grad is reduced, accumulating in f32.

    ```mlir
    zprog.reduce_scatter grad : bf16 accumulate f32
    ```
  }];
  let arguments = (ins Zopt_StateKindAttr:$state, TypeAttr:$type,
                   TypeAttr:$accumulate);
  let assemblyFormat = "`` $state `:` $type `accumulate` $accumulate attr-dict";
}

def ZProg_AllGatherOp : ZProg_StepOp<"all_gather"> {
  let summary = "every rank's shards of a state to every rank";
  let description = [{
    The reduced grad (ZeRO-0 and 1: every rank keeps the full mean
    gradient; with the reduce-scatter before it, an all-reduce) or, after
    the update, the new params (ZeRO-1 and 2).

    ```mlir
    zprog.all_gather grad : bf16
    zprog.all_gather param : bf16 unless_skipped
    ```
  }];
  let arguments = (ins Zopt_StateKindAttr:$state, TypeAttr:$type,
                   UnitAttr:$unless_skipped);
  let assemblyFormat = [{
    `` $state `:` $type (`unless_skipped` $unless_skipped^)? attr-dict
  }];
}

def ZProg_NormPartialsOp : ZProg_StepOp<"norm_partials"> {
  let summary = "sum-of-squares partials of the fixed norm blocks";
  let description = [{
    One partial per norm block of `range` (`owned`: this rank's shards;
    `all`: every element), computed by the sumsq kernel, which reads the
    coefficient table (so `prepare` comes first).

    ```mlir
    zprog.norm_partials owned on cpu
    ```
  }];
  let arguments = (ins ZProg_RangeAttr:$range, Zopt_PlacementAttr:$on);
  let assemblyFormat = "`` $range `on` `` $on attr-dict";
}

def ZProg_NormOp : ZProg_StepOp<"norm"> {
  let summary = "the global norm, clip coefficient and skip decision";
  let description = [{
    Every rank's partials to every rank, added in block order (independent
    of the world size, thread count and ISA): every rank takes the same
    decision. With clipping, the coefficient table is recomputed with the
    clip coefficient. The runtime splits a step at this op (linked
    optimizers share one norm), so it comes before the update.

    ```mlir
    zprog.norm
    ```
  }];
  let assemblyFormat = "attr-dict";
}

def ZProg_PrepareOp : ZProg_StepOp<"prepare"> {
  let summary = "computes the per-group coefficient table (clip coefficient 1)";
  let description = [{
    Runs the step's prepare function for every group (hyperparameters and
    globals into the f32 coefficients the kernels read).

    ```mlir
    zprog.prepare on cpu
    ```
  }];
  let arguments = (ins Zopt_PlacementAttr:$on);
  let assemblyFormat = "`on` `` $on attr-dict";
}

def ZProg_UpdateOp : ZProg_StepOp<"update"> {
  let summary = "runs the fused update over `range`";
  let description = [{
    The update kernel over this rank's shards (`owned`) or every element
    (`all`); skipped as a whole when the norm decided to skip the step.
    Every op but a copy runs where the update runs.

    ```mlir
    zprog.update owned on cpu
    ```
  }];
  let arguments = (ins ZProg_RangeAttr:$range, Zopt_PlacementAttr:$on);
  let assemblyFormat = "`` $range `on` `` $on attr-dict";
}

def ZProg_FinishOp : ZProg_StepOp<"finish"> {
  let summary = "advances the step counts and the loss scaler";
  let description = [{
    The step's bookkeeping, last: the step counts of the groups that took
    part (unless skipped) and the dynamic loss scaler.

    ```mlir
    zprog.finish on cpu
    ```
  }];
  let arguments = (ins Zopt_PlacementAttr:$on);
  let assemblyFormat = "`on` `` $on attr-dict";
}

#endif
