//===- ZKOps.td - zk operations ----------------------------*- tablegen -*-===//
#ifndef ZOPT_DIALECT_ZK_ZKOPS_TD
#define ZOPT_DIALECT_ZK_ZKOPS_TD

include "zopt/Dialect/ZK/IR/ZKDialect.td"
include "zopt/Dialect/ZK/IR/ZKEnums.td"
include "mlir/IR/SymbolInterfaces.td"
include "mlir/Interfaces/SideEffectInterfaces.td"

def ZK_DescriptorOp : ZK_Op<"descriptor", []> {
  let summary = "what the runtime must know about the compiled step";
  let description = [{
    Codes follow runtime/include/zopt/abi.h: per state kind, dtype,
    placement, rounding, init, access bits and flags (partitioned under
    ZeRO); per hyper slot kind, default,
    min, max and exclusivity of max.

    The conversions record the kernel table on it for `zopt-emit-descriptor`
    (which writes abi.h's `zopt_step_descriptor` and erases this op):
    `cpu_kernels` (convert-zk-to-cpu) lists `[role, isa, "symbol"]`,
    `gpu_kernels` (convert-zk-to-gpu) `[role, "symbol"]` and `gpu_images`
    `[sm, "symbol"]`, with the abi.h codes as i32.
    ```mlir
    zk.descriptor {name = "adamw", zero_stage = 0 : i64, align = 16 : i64,
                   flags = 0 : i64, max_norm = 0.0 : f64, num_coeffs = 6 : i64,
                   state_kinds = array<i32: 1, 2>, ...}
    ```
  }];
  let arguments = (ins StrAttr:$name, I64Attr:$zero_stage, I64Attr:$align,
                   I64Attr:$flags, F64Attr:$max_norm, I64Attr:$num_coeffs,
                   DenseI32ArrayAttr:$state_kinds, DenseI32ArrayAttr:$state_dtypes,
                   DenseI32ArrayAttr:$state_placements,
                   DenseI32ArrayAttr:$state_roundings,
                   DenseI32ArrayAttr:$state_inits, DenseI32ArrayAttr:$state_access,
                   DenseI32ArrayAttr:$state_flags,
                   DenseI32ArrayAttr:$hyper_kinds, DenseF64ArrayAttr:$hyper_defaults,
                   DenseF64ArrayAttr:$hyper_mins, DenseF64ArrayAttr:$hyper_maxs,
                   DenseI32ArrayAttr:$hyper_max_exclusive,
                   OptionalAttr<ArrayAttr>:$cpu_kernels,
                   OptionalAttr<ArrayAttr>:$gpu_kernels,
                   OptionalAttr<ArrayAttr>:$gpu_images);
  let assemblyFormat = "attr-dict";
  let hasVerifier = 1;
}

def ZK_PrepareOp : ZK_Op<"prepare", [Symbol, IsolatedFromAbove, SingleBlock,
                                      NoTerminator]> {
  let summary = "per-group coefficients, computed in f64 on the host";
  let description = [{
    ```mlir
    zk.prepare @adamw_prepare {
      %lr = zk.hyper 0
      %c = arith.truncf %lr : f64 to f32
      zk.set_coeff 0, %c : f32
    }
    ```
  }];
  let arguments = (ins SymbolNameAttr:$sym_name);
  let regions = (region SizedRegion<1>:$body);
  let assemblyFormat = "$sym_name attr-dict-with-keyword $body";
}

def ZK_HyperOp : ZK_Op<"hyper", [Pure, HasParent<"PrepareOp">]> {
  let summary = "the group's hyperparameter at descriptor slot `index`";
  let description = "```mlir\n%lr = zk.hyper 0\n```";
  let arguments = (ins I64Attr:$index);
  let results = (outs F64:$result);
  let assemblyFormat = "$index attr-dict";
}

def ZK_GlobalOp : ZK_Op<"global", [Pure, HasParent<"PrepareOp">]> {
  let summary = "the step-level scalar at zopt_global index `index`";
  let description = "```mlir\n%t = zk.global 0\n```";
  let arguments = (ins I64Attr:$index);
  let results = (outs F64:$result);
  let assemblyFormat = "$index attr-dict";
}

def ZK_SetCoeffOp : ZK_Op<"set_coeff", [HasParent<"PrepareOp">]> {
  let summary = "writes coefficient `index` (stored as f32)";
  let description = "```mlir\nzk.set_coeff 0, %c : f32\n```";
  let arguments = (ins I64Attr:$index, AnyFloat:$value);
  let assemblyFormat = "$index `,` $value attr-dict `:` type($value)";
}

def ZK_ControlOp : ZK_Op<"control", [Symbol, IsolatedFromAbove, SingleBlock,
                                      NoTerminator]> {
  let summary = "the step's control semantics: norm, clip, skip, loss scaler, counts";
  let description = [{
    What a step decides once it has its sum of squares (docs/NUMERICS.md
    sections 3, 5 and 6), written once: `zk.control_in` reads an input field
    of abi.h's `zopt_control` (the sum of squares, max_norm, the loss
    scaler's state and configuration), `zk.control_out` writes each output
    field exactly once (the norm, the clip coefficient, the skip, the
    scaler's next state, whether the step counts advance); the math between
    them is arith/math on scalars. `zopt-fuse` writes it from the step's
    flags; convert-zk-to-cpu lowers it to the host function of kernel role
    CONTROL, convert-zk-to-gpu inlines the same body into the SUMSQ
    kernel's last block (norm, clip, skip) and into FINISH (counts, scaler).
    ```mlir
    zk.control @sgd_control {
      %s = zk.control_in sumsq : f64
      %n = math.sqrt %s : f64
      zk.control_out norm, %n : f64
      ...
    }
    ```
  }];
  let arguments = (ins SymbolNameAttr:$sym_name);
  let regions = (region SizedRegion<1>:$body);
  let assemblyFormat = "$sym_name attr-dict-with-keyword $body";
  let hasRegionVerifier = 1;
  let extraClassDeclaration = [{
    /// The IR type of a field: f64, i64, or i1 for the u32 flags.
    static Type fieldType(MLIRContext *ctx, ControlField f);
    static bool isInput(ControlField f);
  }];
}

def ZK_ControlInOp : ZK_Op<"control_in", [Pure, HasParent<"ControlOp">]> {
  let summary = "an input field of zopt_control";
  let description = "```mlir\n%s = zk.control_in sumsq : f64\n```";
  let arguments = (ins ZK_ControlFieldAttr:$field);
  let results = (outs AnyTypeOf<[F64, I64, I1]>:$result);
  let assemblyFormat = "`` $field attr-dict `:` type($result)";
  let hasVerifier = 1;
}

def ZK_ControlOutOp : ZK_Op<"control_out", [HasParent<"ControlOp">]> {
  let summary = "writes an output field of zopt_control";
  let description = "```mlir\nzk.control_out norm, %n : f64\n```";
  let arguments = (ins ZK_ControlFieldAttr:$field, AnyTypeOf<[F64, I64, I1]>:$value);
  let assemblyFormat = "`` $field `,` $value attr-dict `:` type($value)";
  let hasVerifier = 1;
}

def ZK_KernelOp : ZK_Op<"kernel", [Symbol, IsolatedFromAbove, SingleBlock,
                                    NoTerminator]> {
  let summary = "an elementwise kernel body over one element";
  let description = [{
    Device codegen wraps the body in a loop over `n` elements of every
    state slot it loads or stores.
    ```mlir
    zk.kernel @sgd_update update {
      %p = zk.load 0 : f32
      %g = zk.load 1 : f32
      %lr = zk.coeff 0
      %d = arith.mulf %lr, %g : f32
      %p1 = arith.subf %p, %d : f32
      zk.store 0, %p1 : f32 into f32
    }
    ```
  }];
  let arguments = (ins SymbolNameAttr:$sym_name, ZK_KernelRoleAttr:$role);
  let regions = (region SizedRegion<1>:$body);
  let assemblyFormat = "$sym_name `` $role attr-dict-with-keyword $body";
  let hasRegionVerifier = 1;
}

def ZK_LoadOp : ZK_Op<"load", [HasParent<"KernelOp">,
                                MemoryEffects<[MemRead]>]> {
  let summary = "this element of state slot `slot`, in its storage type";
  let description = [{
    With `remainder_of = H`, slot `slot` holds the int16 low half of an f32
    master whose high half is the bf16 state at slot H (a remainder master,
    docs/NUMERICS.md §9): the result is the rebuilt f32 master,
    bits = (bits(H) << 16) + sext(low half), exactly.
    ```mlir
    %g = zk.load 1 : bf16
    %w = zk.load 3 {remainder_of = 0 : i64} : f32
    ```
    With `absmax = A` (a q8 moment, abi.h "q8 moments", docs/NUMERICS.md
    §10), slot `slot` holds 8-bit codes and slot A the f32 absmax of each
    block of 256 elements: the result is map[code] * absmax, with the
    unsigned map when `q8_unsigned` is set, else the signed one.
    ```mlir
    %m = zk.load 3 {absmax = 6 : i64} : f32
    ```
  }];
  let arguments = (ins I64Attr:$slot, OptionalAttr<I64Attr>:$remainder_of,
                   OptionalAttr<I64Attr>:$absmax, UnitAttr:$q8_unsigned);
  let results = (outs AnyFloat:$result);
  let assemblyFormat = "$slot attr-dict `:` type($result)";
  let hasVerifier = 1;
}

def ZK_StoreOp : ZK_Op<"store", [HasParent<"KernelOp">,
                                  MemoryEffects<[MemWrite]>]> {
  let summary = "stores into state slot `slot`, narrowing with `rounding`";
  let description = [{
    With `remainder_of = H` (storage i16, an f32 value): splits the new f32
    master into its bf16 high half, rounded to nearest with ties away from
    zero (a NaN: quiet, not rounded), stored into slot H (the param), and
    the int16 remainder (the low half: the signed difference of the master
    and that high half), stored into `slot` (docs/NUMERICS.md §9).
    ```mlir
    zk.store 0, %p1 : f32 into bf16
    zk.store 3, %w1 {remainder_of = 0 : i64} : f32 into i16
    ```
    With `absmax = A` (storage i8, a q8 moment): the new f32 moment joins
    its block, whose absmax (the max of |x| over the block's elements) is
    stored into slot A and whose elements are encoded into codes in slot
    `slot` (the unsigned map when `q8_unsigned`): see abi.h "q8 moments".
    ```mlir
    zk.store 3, %m1 {absmax = 6 : i64} : f32 into i8
    ```
    With `kahan = C` (a bf16 param, an f32 value v): the Kahan store of
    abi.h "Kahan-compensated params" (docs/NUMERICS.md §11): with p the
    param at `slot` and c the bf16 compensation at slot C, in f32,
    y = (v - p) + c; the param becomes bf16(p + y) and the compensation
    bf16(y - (bf16(p + y) - p)), both rounded to nearest even.
    ```mlir
    zk.store 0, %p1 {kahan = 5 : i64} : f32 into bf16
    ```
  }];
  let arguments = (ins I64Attr:$slot, AnyFloat:$value, TypeAttr:$storage,
                   DefaultValuedAttr<I32Attr, "ZOPT_ROUND_NEAREST_EVEN">:$rounding,
                   OptionalAttr<I64Attr>:$remainder_of,
                   OptionalAttr<I64Attr>:$absmax, UnitAttr:$q8_unsigned,
                   OptionalAttr<I64Attr>:$kahan);
  let assemblyFormat = "$slot `,` $value attr-dict `:` type($value) `into` $storage";
  let hasVerifier = 1;
}

def ZK_CoeffOp : ZK_Op<"coeff", [Pure, HasParent<"KernelOp">]> {
  let summary = "per-group coefficient `index` written by zk.prepare";
  let description = "```mlir\n%c = zk.coeff 3\n```";
  let arguments = (ins I64Attr:$index);
  let results = (outs F32:$result);
  let assemblyFormat = "$index attr-dict";
}

def ZK_AccumulateOp : ZK_Op<"accumulate_sumsq", [HasParent<"KernelOp">]> {
  let summary = "adds x*x (in f64) to the kernel's sum";
  let description = "```mlir\nzk.accumulate_sumsq %g : f32\n```";
  let arguments = (ins AnyFloat:$value);
  let assemblyFormat = "$value attr-dict `:` type($value)";
}

#endif
