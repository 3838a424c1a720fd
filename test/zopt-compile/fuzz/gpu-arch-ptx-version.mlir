// RUN: not zopt-compile %s --emit=ptx -o %t.ptx 2>&1 | FileCheck %s
// RUN: not zopt-compile %examples/adamw_bf16_gpu.mlir --gpu=sm_120 --emit=ptx -o %t.ptx 2>&1 | FileCheck %s --check-prefix=FLAG
// Found by zopt-fuzz-step: gpu_arch = "sm_120" verified, then LLVM's NVPTX
// backend stopped zopt-compile with a fatal error ("LLVM ERROR: PTX version
// 8.0 does not support target 'sm_120'"), since convert-zk-to-gpu asks for
// PTX 8.0 for every chip. Now refused up front with a located error.
// CHECK: gpu-arch-ptx-version.mlir:[[@LINE+3]]:1: error: 'zopt.step' op gpu_arch must name a CUDA architecture sm_70 or newer, like "sm_90" (got "sm_120"; known: sm_70, sm_72, sm_75, sm_80, sm_86, sm_87, sm_89, sm_90)
// CHECK-NOT: LLVM ERROR
// FLAG: unknown --gpu='sm_120'; expected CUDA architectures among sm_70, sm_72, sm_75, sm_80, sm_86, sm_87, sm_89, sm_90
zopt.step @adamw_bf16_gpu attributes {gpu_arch = "sm_120"} {
  %p = zopt.state param : bf16 on gpu
  %g = zopt.state grad : bf16 on gpu
  %w = zopt.state master : f32 on gpu
  %m = zopt.state exp_avg : f32 on gpu
  %v = zopt.state exp_avg_sq : f32 on gpu
  %lr = zopt.hyper lr
  %b1 = zopt.hyper beta1
  %b2 = zopt.hyper beta2
  %eps = zopt.hyper eps
  %wd = zopt.hyper weight_decay
  %m1 = zopt.ema %m, %g, %b1 : f32, bf16
  %v1 = zopt.ema_sq %v, %g, %b2 : f32, bf16
  %u = zopt.adam_direction %m1, %v1, %b1, %b2, %eps : f32, f32
  %w1 = zopt.decoupled_decay %w, %lr, %wd : f32
  %w2 = zopt.apply %w1, %u, %lr : f32, f32
  zopt.yield %w2, %m1, %v1, %w2 into %w, %m, %v, %p : f32, f32, f32, f32 into f32, f32, f32, bf16
}
