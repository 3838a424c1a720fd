//===- ZoptOps.td - zopt operations ------------------------*- tablegen -*-===//
#ifndef ZOPT_DIALECT_ZOPTOPS_TD
#define ZOPT_DIALECT_ZOPTOPS_TD

include "zopt/Dialect/Zopt/IR/ZoptDialect.td"
include "zopt/Dialect/Zopt/IR/ZoptEnums.td"
include "mlir/IR/SymbolInterfaces.td"
include "mlir/IR/RegionKindInterface.td"
include "mlir/Interfaces/SideEffectInterfaces.td"

// Element types a state may be stored in and a primitive may consume.
def Zopt_ElemType : AnyTypeOf<[F32, BF16, F16], "f32, bf16 or f16">;

//===----------------------------------------------------------------------===//
// Structure
//===----------------------------------------------------------------------===//

def Zopt_StepOp : Zopt_Op<"step", [Symbol, IsolatedFromAbove, SingleBlock]> {
  let summary = "one optimizer step, described per element";
  let description = [{
    The body is a per-element program over every element of every
    registered parameter: it declares the states (`zopt.state`), the
    runtime hyperparameter slots of a group (`zopt.hyper`), the math, and
    ends with `zopt.yield`, which says which new value each written state
    receives.

    Attributes: `zero_stage` (0-3, default 0), `align` (partition alignment
    of the flat per-group buffers, in elements, a power of two; default 1),
    `gpu_arch` (absent: a CPU-only compile, every state must be on cpu).

    ```mlir
    zopt.step @sgd attributes {zero_stage = 1 : i64, align = 16 : i64} {
      %p = zopt.state param : f32 on cpu
      %g = zopt.state grad : f32 on cpu
      %lr = zopt.hyper lr
      %p1 = zopt.apply %p, %g, %lr : f32, f32
      zopt.yield %p1 into %p : f32 into f32
    }
    ```
  }];
  let arguments = (ins SymbolNameAttr:$sym_name,
                   DefaultValuedAttr<I64Attr, "0">:$zero_stage,
                   DefaultValuedAttr<I64Attr, "1">:$align,
                   OptionalAttr<StrAttr>:$gpu_arch);
  let regions = (region SizedRegion<1>:$body);
  let assemblyFormat = "$sym_name attr-dict-with-keyword $body";
  let hasRegionVerifier = 1;
  let extraClassDeclaration = [{
    /// The zopt.state op of `kind`, or null.
    StateOp getState(StateKind kind);
    YieldOp getYield();
  }];
}

def Zopt_StateOp : Zopt_Op<"state", [Pure, HasParent<"StepOp">]> {
  let summary = "declares a per-parameter state, its element type and placement";
  let description = [{
    The result is this element of the state, in its storage type. `param`
    and `grad` are the user's tensors; every other kind is owned by the
    runtime and initialized by it (`master` from the param, moments to
    zero). Narrowing stores into the state round as `rounding` says
    (default `nearest_even`; `stochastic`: bf16 states, with the
    counter-based random bits of abi.h, reproducible from the optimizer's
    seed on any thread count and the same on CPU and GPU).

    `remainder` (an f32 `master` of a bf16 param only, on the param's
    placement): the master is stored as the int16 low half of its bits,
    the bf16 param being the high half (Transformer Engine's
    `store_param_remainders`): 4 bytes per param instead of 2 + 4, and the
    master it rebuilds is the f32 master exactly (docs/NUMERICS.md §9).

    `q8` (an f32 `exp_avg` or `exp_avg_sq`): the moment is
    stored block-quantized, one 8-bit code per element and one f32 absmax
    per block of 256 elements (bitsandbytes' 8-bit Adam; the signed dynamic
    map for exp_avg, the unsigned one for exp_avg_sq): 1.016 bytes per
    element instead of 4. The rule reads the decoded f32 moment and the
    param update uses the new moment before quantization
    (docs/NUMERICS.md §10).

    `kahan` (a bf16 `param` only, in a step without a master): the param
    carries a bf16 Kahan compensation (optimi's `kahan_sum`), a state
    zopt-fuse adds beside it (abi.h "Kahan-compensated params"): the rule
    computes the new param in f32 from the bf16 param as usual, and the
    store adds the update to the param with the rounding error of the
    previous stores, keeping the new error in the compensation: 4 bytes per
    param like a remainder master, but approximate where that is exact
    (docs/NUMERICS.md §11).

    ```mlir
    %w = zopt.state master : f32 on cpu
    %m = zopt.state exp_avg : bf16 on cpu rounding nearest_even
    %r = zopt.state master : f32 on cpu remainder
    %q = zopt.state exp_avg_sq : f32 on cpu q8
    %k = zopt.state param : bf16 on cpu kahan
    ```
  }];
  let arguments = (ins Zopt_StateKindAttr:$kind, Zopt_PlacementAttr:$placement,
                   OptionalAttr<Zopt_RoundingAttr>:$rounding,
                   UnitAttr:$remainder, UnitAttr:$q8, UnitAttr:$kahan);
  let results = (outs AnyType:$result);
  let assemblyFormat =
      "`` $kind `:` type($result) `on` `` $placement (`rounding` `` $rounding^)? (`remainder` $remainder^)? (`q8` $q8^)? (`kahan` $kahan^)? attr-dict";
  let hasVerifier = 1;
}

def Zopt_HyperOp : Zopt_Op<"hyper", [Pure]> {
  let summary = "a runtime hyperparameter slot of the element's group";
  let description = [{
    A per-group value that arrives at run time (f64), never a constant of
    the compiled code: changing it between steps needs no recompile. The
    optional `default` is used when a group sets no value.

    ```mlir
    %lr = zopt.hyper lr default 1.0e-03
    ```
  }];
  let arguments = (ins Zopt_HyperKindAttr:$kind, OptionalAttr<F64Attr>:$default_value);
  let results = (outs F64:$result);
  let assemblyFormat = "`` $kind (`default` $default_value^)? attr-dict";
  let hasVerifier = 1;
}

def Zopt_GlobalOp : Zopt_Op<"global", [Pure]> {
  let summary = "a step-level runtime scalar computed by the runtime";
  let description = [{
    Introduced by the compiler: `step` (the 1-based step count),
    `clip_coef` (global-norm clip coefficient), `grad_scale` (1/(S*D): S
    the loss scale, D the gradient divisor, by default the world size, so
    that the reduced gradient is the ranks' mean).

    ```mlir
    %t = zopt.global step
    ```
  }];
  let arguments = (ins Zopt_GlobalKindAttr:$kind);
  let results = (outs F64:$result);
  let assemblyFormat = "`` $kind attr-dict";
}

def Zopt_YieldOp : Zopt_Op<"yield", [Terminator, HasParent<"StepOp">,
                                     AttrSizedOperandSegments]> {
  let summary = "stores the new value of each written state";
  let description = [{
    Pairs values with the states they are stored into; stores narrow to the
    state's type with the state's rounding. All stores happen after all
    reads of the element.

    ```mlir
    zopt.yield %w2, %w2 into %w, %p : f32, f32 into f32, bf16
    ```
  }];
  let arguments = (ins Variadic<AnyType>:$values, Variadic<AnyType>:$targets);
  let assemblyFormat = [{
    $values `into` $targets attr-dict `:` type($values) `into` type($targets)
  }];
  let hasVerifier = 1;
}

//===----------------------------------------------------------------------===//
// Step-level transformations (lowered by the plan phase)
//===----------------------------------------------------------------------===//

def Zopt_UnscaleOp : Zopt_Op<"unscale", [Pure]> {
  let summary = "divides a loss-scaled gradient by the loss scale";
  let description = [{
    `g / S` in f32 with S the runtime (dynamic) loss scale. Its presence
    makes the step skip as a whole when any unscaled gradient is not finite.

    ```mlir
    %gs = zopt.unscale %g : f16
    ```
  }];
  let arguments = (ins Zopt_ElemType:$grad);
  let results = (outs F32:$result);
  let assemblyFormat = "$grad attr-dict `:` type($grad)";
}

def Zopt_ClipByGlobalNormOp : Zopt_Op<"clip_by_global_norm", [Pure]> {
  let summary = "clips by the global norm over every parameter (torch clip_grad_norm_)";
  let description = [{
    `n = sqrt(sum of x^2 over every element of every tensor)`,
    `c = max_norm / (n + 1e-6)`; the result is `x * c` if `c < 1`, else `x`.

    ```mlir
    %gc = zopt.clip_by_global_norm %g max 1.0 : bf16
    ```
  }];
  let arguments = (ins Zopt_ElemType:$operand, F64Attr:$max_norm);
  let results = (outs F32:$result);
  let assemblyFormat = "$operand `max` $max_norm attr-dict `:` type($operand)";
  let hasVerifier = 1;
}

def Zopt_ReduceSumSqOp : Zopt_Op<"reduce_sumsq", []> {
  let summary = "marks the value whose global sum of squares the step needs";
  let description = [{
    Introduced by the plan phase: the runtime reduces `x*x` over every
    element before the update (global norm and non-finite check).

    ```mlir
    zopt.reduce_sumsq %gs : f32
    ```
  }];
  let arguments = (ins AnyFloat:$operand);
  let assemblyFormat = "$operand attr-dict `:` type($operand)";
}

//===----------------------------------------------------------------------===//
// Per-element primitives: f32 math over any stored type and f64 hypers.
//===----------------------------------------------------------------------===//

class Zopt_BinaryPrimitive<string mnemonic, string summ, string desc,
                           string lhsName, string rhsName, string hyperName>
    : Zopt_Op<mnemonic, [Pure]> {
  let summary = summ;
  let description = desc;
  let arguments = (ins Zopt_ElemType:$lhs, Zopt_ElemType:$rhs, F64:$hyper);
  let results = (outs F32:$result);
  let assemblyFormat = "$lhs `,` $rhs `,` $hyper attr-dict `:` type($lhs) `,` type($rhs)";
}

def Zopt_L2DecayOp : Zopt_BinaryPrimitive<"l2_decay",
    "L2 weight decay folded into the gradient",
    [{`g + wd * p` (torch.optim.Adam / SGD weight_decay).
    ```mlir
    %gd = zopt.l2_decay %g, %p, %wd : f32, f32
    ```}], "grad", "param", "weight_decay">;

def Zopt_EmaOp : Zopt_BinaryPrimitive<"ema",
    "exponential moving average",
    [{`b * avg + (1 - b) * x` (Adam's first moment; Lion's interpolation).
    ```mlir
    %m1 = zopt.ema %m, %g, %b1 : f32, f32
    ```}], "avg", "value", "beta">;

def Zopt_EmaSqOp : Zopt_BinaryPrimitive<"ema_sq",
    "exponential moving average of the square",
    [{`b * avg + (1 - b) * x * x` (Adam's second moment).
    ```mlir
    %v1 = zopt.ema_sq %v, %g, %b2 : f32, f32
    ```}], "avg", "value", "beta">;

def Zopt_NesterovOp : Zopt_BinaryPrimitive<"nesterov",
    "Nesterov look-ahead direction",
    [{`g + mu * buf`.
    ```mlir
    %d = zopt.nesterov %g, %buf1, %mu : f32, f32
    ```}], "grad", "buf", "momentum">;

def Zopt_ApplyOp : Zopt_BinaryPrimitive<"apply",
    "applies an update direction",
    [{`p - lr * u`.
    ```mlir
    %p1 = zopt.apply %p, %u, %lr : f32, f32
    ```}], "param", "direction", "lr">;

def Zopt_DecoupledDecayOp : Zopt_Op<"decoupled_decay", [Pure]> {
  let summary = "decoupled weight decay (AdamW, Lion)";
  let description = [{
    `p * (1 - lr * wd)`, the coefficient derived per group in f64.
    ```mlir
    %w1 = zopt.decoupled_decay %w, %lr, %wd : f32
    ```
  }];
  let arguments = (ins Zopt_ElemType:$param, F64:$lr, F64:$weight_decay);
  let results = (outs F32:$result);
  let assemblyFormat = "$param `,` $lr `,` $weight_decay attr-dict `:` type($param)";
}

def Zopt_MaxOp : Zopt_Op<"max", [Pure]> {
  let summary = "elementwise maximum (amsgrad), NaN-propagating";
  let description = [{
    ```mlir
    %vm1 = zopt.max %vm, %v1 : f32, f32
    ```
  }];
  let arguments = (ins Zopt_ElemType:$lhs, Zopt_ElemType:$rhs);
  let results = (outs F32:$result);
  let assemblyFormat = "$lhs `,` $rhs attr-dict `:` type($lhs) `,` type($rhs)";
}

def Zopt_SignOp : Zopt_Op<"sign", [Pure]> {
  let summary = "sign (torch.sign): -1, 0 or 1; NaN stays NaN";
  let description = [{
    ```mlir
    %s = zopt.sign %c : f32
    ```
  }];
  let arguments = (ins Zopt_ElemType:$operand);
  let results = (outs F32:$result);
  let assemblyFormat = "$operand attr-dict `:` type($operand)";
}

def Zopt_AdamDirectionOp : Zopt_Op<"adam_direction", [Pure]> {
  let summary = "Adam's update direction with per-group bias correction";
  let description = [{
    `(m / bc1) / (sqrt(v) / sqrt(bc2) + eps)` with `bc1 = 1 - b1^t` and
    `bc2 = 1 - b2^t` when the group's `bias_correction` slot is non-zero,
    else `bc1 = bc2 = 1` (t: the group's step). Coefficients in f64.
    ```mlir
    %u = zopt.adam_direction %m1, %v1, %b1, %b2, %eps : f32, f32
    ```
  }];
  let arguments = (ins Zopt_ElemType:$exp_avg, Zopt_ElemType:$exp_avg_sq,
                   F64:$beta1, F64:$beta2, F64:$eps);
  let results = (outs F32:$result);
  let assemblyFormat = [{
    $exp_avg `,` $exp_avg_sq `,` $beta1 `,` $beta2 `,` $eps attr-dict `:`
    type($exp_avg) `,` type($exp_avg_sq)
  }];
}

def Zopt_MomentumOp : Zopt_Op<"momentum", [Pure]> {
  let summary = "SGD momentum buffer update (torch.optim.SGD)";
  let description = [{
    `g` at the group's first step, then `mu * buf + (1 - dampening) * g`.
    ```mlir
    %b1 = zopt.momentum %buf, %g, %mu, %damp : f32, f32
    ```
  }];
  let arguments = (ins Zopt_ElemType:$buf, Zopt_ElemType:$grad, F64:$momentum,
                   F64:$dampening);
  let results = (outs F32:$result);
  let assemblyFormat = [{
    $buf `,` $grad `,` $momentum `,` $dampening attr-dict `:` type($buf) `,` type($grad)
  }];
}

//===----------------------------------------------------------------------===//
// Named rules (decomposed into primitives)
//===----------------------------------------------------------------------===//

def Zopt_AdamOp : Zopt_Op<"adam", [Pure]> {
  let summary = "Adam (L2) or, with `decoupled`, AdamW";
  let description = [{
    The named rule of torch.optim.Adam / AdamW; the decompose phase expands
    it into `l2_decay` or `decoupled_decay`, `ema`, `ema_sq`,
    `adam_direction` and `apply`. Results: new param, exp_avg, exp_avg_sq.
    ```mlir
    %p1, %m1, %v1 = zopt.adam %p, %g, %m, %v, %lr, %b1, %b2, %eps, %wd {decoupled}
        : f32, f32, f32, f32
    ```
  }];
  let arguments = (ins Zopt_ElemType:$param, Zopt_ElemType:$grad,
                   Zopt_ElemType:$exp_avg, Zopt_ElemType:$exp_avg_sq,
                   F64:$lr, F64:$beta1, F64:$beta2, F64:$eps, F64:$weight_decay,
                   UnitAttr:$decoupled);
  let results = (outs F32:$new_param, F32:$new_exp_avg, F32:$new_exp_avg_sq);
  let assemblyFormat = [{
    $param `,` $grad `,` $exp_avg `,` $exp_avg_sq `,` $lr `,` $beta1 `,` $beta2
    `,` $eps `,` $weight_decay attr-dict `:` type($param) `,` type($grad) `,`
    type($exp_avg) `,` type($exp_avg_sq)
  }];
}

#endif
