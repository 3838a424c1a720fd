//===- zopt_run_device.h - device memory for zopt-run's GPU-placed tensors -===//
//
// A step whose params and grads are placed `on gpu` (an offloaded step)
// takes device pointers. zopt-run gets them from the CUDA driver the runtime
// uses (dlopen of ZOPT_CUDA_DRIVER, else libcuda.so.1; no link dependency):
// device 0's primary context made current, cuMemAlloc, cuMemcpyHtoD. On a
// machine without a GPU, ZOPT_CUDA_DRIVER names the stand-in driver
// (test/Integration/GPUHost's libzopt-fake-cuda.so: device memory is host
// memory), as scripts/main.sh does.
//
//===----------------------------------------------------------------------===//
#ifndef ZOPT_RUN_DEVICE_H
#define ZOPT_RUN_DEVICE_H

#include <cstddef>
#include <string>
#include <vector>

class RunDevice {
 public:
  ~RunDevice();
  // Loads the driver and makes device 0's primary context current; false
  // with *why (which driver, what failed) when there is none.
  bool open(std::string *why);
  // The driver's file name (ZOPT_CUDA_DRIVER or libcuda.so.1).
  const std::string &driver() const { return name_; }
  // `bytes` of device memory holding `host`'s bytes; NULL on failure
  // (*why set). Freed by the destructor.
  void *upload(const void *host, size_t bytes, std::string *why);
  // A new stream (cuStreamCreate; NULL on failure, *why set), destroyed by
  // the destructor; and a host wait for a stream's work (cuStreamSynchronize,
  // NULL: the legacy default stream; the CUDA error, 0 on success). The
  // benchmarks' simulated forward (bench/offload_pipeline_bench.cpp).
  void *new_stream(std::string *why);
  int sync(void *stream);

 private:
  struct Fns;
  void *lib_ = nullptr;
  Fns *f_ = nullptr;
  std::string name_;
  std::vector<unsigned long long> allocs_;
  std::vector<void *> streams_;
};

#endif
