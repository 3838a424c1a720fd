//===- gpu-host-check.cpp - the runtime's host side of a GPU step ------------===//
//
//   zopt-gpu-host-check FAKE_DRIVER.so GPU_STEP.so [--big]
//   zopt-gpu-host-check FAKE_DRIVER.so OFFLOAD_STEP.so CPU_TWIN.so [--world=W [--pipeline [--tail]] |
//                                                                   --pipeline | --params-back | --tail]
//
// Runs a GPU step against libzopt-fake-cuda.so (set ZOPT_CUDA_DRIVER to the
// same path): "device" memory is host memory and kernels are only recorded,
// so this checks everything the runtime does around the kernels, on any
// machine: the image handed to cuModuleLoadData (uncompressed PTX, whose
// .param lists and .reqntid the stand-in enforces), the segment, state and
// chunk tables, the grids, the device-resident step state (globals table,
// loss scaler), the launch sequence of a step (PREPARE, SUMSQ, UPDATE,
// FINISH on the user's stream, with no host synchronisation, allocation or
// copy inside zopt_optimizer_step), hyperparameter writes, results read back
// on demand after the last step wherever it ran (a CUDA graph replayed on
// another stream, with hyperparameters changed between replays), devices and
// contexts, misaligned views, the driver version, launch errors, and GPU
// checkpoints. --big adds a tensor of more than 2^32 elements (reserved, not
// committed, by the stand-in). The numerics of the kernels are checked on a
// real GPU by zopt-gpu-check (test/Integration/CUDA).
//
// An offloaded step (params/grads on the GPU, states and kernels on the CPU)
// runs completely here: its "device" copies are memcpys and its kernels are
// CPU kernels. It is compared bit for bit with CPU_TWIN.so (the same
// description with everything on the CPU) over several steps with changing
// grads, a skipped step and a checkpoint, and its copies are counted.
// --pipeline: the same step with bucket readiness and speculation
// (gpu-host-pipeline.cpp) against the serial step and the twin.
// --params-back: the params' copies back per bucket, in forward order, and
// the per-bucket wait mode (gpu-host-params-back.cpp).
// --tail: per-bucket mode's tail after the step returns, its joins and its
// failures (gpu-host-tail.cpp); --world=W --pipeline --tail: the same at W
// ranks, each bucket's ALL_GATHER in the tail (gpu-host-offload.cpp).
//===----------------------------------------------------------------------===//
#include "gpu-host-check.h"

#include <dlfcn.h>

using namespace ghc;

int main(int argc, char **argv) {
  if (argc < 3 || argc > 7) {
    fprintf(stderr, "usage: zopt-gpu-host-check FAKE_DRIVER.so GPU_STEP.so [--big] | OFFLOAD_STEP.so CPU_TWIN.so "
                    "[--world=W [--pipeline [--tail]] | --pipeline | --params-back | --tail] (with "
                    "ZOPT_CUDA_DRIVER=FAKE_DRIVER.so)\n");
    return 2;
  }
  const char *env = getenv("ZOPT_CUDA_DRIVER");
  if (!env || strcmp(env, argv[1])) {
    fprintf(stderr, "ZOPT_CUDA_DRIVER must name the fake driver %s\n", argv[1]);
    return 2;
  }
  void *h = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
  if (!h) {
    fprintf(stderr, "dlopen: %s\n", dlerror());
    return 2;
  }
  Fake f;
#define SYM(field, name) *(void **)&f.field = dlsym(h, name)
  SYM(num_calls, "fake_cuda_num_calls");
  SYM(call, "fake_cuda_call");
  SYM(num_launches, "fake_cuda_num_launches");
  SYM(launch, "fake_cuda_launch");
  SYM(num_allocs, "fake_cuda_num_allocs");
  SYM(fail_next_launch, "fake_cuda_fail_next_launch");
  SYM(fail_memset, "fake_cuda_fail_memset");
  SYM(image_magic, "fake_cuda_image_magic");
  SYM(image_has_ptx, "fake_cuda_image_has_ptx");
  SYM(kernel_params, "fake_cuda_kernel_params");
  SYM(launch_context, "fake_cuda_launch_context");
  SYM(launch_nargs, "fake_cuda_launch_nargs");
  SYM(launch_replay, "fake_cuda_launch_replay");
  SYM(set_device_count, "fake_cuda_set_device_count");
  SYM(set_driver_version, "fake_cuda_set_driver_version");
  SYM(fail_attribute, "fake_cuda_fail_attribute");
  SYM(set_emulation, "fake_cuda_set_emulation");
  SYM(num_prepares, "fake_cuda_num_prepares");
  SYM(prepare_hypers, "fake_cuda_prepare_hypers");
  SYM(patch_params, "fake_cuda_patch_params");
  SYM(set_htod_delay, "fake_cuda_set_htod_delay");
  SYM(num_delayed_done, "fake_cuda_num_delayed_done");
  SYM(drain_all, "fake_cuda_drain_all");
  SYM(stream_enqueue, "fake_cuda_stream_enqueue");
  SYM(num_bad_ranges, "fake_cuda_num_bad_ranges");
  SYM(bad_range, "fake_cuda_bad_range");
  SYM(in_alloc, "fake_cuda_in_alloc");
  SYM(num_htod, "fake_cuda_num_htod");
  SYM(htod, "fake_cuda_htod");
  SYM(hold_htod, "fake_cuda_hold_htod");
  SYM(release_htod, "fake_cuda_release_htod");
  SYM(stall_htod, "fake_cuda_stall_htod");
  SYM(fail_htod, "fake_cuda_fail_htod");
  SYM(mem_alloc, "cuMemAlloc_v2");
  SYM(mem_free, "cuMemFree_v2");
  SYM(ctx_retain, "cuDevicePrimaryCtxRetain");
  SYM(ctx_push, "cuCtxPushCurrent_v2");
  SYM(ctx_pop, "cuCtxPopCurrent_v2");
  SYM(ctx_current, "cuCtxGetCurrent");
  SYM(stream_create, "cuStreamCreate");
  SYM(stream_query, "cuStreamQuery");
  SYM(mem_host_alloc, "cuMemHostAlloc");
  SYM(mem_free_host, "cuMemFreeHost");
  SYM(memcpy_dtoh_async, "cuMemcpyDtoHAsync_v2");
  SYM(begin_capture, "cuStreamBeginCapture_v2");
  SYM(end_capture, "cuStreamEndCapture");
  SYM(instantiate, "cuGraphInstantiateWithFlags");
  SYM(graph_launch, "cuGraphLaunch");
#undef SYM
  if (!f.num_calls || !f.launch || !f.mem_alloc || !f.set_emulation || !f.graph_launch || !f.num_bad_ranges ||
      !f.in_alloc || !f.hold_htod || !f.stall_htod || !f.fail_htod) {
    fprintf(stderr, "%s is not the fake driver\n", argv[1]);
    return 2;
  }

  zopt_step *step = nullptr;
  Z(zopt_step_load(argv[2], &step));
  const bool big = argc == 4 && !strcmp(argv[3], "--big");
  if (argc == 5 && !strcmp(argv[4], "--pipeline")) {
    pipeline_check(f, step, argv[3]);
  } else if (argc == 5 && !strcmp(argv[4], "--params-back")) {
    params_back_check(f, step, argv[3]);
  } else if (argc == 5 && !strcmp(argv[4], "--tail")) {
    tail_check(f, step, argv[3]);
  } else if (argc >= 5) {
    if (strncmp(argv[4], "--world=", 8) || atoi(argv[4] + 8) < 2 || argc > 7 ||
        (argc >= 6 && strcmp(argv[5], "--pipeline")) || (argc == 7 && strcmp(argv[6], "--tail"))) {
      fprintf(stderr, "expected --world=W (W >= 2) [--pipeline [--tail]], got %s\n", argv[4]);
      return 2;
    }
    offload_ranks_check(f, step, argv[2], argv[3], atoi(argv[4] + 8), argc >= 6, argc == 7);
  } else if (argc == 4 && !big) {
    offload_check(f, step, argv[3]);
  } else {
    gpu_main_check(f, step, argv[2]);
    driver_checks(f, step);
    device_checks(f, step);
    graph_checks(f, step);
    rebind_checks(f, step);
    active_checks(f, step);
    misaligned_checks(f, step);
    if (big) big_checks(f, step);
  }
  {
    const int nb = f.num_bad_ranges();
    check(nb == 0, "no copy or memset outside a device allocation (the stand-in refuses them)" +
                       (nb ? ": " + std::to_string(nb) + ", the first " + f.bad_range(0) : std::string()));
  }
  zopt_step_free(step);
  printf("%d passed, %d failed\n", passed, failed);
  return failed ? 1 : 0;
}

