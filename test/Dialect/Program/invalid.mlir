// RUN: zopt-opt %s --split-input-file --verify-diagnostics

// The zprog.program verifier: the order the runtime's executor relies on
// (docs/Dialects/Program.md). One case per rule.

// A program updates exactly once.
// expected-error@+1 {{'zprog.program' op has no zprog.update (a program updates once)}}
zprog.program for "p" {
  zprog.reduce_scatter grad : f32 accumulate f32
  zprog.prepare on cpu
  zprog.finish on cpu
}

// -----

// zprog.finish ends the program: the runtime's step is over after it.
zprog.program for "p" {
  zprog.reduce_scatter grad : f32 accumulate f32
  zprog.prepare on cpu
  zprog.update owned on cpu
  zprog.finish on cpu
  // expected-error@+1 {{'zprog.all_gather' op follows zprog.finish, which ends the program}}
  zprog.all_gather param : f32 unless_skipped
}

// -----

// The step's bookkeeping (step counts, loss scaler) is the last op.
// expected-error@+1 {{'zprog.program' op does not end with zprog.finish (the step's bookkeeping)}}
zprog.program for "p" {
  zprog.reduce_scatter grad : f32 accumulate f32
  zprog.prepare on cpu
  zprog.update owned on cpu
}

// -----

// A copy moves between the two placements.
zprog.program for "p" {
  // expected-error@+1 {{'zprog.copy' op copies from cpu to itself}}
  zprog.copy grad : f32 from cpu to cpu
  zprog.reduce_scatter grad : f32 accumulate f32
  zprog.prepare on cpu
  zprog.update owned on cpu
  zprog.finish on cpu
}

// -----

// States are stored as f32, bf16 or f16.
zprog.program for "p" {
  // expected-error@+1 {{'zprog.copy' op type must be f32, bf16 or f16}}
  zprog.copy grad : i32 from gpu to cpu
  zprog.reduce_scatter grad : f32 accumulate f32
  zprog.prepare on cpu
  zprog.update owned on cpu
  zprog.finish on cpu
}

// -----

// The runtime stages only the user's param and grad (offload).
zprog.program for "p" {
  // expected-error@+1 {{'zprog.copy' op copies the grad or the param only (the runtime stages them for an offloaded update)}}
  zprog.copy master : f32 from gpu to cpu
  zprog.reduce_scatter grad : f32 accumulate f32
  zprog.prepare on cpu
  zprog.update owned on cpu
  zprog.finish on cpu
}

// -----

// Copies in come before every other op: the reduction and the update read
// the staged copy.
zprog.program for "p" {
  zprog.reduce_scatter grad : f32 accumulate f32
  // expected-error@+1 {{'zprog.copy' op copies to the update's placement after other ops; copies in come first}}
  zprog.copy grad : f32 from gpu to cpu
  zprog.prepare on cpu
  zprog.update owned on cpu
  zprog.finish on cpu
}

// -----

// The grad is read, never written: it is not copied back.
zprog.program for "p" {
  zprog.copy grad : f32 from gpu to cpu
  zprog.reduce_scatter grad : f32 accumulate f32
  zprog.prepare on cpu
  zprog.update owned on cpu
  // expected-error@+1 {{'zprog.copy' op copies the grad back; the grad is read, never written}}
  zprog.copy grad : f32 from cpu to gpu
  zprog.finish on cpu
}

// -----

// The new params are copied out after the update wrote them.
zprog.program for "p" {
  zprog.copy grad : f32 from gpu to cpu
  zprog.reduce_scatter grad : f32 accumulate f32
  zprog.prepare on cpu
  // expected-error@+1 {{'zprog.copy' op copies the param out before the update wrote it}}
  zprog.copy param : f32 from cpu to gpu
  zprog.update owned on cpu
  zprog.finish on cpu
}

// -----

// The skip is decided at the norm, before the update: 'unless_skipped'
// before it would always run.
zprog.program for "p" {
  // expected-error@+1 {{'zprog.copy' op is 'unless_skipped' before the update; the skip is decided by the norm before the update, so only ops after it can depend on it}}
  zprog.copy grad : f32 from gpu to cpu unless_skipped
  zprog.reduce_scatter grad : f32 accumulate f32
  zprog.prepare on cpu
  zprog.update owned on cpu
  zprog.finish on cpu
}

// -----

// Only the gradient is reduced across ranks.
zprog.program for "p" {
  // expected-error@+1 {{'zprog.reduce_scatter' op reduces the grad only (got 'param')}}
  zprog.reduce_scatter param : f32 accumulate f32
  zprog.prepare on cpu
  zprog.update owned on cpu
  zprog.finish on cpu
}

// -----

// The reduction adds in f32 (abi.h: the rank-order f32 sum).
zprog.program for "p" {
  // expected-error@+1 {{'zprog.reduce_scatter' op moves f32, bf16 or f16 values and accumulates in f32}}
  zprog.reduce_scatter grad : bf16 accumulate bf16
  zprog.prepare on cpu
  zprog.update owned on cpu
  zprog.finish on cpu
}

// -----

// The gradient is reduced before the norm and the update read it.
zprog.program for "p" {
  zprog.reduce_scatter grad : f32 accumulate f32
  zprog.prepare on cpu
  zprog.update owned on cpu
  // expected-error@+1 {{'zprog.reduce_scatter' op must come before the norm and the update}}
  zprog.reduce_scatter grad : f32 accumulate f32
  zprog.finish on cpu
}

// -----

// One reduction per step: a second would add the ranks' sums again.
zprog.program for "p" {
  // expected-note@+1 {{first here}}
  zprog.reduce_scatter grad : f32 accumulate f32
  // expected-error@+1 {{'zprog.reduce_scatter' op appears twice in the program}}
  zprog.reduce_scatter grad : f32 accumulate f32
  zprog.prepare on cpu
  zprog.update owned on cpu
  zprog.finish on cpu
}

// -----

// The norm and the update read the reduced gradient: without a
// reduce_scatter each rank would use its own.
zprog.program for "p" {
  zprog.prepare on cpu
  // expected-error@+1 {{'zprog.update' op needs zprog.reduce_scatter of the grad before it (the gradient is reduced across ranks before it is read; on one rank it does nothing)}}
  zprog.update owned on cpu
  zprog.finish on cpu
}

// -----

// Over every element, the reduced gradient is gathered first (each rank
// holds only its shards of it after the reduce_scatter).
zprog.program for "p" {
  zprog.reduce_scatter grad : f32 accumulate f32
  zprog.prepare on cpu
  // expected-error@+1 {{'zprog.update' op needs zprog.all_gather of the grad before it: it covers every element, and after the reduce_scatter each rank holds only its shards of the reduced gradient}}
  zprog.update all on cpu
  zprog.finish on cpu
}

// -----

// The same for the norm's partials over every element.
zprog.program for "p" {
  zprog.reduce_scatter grad : f32 accumulate f32
  zprog.prepare on cpu
  // expected-error@+1 {{'zprog.norm_partials' op needs zprog.all_gather of the grad before it: it covers every element, and after the reduce_scatter each rank holds only its shards of the reduced gradient}}
  zprog.norm_partials all on cpu
  zprog.norm
  zprog.all_gather grad : f32
  zprog.update all on cpu
  zprog.finish on cpu
}

// -----

// Gathering the grad gathers its reduced shards.
zprog.program for "p" {
  // expected-error@+1 {{'zprog.all_gather' op needs zprog.reduce_scatter of the grad before it (it gathers the reduced shards)}}
  zprog.all_gather grad : f32
  zprog.reduce_scatter grad : f32 accumulate f32
  zprog.prepare on cpu
  zprog.update all on cpu
  zprog.finish on cpu
}

// -----

// The gathered grad is what the update reads: it comes before it.
zprog.program for "p" {
  zprog.reduce_scatter grad : f32 accumulate f32
  zprog.prepare on cpu
  zprog.update owned on cpu
  // expected-error@+1 {{'zprog.all_gather' op gathers the grad after the norm or the update read it}}
  zprog.all_gather grad : f32
  zprog.finish on cpu
}

// -----

// One gather of the grad.
zprog.program for "p" {
  zprog.reduce_scatter grad : f32 accumulate f32
  // expected-note@+1 {{first here}}
  zprog.all_gather grad : f32
  // expected-error@+1 {{'zprog.all_gather' op appears twice in the program}}
  zprog.all_gather grad : f32
  zprog.prepare on cpu
  zprog.update all on cpu
  zprog.finish on cpu
}

// -----

// 'unless_skipped' on the grad's gather, before the skip is known.
zprog.program for "p" {
  zprog.reduce_scatter grad : f32 accumulate f32
  // expected-error@+1 {{'zprog.all_gather' op is 'unless_skipped' before the update; the skip is decided by the norm before the update, so only ops after it can depend on it}}
  zprog.all_gather grad : f32 unless_skipped
  zprog.prepare on cpu
  zprog.update all on cpu
  zprog.finish on cpu
}

// -----

// The params are gathered after the update wrote them.
zprog.program for "p" {
  zprog.reduce_scatter grad : f32 accumulate f32
  zprog.prepare on cpu
  // expected-error@+1 {{'zprog.all_gather' op gathers the param before the update wrote it}}
  zprog.all_gather param : f32
  zprog.update owned on cpu
  zprog.finish on cpu
}

// -----

// One gather of the params.
zprog.program for "p" {
  zprog.reduce_scatter grad : f32 accumulate f32
  zprog.prepare on cpu
  zprog.update owned on cpu
  // expected-note@+1 {{first here}}
  zprog.all_gather param : f32
  // expected-error@+1 {{'zprog.all_gather' op appears twice in the program}}
  zprog.all_gather param : f32
  zprog.finish on cpu
}

// -----

// Optimizer states are never gathered (ZeRO keeps them sharded).
zprog.program for "p" {
  zprog.reduce_scatter grad : f32 accumulate f32
  zprog.prepare on cpu
  zprog.update owned on cpu
  // expected-error@+1 {{'zprog.all_gather' op gathers the grad or the param only}}
  zprog.all_gather master : f32
  zprog.finish on cpu
}

// -----

// Every op but a copy runs where the update runs.
zprog.program for "p" {
  zprog.reduce_scatter grad : f32 accumulate f32
  // expected-error@+1 {{'zprog.prepare' op runs on gpu, but the update runs on cpu (only copies move between placements)}}
  zprog.prepare on gpu
  zprog.update owned on cpu
  zprog.finish on cpu
}

// -----

// The same for the bookkeeping.
zprog.program for "p" {
  zprog.reduce_scatter grad : f32 accumulate f32
  zprog.prepare on cpu
  zprog.update owned on cpu
  // expected-error@+1 {{'zprog.finish' op runs on gpu, but the update runs on cpu (only copies move between placements)}}
  zprog.finish on gpu
}

// -----

// One coefficient table per step.
zprog.program for "p" {
  zprog.reduce_scatter grad : f32 accumulate f32
  // expected-note@+1 {{first here}}
  zprog.prepare on cpu
  // expected-error@+1 {{'zprog.prepare' op appears twice in the program}}
  zprog.prepare on cpu
  zprog.update owned on cpu
  zprog.finish on cpu
}

// -----

// The norm recomputes the table with the clip coefficient, so prepare
// comes before the partials.
zprog.program for "p" {
  zprog.reduce_scatter grad : f32 accumulate f32
  // expected-error@+1 {{'zprog.norm_partials' op needs zprog.prepare before it (the sum of squares reads the coefficient table)}}
  zprog.norm_partials owned on cpu
  zprog.prepare on cpu
  zprog.norm
  zprog.update owned on cpu
  zprog.finish on cpu
}

// -----

// One norm per step (the runtime splits the step at it).
zprog.program for "p" {
  zprog.reduce_scatter grad : f32 accumulate f32
  zprog.prepare on cpu
  // expected-note@+1 {{first here}}
  zprog.norm_partials owned on cpu
  // expected-error@+1 {{'zprog.norm_partials' op appears twice in the program}}
  zprog.norm_partials owned on cpu
  zprog.norm
  zprog.update owned on cpu
  zprog.finish on cpu
}

// -----

// The norm decides the update: its partials come before it.
zprog.program for "p" {
  zprog.reduce_scatter grad : f32 accumulate f32
  zprog.prepare on cpu
  zprog.update owned on cpu
  // expected-error@+1 {{'zprog.norm_partials' op must come before the update}}
  zprog.norm_partials owned on cpu
  zprog.norm
  zprog.finish on cpu
}

// -----

// zprog.norm adds the partials.
zprog.program for "p" {
  zprog.reduce_scatter grad : f32 accumulate f32
  zprog.prepare on cpu
  // expected-error@+1 {{'zprog.norm' op needs zprog.norm_partials before it}}
  zprog.norm
  zprog.update owned on cpu
  zprog.finish on cpu
}

// -----

// One norm.
zprog.program for "p" {
  zprog.reduce_scatter grad : f32 accumulate f32
  zprog.prepare on cpu
  zprog.norm_partials owned on cpu
  // expected-note@+1 {{first here}}
  zprog.norm
  // expected-error@+1 {{'zprog.norm' op appears twice in the program}}
  zprog.norm
  zprog.update owned on cpu
  zprog.finish on cpu
}

// -----

// Partials without the norm: the update would not wait for the decision.
zprog.program for "p" {
  zprog.reduce_scatter grad : f32 accumulate f32
  zprog.prepare on cpu
  zprog.norm_partials owned on cpu
  // expected-error@+1 {{'zprog.update' op needs zprog.norm after zprog.norm_partials}}
  zprog.update owned on cpu
  zprog.finish on cpu
}

// -----

// The norm comes before the update (run_begin stops at the norm).
zprog.program for "p" {
  zprog.reduce_scatter grad : f32 accumulate f32
  zprog.prepare on cpu
  zprog.norm_partials owned on cpu
  // expected-error@+1 {{'zprog.update' op needs zprog.norm after zprog.norm_partials}}
  zprog.update owned on cpu
  zprog.norm
  zprog.finish on cpu
}

// -----

// The update reads the coefficient table.
zprog.program for "p" {
  zprog.reduce_scatter grad : f32 accumulate f32
  // expected-error@+1 {{'zprog.update' op needs zprog.prepare before it}}
  zprog.update owned on cpu
  zprog.prepare on cpu
  zprog.finish on cpu
}

// -----

// One update per step.
zprog.program for "p" {
  zprog.reduce_scatter grad : f32 accumulate f32
  zprog.prepare on cpu
  // expected-note@+1 {{first here}}
  zprog.update owned on cpu
  // expected-error@+1 {{'zprog.update' op appears twice in the program}}
  zprog.update owned on cpu
  zprog.finish on cpu
}

// -----

// Only zprog ops make a program.
zprog.program for "p" {
  zprog.reduce_scatter grad : f32 accumulate f32
  zprog.prepare on cpu
  zprog.update owned on cpu
  // expected-error@+1 {{'arith.constant' op is not a step-program op}}
  %c = arith.constant 1.0 : f32
  zprog.finish on cpu
}

// -----

// A misspelled attribute is an error, not an op that runs on skipped steps
// (every zprog op refuses attributes it does not declare).
zprog.program for "p" {
  zprog.reduce_scatter grad : f32 accumulate f32
  zprog.prepare on cpu
  zprog.update owned on cpu
  // expected-error@+1 {{'zprog.all_gather' op unknown attribute 'unless_skiped'; did you mean 'unless_skipped'?}}
  zprog.all_gather param : f32 {unless_skiped}
  zprog.finish on cpu
}

// -----

// Program ops live in a program.
// expected-error@+1 {{'zprog.norm' op expects parent op 'zprog.program'}}
zprog.norm
