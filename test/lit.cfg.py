# -*- Python -*-
import os
import lit.formats
from lit.llvm import llvm_config
from lit.llvm.subst import ToolSubst

config.name = "ZOPT"
config.test_format = lit.formats.ShTest(not llvm_config.use_lit_shell)
config.suffixes = [".mlir", ".test"]
config.test_source_root = os.path.dirname(__file__)
config.test_exec_root = os.path.join(config.zopt_obj_root, "test")
config.excludes = ["CMakeLists.txt", "lit.cfg.py", "lit.site.cfg.py", "Inputs", "README.md"]

config.substitutions.append(("%examples", os.path.join(config.zopt_src_root, "examples")))
config.substitutions.append(("%zopt_bin", config.zopt_tools_dir))
config.substitutions.append(("%zopt_src", config.zopt_src_root))

llvm_config.use_default_substitutions()
llvm_config.with_environment("PATH", config.llvm_tools_dir, append_path=True)
tool_dirs = [config.zopt_tools_dir, config.llvm_tools_dir]
llvm_config.add_tool_substitutions(["zopt-opt", "zopt-compile", "zopt-run"], tool_dirs)

# Features of this machine, for tests that execute code.
def cpu_has(flag):
    try:
        with open("/proc/cpuinfo") as f:
            return any(flag in line.split() for line in f if line.startswith("flags"))
    except OSError:
        return False
if cpu_has("avx2") and cpu_has("fma") and cpu_has("f16c"):
    config.available_features.add("cpu-avx2")
if all(cpu_has(x) for x in ("avx512f", "avx512bw", "avx512dq", "avx512vl")):
    config.available_features.add("cpu-avx512")
llvm_config.add_tool_substitutions(["zopt-kernel-check"], tool_dirs)
llvm_config.add_tool_substitutions(["zopt-q8-tables-check"], tool_dirs)

# The CUDA toolkit (ptxas, fatbinary, libdevice) for GPU code generation.
# lit scrubs the environment, so the path is passed explicitly to the tools
# (%cuda_root); tests that need it say `REQUIRES: cuda-toolkit`.
cuda_root = os.environ.get("CUDA_HOME") or "/usr/local/cuda"
if not os.path.exists(os.path.join(cuda_root, "bin", "ptxas")):
    cuda_root = "/usr/local/cuda"
config.substitutions.append(("%cuda_root", cuda_root))
config.substitutions.append(("%ptxas", os.path.join(cuda_root, "bin", "ptxas")))
if all(os.path.exists(os.path.join(cuda_root, p)) for p in
       ("bin/ptxas", "bin/fatbinary", "nvvm/libdevice/libdevice.10.bc")):
    config.available_features.add("cuda-toolkit")

# A usable CUDA GPU (driver + device) for tests that execute GPU steps: a
# tiny ctypes probe of libcuda (cuInit, cuDeviceGetCount). Tests that need
# it say `REQUIRES: cuda-gpu` and report UNSUPPORTED elsewhere, never pass.
def cuda_gpu_present():
    import ctypes
    try:
        cu = ctypes.CDLL("libcuda.so.1")
        if cu.cuInit(0) != 0:
            return False
        n = ctypes.c_int(0)
        return cu.cuDeviceGetCount(ctypes.byref(n)) == 0 and n.value > 0
    except (OSError, AttributeError):
        return False
if cuda_gpu_present():
    config.available_features.add("cuda-gpu")
llvm_config.add_tool_substitutions(["zopt-gpu-check", "zopt-gpu-host-check", "zopt-nccl-check", "zopt-backend-conformance", "zopt-linked-gpu-check",
                                   "zopt-zero-check", "zopt-ckpt-check", "zopt-ckpt-linked-check", "zopt-state-check", "zopt-coalesce-check",
                                   "zopt-q8-check", "zopt-bench-offload-pipeline"], tool_dirs)
# MPI (Open MPI's mpirun; as root it needs the allow-run-as-root flags, more
# ranks than cores --oversubscribe): multi-process tests say REQUIRES: mpi.
import shutil
if shutil.which("mpirun") and os.path.exists(os.path.join(config.zopt_obj_root, "lib", "libzopt_comm_mpi.so")):
    config.available_features.add("mpi")
# Under AddressSanitizer (scripts/sanitize.sh) the MPI processes run without
# leak detection: Open MPI's allocations outlive MPI_Finalize.
mpi_env = ""
if "ASAN_OPTIONS" in os.environ:
    mpi_env = "env ASAN_OPTIONS=" + os.environ["ASAN_OPTIONS"] + ":detect_leaks=0 "
config.substitutions.append(("%mpirun", mpi_env + "mpirun --allow-run-as-root --oversubscribe --mca btl self,vader "
                             "--mca btl_vader_single_copy_mechanism none --timeout 120"))
# The stand-in CUDA driver of test/Integration/GPUHost.
config.substitutions.append(("%fake_cuda", os.path.join(config.zopt_obj_root, "lib", "libzopt-fake-cuda.so")))
# Its asynchrony (fake-cuda.cpp "Asynchrony"): `ZOPT_FAKE_CUDA_STRESS=200 lit
# test/Integration/GPUHost` runs every stand-in test with every pinned copy
# queued and randomly delayed.
for var in ("ZOPT_FAKE_CUDA_ASYNC", "ZOPT_FAKE_CUDA_STRESS", "ZOPT_FAKE_CUDA_SEED"):
    if var in os.environ:
        config.environment[var] = os.environ[var]
# The stand-in NCCL (runtime/test/fake_nccl, soname libnccl.so.2).
fake_nccl = os.path.join(config.zopt_obj_root, "lib", "zopt_test_nccl", "libnccl.so.2")
config.substitutions.append(("%fake_nccl", fake_nccl))
if os.path.exists(fake_nccl):
    config.available_features.add("fake-nccl")
