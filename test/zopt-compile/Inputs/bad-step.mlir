zopt.step @bad {
  %p = zopt.state param : f32 on cpu
  %g = zopt.state grad : f32 on cpu
  %w = zopt.state master : bf16 on cpu
  %lr = zopt.hyper lr
  %w1 = zopt.apply %w, %g, %lr : bf16, f32
  zopt.yield %w1, %w1 into %w, %p : f32, f32 into bf16, f32
}
