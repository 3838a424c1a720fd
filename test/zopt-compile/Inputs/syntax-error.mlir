zopt.step @bad {
  %p = zopt.state param : f32 on cpu
  %g = zopt.state grad f32 on cpu
}
