//===- ZoptDialect.td - the user's declarative step --------*- tablegen -*-===//
#ifndef ZOPT_DIALECT_ZOPTDIALECT_TD
#define ZOPT_DIALECT_ZOPTDIALECT_TD

include "mlir/IR/OpBase.td"
include "mlir/IR/AttrTypeBase.td"

def Zopt_Dialect : Dialect {
  let name = "zopt";
  let cppNamespace = "::mlir::zopt";
  let summary = "Declarative description of a training optimizer step";
  let description = [{
    A `zopt.step` says *what* one optimizer step is: which states each
    parameter carries (param, grad, master, moments), their element type and
    placement, which hyperparameters arrive at run time per parameter group,
    and the update rule as a chain of per-element transformations. The body
    is a per-element program over "every element of every parameter":
    `zopt.state` values are that element of the state, `zopt.hyper` values
    are the element's group's hyperparameter (a runtime f64), and
    `zopt.yield` says which new value is stored into which state.

    The compiler lowers it in named phases (decompose, plan, fuse, codegen)
    into fused kernels; the plan phase writes the step's program in the
    zprog dialect beside it. See docs/Dialects/Zopt.md for the rules the
    verifier enforces. Every op refuses an attribute it does not declare
    (trait `Zopt_KnownAttributesOnly`: a misspelled `{decoupled}` is an
    error, not Adam with L2); attributes prefixed `zopt.` are the
    compiler's own records, set by its passes.
  }];
  let useDefaultAttributePrinterParser = 1;
  let dependentDialects = ["::mlir::arith::ArithDialect",
                           "::mlir::math::MathDialect"];
}

// Every zopt op refuses attributes it does not declare: a misspelled
// `{decoupled}` must not silently turn AdamW into Adam. Compiler-internal
// `zopt.`-prefixed attributes (set by the passes) are accepted
// (verifyKnownAttributes in ZoptVerify.cpp).
def Zopt_KnownAttributesOnly : NativeOpTrait<"KnownAttributesOnly"> {
  let cppNamespace = "::mlir::zopt";
}

class Zopt_Op<string mnemonic, list<Trait> traits = []>
    : Op<Zopt_Dialect, mnemonic, !listconcat([Zopt_KnownAttributesOnly], traits)>;

#endif
