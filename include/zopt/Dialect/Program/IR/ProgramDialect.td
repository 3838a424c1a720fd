//===- ProgramDialect.td - the step-program dialect (zprog) -*- tablegen -*-===//
#ifndef ZOPT_DIALECT_PROGRAM_PROGRAMDIALECT_TD
#define ZOPT_DIALECT_PROGRAM_PROGRAMDIALECT_TD

include "mlir/IR/OpBase.td"
include "zopt/Dialect/Zopt/IR/ZoptDialect.td"

def ZProg_Dialect : Dialect {
  let name = "zprog";
  let cppNamespace = "::mlir::zprog";
  let summary = "The step program: what one step does on every rank, in order";
  let description = [{
    The planner's output (`zopt-plan`), apart from the user's description
    dialect: one `zprog.program` per step, holding the collectives, copies,
    norm, update and bookkeeping ops of one step in the order every rank runs
    them (abi.h "The step program"). `zopt-emit-descriptor` writes it into
    the descriptor's program table, which the runtime's executor
    (runtime/src/exec/) runs as written. Its verifier enforces the order the
    executor relies on; docs/Dialects/Program.md lists the rules.
  }];
  let useDefaultAttributePrinterParser = 1;
  let dependentDialects = ["::mlir::zopt::ZoptDialect"];
}

// Like every zopt op, a zprog op refuses an attribute it does not declare:
// a misspelled `{unless_skiped}` must not silently run an op on a skipped
// step.
class ZProg_Op<string mnemonic, list<Trait> traits = []>
    : Op<ZProg_Dialect, mnemonic,
         !listconcat([Zopt_KnownAttributesOnly], traits)>;

#endif
