//===- ZKDialect.td - the fused-kernel dialect (zk) --------*- tablegen -*-===//
#ifndef ZOPT_DIALECT_ZK_ZKDIALECT_TD
#define ZOPT_DIALECT_ZK_ZKDIALECT_TD

include "mlir/IR/OpBase.td"

def ZK_Dialect : Dialect {
  let name = "zk";
  let cppNamespace = "::mlir::zk";
  let summary = "Fused optimizer kernels, independent of the device";
  let description = [{
    The output of the fuse phase. A module holds one `zk.descriptor` (what
    the runtime must know: states, hyperparameter slots, flags), one
    `zk.prepare` (the per-group coefficient computation in f64, run on the
    host once per group and step), one `zk.control` (the step's control
    semantics: norm, clip coefficient, skip, loss scaler, counts; written
    once, lowered by every backend), and `zk.kernel`s: elementwise bodies over
    one element (`update`: one pass over memory doing the whole update;
    `sumsq`: the global-norm / non-finite reduction). Device codegen turns
    each kernel body into a loop at the target's vector width.
  }];
  let useDefaultAttributePrinterParser = 1;
  let dependentDialects = ["::mlir::arith::ArithDialect",
                           "::mlir::math::MathDialect"];
}

class ZK_Op<string mnemonic, list<Trait> traits = []>
    : Op<ZK_Dialect, mnemonic, traits>;

#endif
