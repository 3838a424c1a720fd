// cuda_driver.cpp - dlopen("libcuda.so.1") into a table of driver functions.
#include "backend/cuda/cuda_driver.h"

#include <dlfcn.h>

#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <string>

namespace zopt::cu {
namespace {

struct Loaded {
  Driver d;
  bool ok = false;
  std::string why;
};

Loaded *g_loaded = nullptr;

std::string describe(const Driver &d, CUresult r) {
  const char *s = nullptr;
  if (d.GetErrorString && d.GetErrorString(r, &s) == CUDA_SUCCESS && s)
    return std::string(s) + " (" + std::to_string(r) + ")";
  return "CUDA error " + std::to_string(r);
}

void load() {
  Loaded *L = new Loaded;
  g_loaded = L;
  const char *name = getenv("ZOPT_CUDA_DRIVER");
  if (!name || !*name) name = "libcuda.so.1";
  void *h = dlopen(name, RTLD_NOW | RTLD_LOCAL);
  if (!h) {
    const char *e = dlerror();
    L->why = std::string("no CUDA driver (") + name + ") on this machine: " + (e ? e : "dlopen failed");
    return;
  }
#define ZOPT_CU_RESOLVE(member, sym, type)                                          \
  L->d.member = reinterpret_cast<Driver::member##_fn>(dlsym(h, sym));                              \
  if (!L->d.member) {                                                               \
    L->why = std::string("CUDA driver ") + name + " lacks " + sym + " (too old?)";  \
    return;                                                                         \
  }
  ZOPT_CU_FUNCS(ZOPT_CU_RESOLVE)
#undef ZOPT_CU_RESOLVE
#define ZOPT_CU_RESOLVE_OPTIONAL(member, sym, type) \
  L->d.member = reinterpret_cast<Driver::member##_fn>(dlsym(h, sym));
  ZOPT_CU_OPTIONAL_FUNCS(ZOPT_CU_RESOLVE_OPTIONAL)
#undef ZOPT_CU_RESOLVE_OPTIONAL
  CUresult r = L->d.Init(0);
  if (r != CUDA_SUCCESS) {
    L->why = "CUDA driver present but cuInit failed (no usable CUDA device?): " + describe(L->d, r);
    return;
  }
  L->ok = true;  // the library stays loaded for the life of the process
}

}  // namespace

const Driver *driver(const char **why) {
  static std::once_flag once;
  std::call_once(once, load);
  if (g_loaded->ok) return &g_loaded->d;
  if (why) *why = g_loaded->why.c_str();
  return nullptr;
}

const char *error_string(CUresult r) {
  thread_local std::string s;
  const Driver *d = driver();
  s = d ? describe(*d, r) : "CUDA error " + std::to_string(r);
  return s.c_str();
}

}  // namespace zopt::cu
