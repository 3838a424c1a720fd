// zopt-state-check: the runtime owns all state (issue 17 item 3).
//
//   zopt-state-check STEP.so|DIR... [--world=W] [--dir=DIR] [--device-memory=FAKE.so]
//
// W ranks as loopback threads (W = 1: one rank without a communicator),
// each over its own copy of the model: tensors of awkward sizes (an empty
// one) in two groups over several buckets (states sharded under ZeRO-1/2/3),
// deterministic random params and per-rank gradients, never zero. Every
// state is read back whole (a collective gather; ZeRO-3 params through
// gather_params) with every count, hyperparameter, the scaler and the seed:
// a snapshot, compared bit for bit. Per step:
//  1. add: three tensors (one in a new group) added after 2 steps keep every
//     old state and count, start fresh (master = param, moments 0, count
//     0), and 3 more steps are bit-identical to an optimizer built with all
//     tensors (registered at once by add_tensors before finalize) into
//     which the old states were written;
//  2. add refused (bad entries; at W > 1 ranks adding different tensors;
//     during a begun step): the same error on every rank, nothing changed,
//     the next step runs;
//  3. export -> import equals save -> load: a rank's image is its file's
//     bytes (but the save identity); the set, the whole image and (every
//     saved state sharded) a rank's own image import bit-identically, also
//     into one rank; VALIDATE_ONLY changes nothing;
//  4. corrupt images (bad magic, flipped header or data byte, truncated,
//     extended, a newer version, an image of another export, one twice) are
//     refused like corrupt files, on every rank, nothing changed;
//  5. the staged import: every state put (as f32) with the counts, the
//     hyperparameters, the scaler and the seed restores the snapshot; a
//     partial one starts the rest fresh; bad calls leave it usable; abort
//     and a commit after tensors were added change nothing; ranks
//     importing other counts are refused on every rank.
// A GPU step (world size 1; against the stand-in driver) runs test_gpu:
// export, import and the staged import of states written through the API,
// a corrupt image refused, add_tensors after finalize refused.
// With --dir, test 3 also saves there; with --device-memory (and
// ZOPT_CUDA_DRIVER naming the same stand-in driver of test/Integration/
// GPUHost), the model lives in its "device" memory: offloaded steps run.
// Exit 77 when no step runs on this machine (GPU steps without a driver).
// The model, the ranks and the snapshots: state_test_util.h; tests 1, 2 in
// state_check_add.cpp, 3 to 5 in state_check_image.cpp.
#include "state_test_util.h"

#include "zopt/comm.h"
#include "zopt/zopt.h"

#include <dirent.h>
#include <dlfcn.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdarg>
#include <cstdlib>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace stt {

// ---- GPU steps ------------------------------------------------------------------------

bool gpu_step(const zopt_step_descriptor *d) {
  for (uint32_t k = 0; k < d->num_states; ++k)
    if (is_owned(d->states[k].kind) && d->states[k].placement == ZOPT_PLACE_GPU) return true;
  return false;
}

// A GPU step (against the stand-in driver its kernels are recorded, not
// run): states and counts written through the API, exported and imported
// (each kind of import), bit-identical; a corrupt image refused; adding
// tensors after finalize refused (UNSUPPORTED), nothing changed.
void test_gpu() {
  Rank A;
  int r = 0, id;
  RANK_CK(A.create(nullptr));
  A.grow(kOld, kOldG, 1);
  for (int gi = 0; gi < A.ngroups; ++gi) RANK_CK(zopt_optimizer_add_group(A.o, &id) == ZOPT_OK);
  for (size_t t = 0; t < kOld.size(); ++t)
    RANK_CK(zopt_optimizer_add_tensor(A.o, A.grp[t], A.p[t], A.g[t], A.n[t], (zopt_dtype)A.pdt, &id) == ZOPT_OK);
  A.reg = kOld.size();
  RANK_CK(zopt_optimizer_finalize(A.o) == ZOPT_OK && A.hypers());
  auto fill = [&](uint64_t seed, int64_t c0, double scale) {
    for (size_t t = 0; t < A.reg; ++t)
      for (uint32_t k = 0; k < A.d->num_states; ++k) {
        const zopt_state_desc &sd = A.d->states[k];
        if (!is_owned(sd.kind)) continue;
        const int64_t ne = selems(sd, A.n[t]);
        std::vector<unsigned char> b((size_t)ne * esz(sd.dtype) + 1);
        for (int64_t i = 0; i < ne; ++i) {
          const float v = value(seed, t * 16 + k, (uint64_t)i, 0.5);
          if (sd.dtype == ZOPT_DTYPE_Q8)  // a q8 code: any byte
            b[(size_t)i] = (unsigned char)(int)(v * 1000.0f);
          else  // (a q8 absmax: positive)
            store(b.data(), sd.dtype, (size_t)i, (sd.flags & ZOPT_STATE_PER_BLOCK) ? std::fabs(v) : v);
        }
        if (zopt_optimizer_write_state_raw(A.o, (int)t, (zopt_state_kind)sd.kind, b.data(), b.size() - 1)) return false;
      }
    return !zopt_optimizer_set_step_count(A.o, 0, c0) && !zopt_optimizer_set_step_count(A.o, 1, c0 + 2) &&
           !zopt_optimizer_set_loss_scaler_state(A.o, scale, c0 % 3) && !zopt_optimizer_set_seed(A.o, (uint64_t)c0);
  };
  RANK_CK(fill(9, 3, 512.0));
  Snap want, s;
  RANK_CK(A.snapshot(&want));
  const size_t T0 = A.reg;
  A.grow(kNew, kNewG, 5);
  const zopt_status added = A.add(T0);
  const std::string msg = zopt_last_error();
  RANK_CK(A.snapshot(&s));
  report(added == ZOPT_ERR_UNSUPPORTED && msg.find("GPU") != std::string::npos && s == want,
         "GPU step: add_tensors after finalize refused (UNSUPPORTED), nothing changed (%s)", msg.c_str());
  void *b = nullptr;
  size_t n = 0;
  RANK_CK(zopt_optimizer_export_state(A.o, &b, &n, 0) == ZOPT_OK);
  const std::vector<unsigned char> image = to_vec(b, n);
  RANK_CK(zopt_optimizer_export_state(A.o, &b, &n, ZOPT_EXPORT_WHOLE) == ZOPT_OK);
  const std::vector<unsigned char> whole = to_vec(b, n);
  std::vector<unsigned char> same = image;  // world size 1: the WHOLE image but the save identity
  if (same.size() == whole.size() && same.size() > ckt::kIdAt + 16) {
    memcpy(same.data() + ckt::kIdAt, whole.data() + ckt::kIdAt, 16);
    ckt::reseal(same);
  }
  bool ok = same == whole;
  RANK_CK(fill(11, 8, 4.0) && A.snapshot(&s) && s != want);
  RANK_CK(zopt_optimizer_import_state(A.o, image.data(), image.size(), 0) == ZOPT_OK && A.snapshot(&s));
  ok = ok && s == want;
  RANK_CK(fill(12, 9, 8.0));
  RANK_CK(zopt_optimizer_import_state(A.o, whole.data(), whole.size(), 0) == ZOPT_OK && A.snapshot(&s));
  ok = ok && s == want;
  report(ok, "GPU step: export -> import (its image, the WHOLE image): states, counts, scaler and seed "
             "bit-identical");
  RANK_CK(fill(13, 10, 16.0));
  zopt_state_import *imp = nullptr;
  RANK_CK(zopt_optimizer_import_begin(A.o, &imp) == ZOPT_OK);
  for (size_t t = 0; t < A.reg; ++t) {
    for (uint32_t k = 0; k < A.d->num_states; ++k) {
      const zopt_state_desc &sd = A.d->states[k];
      if (!is_owned(sd.kind)) continue;
      RANK_CK(zopt_state_import_put(imp, (int)t, (zopt_state_kind)sd.kind, (zopt_dtype)sd.dtype, want.st[t][k].data(),
                                    A.n[t]) == ZOPT_OK);
    }
    RANK_CK(zopt_state_import_set_tensor_step(imp, (int)t, want.steps[t]) == ZOPT_OK);
  }
  for (int gi = 0; gi < 2; ++gi)
    RANK_CK(zopt_state_import_set_group(imp, gi, want.gcounts[(size_t)gi], want.gflags[(size_t)gi]) == ZOPT_OK);
  RANK_CK(zopt_state_import_set_loss_scaler(imp, nullptr, want.scale, want.good) == ZOPT_OK);
  RANK_CK(zopt_state_import_set_seed(imp, want.seed) == ZOPT_OK);
  RANK_CK(zopt_state_import_commit(imp) == ZOPT_OK && A.snapshot(&s));
  report(s == want, "GPU step: the staged import (in the storage dtypes): bit-identical%s%s", s == want ? "" : ": ",
         diff(s, want).c_str());
  Snap before;
  RANK_CK(A.snapshot(&before));
  std::vector<unsigned char> bad = whole;
  bad[ckt::kNumGroupsAt + 9] ^= 4;
  const zopt_status st = zopt_optimizer_import_state(A.o, bad.data(), bad.size(), 0);
  RANK_CK(A.snapshot(&s));
  report(st == ZOPT_ERR_CHECKPOINT && s == before, "GPU step: a corrupt image refused, nothing changed");
}

// ---- the steps to run ----------------------------------------------------------

std::vector<std::string> collect(const std::vector<std::string> &args) {
  std::vector<std::string> out;
  for (const std::string &a : args) {
    if (DIR *dir = opendir(a.c_str())) {
      while (struct dirent *e = readdir(dir)) {
        std::string f = e->d_name;
        if (f.size() > 3 && f.compare(f.size() - 3, 3, ".so") == 0) out.push_back(a + "/" + f);
      }
      closedir(dir);
    } else {
      out.push_back(a);
    }
  }
  std::sort(out.begin(), out.end());
  return out;
}

}  // namespace stt

using namespace stt;

int main(int argc, char **argv) {
  std::vector<std::string> args;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a.rfind("--world=", 0) == 0) g_world = atoi(a.c_str() + 8);
    else if (a.rfind("--dir=", 0) == 0) g_dir = a.substr(6);
    else if (a.rfind("--device-memory=", 0) == 0) {
      // The stand-in driver (ZOPT_CUDA_DRIVER must name it too): the
      // model's memory from its cuMemAlloc.
      const std::string lib = a.substr(16);
      const char *env = getenv("ZOPT_CUDA_DRIVER");
      void *h = dlopen(lib.c_str(), RTLD_NOW | RTLD_LOCAL);
      if (!env || lib != env || !h) {
        fprintf(stderr, "zopt-state-check: --device-memory needs ZOPT_CUDA_DRIVER=%s (%s)\n", lib.c_str(),
                h ? "unset or another" : dlerror());
        return 2;
      }
      *(void **)&g_dev_alloc = dlsym(h, "cuMemAlloc_v2");
      *(void **)&g_dev_free = dlsym(h, "cuMemFree_v2");
      if (!g_dev_alloc || !g_dev_free) return 2;
    }
    else if (a[0] != '-') args.push_back(a);
    else {
      fprintf(stderr, "zopt-state-check: unknown argument '%s'\n", a.c_str());
      return 2;
    }
  }
  if (args.empty() && getenv("ZOPT_TEST_STEP")) args.push_back(getenv("ZOPT_TEST_STEP"));
  if (args.empty() || g_world < 1) {
    fprintf(stderr, "usage: zopt-state-check STEP.so|DIR... [--world=W] [--dir=DIR]\n");
    return 2;
  }
  if (!g_dir.empty()) mkdir(g_dir.c_str(), 0755);
  int ran = 0;
  for (const std::string &s : collect(args)) {
    g_step = s;
    g_name = s.substr(s.rfind('/') + 1);
    zopt_step *st = nullptr;
    zopt_optimizer *o = nullptr;
    if (zopt_step_load(s.c_str(), &st) || zopt_optimizer_create(st, &o)) {
      printf("SKIP %s: %s\n", g_name.c_str(), zopt_last_error());
      zopt_step_free(st);
      continue;
    }
    const bool gpu = gpu_step(zopt_step_get_descriptor(st));
    bool model_on_gpu = false;  // an offloaded step: params and grads in device memory
    for (uint32_t k = 0; k < zopt_step_get_descriptor(st)->num_states; ++k)
      model_on_gpu |= zopt_step_get_descriptor(st)->states[k].placement == ZOPT_PLACE_GPU;
    if (!gpu && model_on_gpu && !g_dev_alloc) {
      // A CUDA driver is present (create succeeded) but the model would be
      // host memory: only --device-memory gives the offloaded step its own.
      printf("SKIP %s: an offloaded step, whose params and grads are device memory: run it with "
             "--device-memory\n", g_name.c_str());
      zopt_optimizer_free(o);
      zopt_step_free(st);
      continue;
    }
    zopt_optimizer_free(o);
    zopt_step_free(st);
    ++ran;
    if (gpu) {  // world size 1
      test_gpu();
      continue;
    }
    test_add();
    test_add_refused();
    test_export_import();
    test_unhashed();
    test_corrupt();
    test_staged();
  }
  printf("%d passed, %d failed\n", g_pass, g_fail);
  if (!ran) return 77;
  return g_fail ? 1 : 0;
}
