// mpi.cpp - zopt_comm_create_mpi: loads the MPI plugin (libzopt_comm_mpi.so,
// built against the system MPI by runtime/plugins/mpi/) and wraps its engine.
#include "comm_internal.h"
#include "mpi_plugin.h"

#include <dlfcn.h>

#include <cstdlib>
#include <mutex>
#include <string>

using namespace zopt;

namespace {

std::mutex g_mu;
zopt_comm_mpi_open_fn g_open = nullptr;  // the plugin stays loaded: MPI cannot be reloaded

std::string plugin_path() {
  const char *env = getenv("ZOPT_COMM_MPI_LIB");
  if (env && *env) return env;
  Dl_info info{};
  if (dladdr(reinterpret_cast<void *>(&zopt_comm_create_mpi), &info) && info.dli_fname) {
    std::string self = info.dli_fname;
    size_t slash = self.rfind('/');
    if (slash != std::string::npos) return self.substr(0, slash + 1) + ZOPT_COMM_MPI_PLUGIN_NAME;
  }
  return ZOPT_COMM_MPI_PLUGIN_NAME;
}

zopt_status load(zopt_comm_mpi_open_fn *out) {
  std::lock_guard<std::mutex> lk(g_mu);
  if (!g_open) {
    std::string path = plugin_path();
    // RTLD_GLOBAL: Open MPI's own components (dlopened by libmpi) resolve
    // libmpi's symbols globally.
    void *h = dlopen(path.c_str(), RTLD_NOW | RTLD_GLOBAL);
    if (!h) {
      const char *e = dlerror();
      return fail(ZOPT_ERR_UNSUPPORTED,
                  "zopt_comm_create_mpi: the MPI plugin cannot be loaded (%s). It is built next to "
                  "libzopt_runtime.so when CMake finds an MPI at build time (Debian: apt-get install "
                  "libopenmpi-dev openmpi-bin, then rebuild); $ZOPT_COMM_MPI_LIB names another copy",
                  e ? e : path.c_str());
    }
    auto fn = reinterpret_cast<zopt_comm_mpi_open_fn>(dlsym(h, ZOPT_COMM_MPI_ENTRY));
    if (!fn) {
      dlclose(h);
      return fail(ZOPT_ERR_UNSUPPORTED, "zopt_comm_create_mpi: %s does not export %s (not a zopt MPI plugin?)",
                  path.c_str(), ZOPT_COMM_MPI_ENTRY);
    }
    g_open = fn;
  }
  *out = g_open;
  return ZOPT_OK;
}

}  // namespace

ZOPT_API zopt_status zopt_comm_create_mpi(const void *mpi_comm, zopt_comm **out) {
  if (!out) return fail(ZOPT_ERR_INVALID_ARGUMENT, "zopt_comm_create_mpi: out is NULL");
  *out = nullptr;
  zopt_comm_mpi_open_fn open = nullptr;
  if (zopt_status st = load(&open)) return st;
  const zopt_comm_ops *ops = nullptr;
  void *ctx = nullptr;
  int rank = -1, size = 0;
  char err[1024] = "";
  int rc = open(ZOPT_COMM_MPI_PLUGIN_VERSION, mpi_comm, &ops, &ctx, &rank, &size, err, sizeof err);
  if (rc != ZOPT_OK) {
    if (rc < ZOPT_ERR_INVALID_ARGUMENT || rc > ZOPT_ERR_INTERNAL) rc = ZOPT_ERR_INTERNAL;
    return fail((zopt_status)rc, "zopt_comm_create_mpi: %s", err[0] ? err : "the MPI plugin failed");
  }
  zopt_status st = comm_create_internal(ops, ctx, rank, size, nullptr, out);
  if (st && ops && ops->destroy) ops->destroy(ctx);
  return st;
}
