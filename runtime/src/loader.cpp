// loader.cpp - zopt_step_load: dlopen a step.so, validate its descriptor,
// resolve its kernels and pick the best ISA variant for this CPU.
#include "internal.h"
#include "zopt/cpu.h"

#include <dlfcn.h>
#include <link.h>
#include <sys/stat.h>
#include <cerrno>
#include <cstdio>
#include <elf.h>
#include <cmath>
#include <cstdlib>

using namespace zopt;

namespace {

bool nul_terminated(const char *s, size_t n) { return memchr(s, 0, n) != nullptr; }

// q8 moments (abi.h "q8 moments"): a Q8 code state is an EXP_AVG or
// EXP_AVG_SQ with its f32 PER_BLOCK absmax of the same placement, access,
// init and partitioning, and nothing else is PER_BLOCK. On the CPU and in
// offloaded steps they run; on the CUDA backend (a q8 state or any kernel
// on the GPU) only with ZOPT_EXPERIMENTAL_GPU_Q8=1 until a real GPU has
// checked its q8 kernels bit for bit against the CPU's (docs/GPU.md "q8
// moments on the GPU").
zopt_status validate_q8(const zopt_step_descriptor *d) {
  bool any = false, gpu = false;
  for (uint32_t i = 0; i < d->num_states; ++i) {
    const zopt_state_desc &s = d->states[i];
    const bool absmax = s.kind == ZOPT_STATE_EXP_AVG_ABSMAX || s.kind == ZOPT_STATE_EXP_AVG_SQ_ABSMAX;
    if (absmax != ((s.flags & ZOPT_STATE_PER_BLOCK) != 0) || (absmax && s.dtype != ZOPT_DTYPE_F32))
      return fail(ZOPT_ERR_ABI, "state %u (%s): a q8 absmax is exactly an f32 PER_BLOCK state", i,
                  state_kind_name(s.kind));
    if (s.dtype == ZOPT_DTYPE_Q8 && s.kind != ZOPT_STATE_EXP_AVG && s.kind != ZOPT_STATE_EXP_AVG_SQ)
      return fail(ZOPT_ERR_ABI, "state %u (%s): only exp_avg and exp_avg_sq can be q8", i, state_kind_name(s.kind));
    if (s.dtype != ZOPT_DTYPE_Q8 && !absmax) continue;
    any = true;
    gpu |= s.placement == ZOPT_PLACE_GPU;
    // The partner: the absmax of a q8 moment, the q8 moment of an absmax.
    const uint32_t want = s.kind == ZOPT_STATE_EXP_AVG       ? ZOPT_STATE_EXP_AVG_ABSMAX
                          : s.kind == ZOPT_STATE_EXP_AVG_SQ  ? ZOPT_STATE_EXP_AVG_SQ_ABSMAX
                          : s.kind == ZOPT_STATE_EXP_AVG_ABSMAX ? ZOPT_STATE_EXP_AVG
                                                                : ZOPT_STATE_EXP_AVG_SQ;
    const zopt_state_desc *q = nullptr;
    for (uint32_t j = 0; j < d->num_states; ++j)
      if (d->states[j].kind == want) q = &d->states[j];
    if (!q || (absmax && q->dtype != ZOPT_DTYPE_Q8) || q->placement != s.placement || q->access != s.access ||
        q->init != s.init || (q->flags & ZOPT_STATE_PARTITIONED) != (s.flags & ZOPT_STATE_PARTITIONED))
      return fail(ZOPT_ERR_ABI,
                  "state %u (%s): a q8 moment and its absmax come in pairs of the same placement, access, init "
                  "and partitioning (abi.h \"q8 moments\"); %s %s",
                  i, state_kind_name(s.kind), state_kind_name(want), q ? "differs" : "is missing");
  }
  if (!any) return ZOPT_OK;
  // The CUDA backend (a q8 state or any kernel on the GPU) is refused; an
  // offloaded step (only the param and grad on the GPU, every kernel and
  // the q8 states on the CPU: docs/GPU.md "Offloaded steps") runs.
  for (uint32_t i = 0; i < d->num_kernels; ++i) gpu |= d->kernels[i].device == ZOPT_PLACE_GPU;
  const char *gate = getenv("ZOPT_EXPERIMENTAL_GPU_Q8");
  if (gpu && !(gate && !strcmp(gate, "1")))
    return fail(ZOPT_ERR_UNSUPPORTED,
                "step '%s' has q8 moments and runs on the GPU (a q8 state or a kernel placed there: the CUDA "
                "backend): its q8 kernels have not yet been checked bit for bit against the CPU's on a real GPU, "
                "so the CUDA backend takes such a step only with ZOPT_EXPERIMENTAL_GPU_Q8=1 (docs/GPU.md \"q8 "
                "moments on the GPU\"); otherwise compile the moments as f32 or bf16 for the GPU, or keep them "
                "on the CPU (the whole step, or offloaded: only param and grad on the GPU)",
                d->name);
  return ZOPT_OK;
}

// Validates every field of a descriptor whose magic/version/size/checksum
// already passed. Returns ZOPT_OK or an ABI error with a message.
zopt_status validate_fields(const zopt_step_descriptor *d) {
  if (!nul_terminated(d->name, ZOPT_NAME_LEN))
    return fail(ZOPT_ERR_ABI, "descriptor name is not NUL-terminated");
  if (d->zero_stage > 3)
    return fail(ZOPT_ERR_ABI, "descriptor zero_stage %u out of range [0, 3]", d->zero_stage);
  if (d->align == 0 || (d->align & (d->align - 1)) || d->align > (1u << 20))
    return fail(ZOPT_ERR_ABI, "descriptor align %u is not a power of two <= 2^20", d->align);
  const uint32_t known = ZOPT_FLAG_CLIP | ZOPT_FLAG_LOSS_SCALE | ZOPT_FLAG_SUMSQ | ZOPT_FLAG_STOCHASTIC |
                         ZOPT_FLAG_NESTEROV | ZOPT_FLAG_DECOUPLED_DECAY | ZOPT_FLAG_RULE_STATED |
                         ZOPT_FLAG_FINISH_GRID;
  if (d->flags & ~known)
    return fail(ZOPT_ERR_ABI, "descriptor has unknown flags 0x%x", d->flags & ~known);
  if ((d->flags & (ZOPT_FLAG_CLIP | ZOPT_FLAG_LOSS_SCALE)) && !(d->flags & ZOPT_FLAG_SUMSQ))
    return fail(ZOPT_ERR_ABI, "descriptor needs a SUMSQ kernel for clipping/loss scaling");
  if ((d->flags & (ZOPT_FLAG_NESTEROV | ZOPT_FLAG_DECOUPLED_DECAY)) && !(d->flags & ZOPT_FLAG_RULE_STATED))
    return fail(ZOPT_ERR_ABI, "descriptor has rule flags 0x%x without RULE_STATED",
                d->flags & (ZOPT_FLAG_NESTEROV | ZOPT_FLAG_DECOUPLED_DECAY));
  if ((d->flags & ZOPT_FLAG_CLIP) && !(std::isfinite(d->max_norm) && d->max_norm > 0))
    return fail(ZOPT_ERR_ABI, "descriptor max_norm %g must be finite and > 0", d->max_norm);
  if (d->num_states < 2 || d->num_states > ZOPT_MAX_STATES)
    return fail(ZOPT_ERR_ABI, "descriptor num_states %u out of range [2, %d]", d->num_states, ZOPT_MAX_STATES);
  if (d->num_hypers > ZOPT_MAX_HYPERS)
    return fail(ZOPT_ERR_ABI, "descriptor num_hypers %u > %d", d->num_hypers, ZOPT_MAX_HYPERS);
  if (d->num_coeffs > ZOPT_MAX_COEFFS)
    return fail(ZOPT_ERR_ABI, "descriptor num_coeffs %u > %d", d->num_coeffs, ZOPT_MAX_COEFFS);
  if (d->num_kernels < 1 || d->num_kernels > ZOPT_MAX_KERNELS)
    return fail(ZOPT_ERR_ABI, "descriptor num_kernels %u out of range [1, %d]", d->num_kernels, ZOPT_MAX_KERNELS);
  int seen_kind[ZOPT_STATE_KAHAN_COMP + 1] = {0};
  for (uint32_t i = 0; i < d->num_states; ++i) {
    const zopt_state_desc &s = d->states[i];
    if (s.kind < ZOPT_STATE_PARAM || s.kind > ZOPT_STATE_KAHAN_COMP)
      return fail(ZOPT_ERR_ABI, "state %u: kind %u out of range", i, s.kind);
    if (!dtype_size(s.dtype))
      return fail(ZOPT_ERR_ABI, "state %u (%s): dtype %u out of range", i, state_kind_name(s.kind), s.dtype);
    if (s.placement != ZOPT_PLACE_CPU && s.placement != ZOPT_PLACE_GPU)
      return fail(ZOPT_ERR_ABI, "state %u (%s): placement %u out of range", i, state_kind_name(s.kind), s.placement);
    if (s.rounding != ZOPT_ROUND_NEAREST_EVEN && s.rounding != ZOPT_ROUND_STOCHASTIC)
      return fail(ZOPT_ERR_ABI, "state %u (%s): rounding %u out of range", i, state_kind_name(s.kind), s.rounding);
    if (s.init < ZOPT_INIT_USER || s.init > ZOPT_INIT_FROM_PARAM)
      return fail(ZOPT_ERR_ABI, "state %u (%s): init %u out of range", i, state_kind_name(s.kind), s.init);
    if (s.access & ~(ZOPT_ACCESS_READ | ZOPT_ACCESS_WRITE))
      return fail(ZOPT_ERR_ABI, "state %u (%s): access bits 0x%x out of range", i, state_kind_name(s.kind), s.access);
    bool user = s.kind == ZOPT_STATE_PARAM || s.kind == ZOPT_STATE_GRAD;
    if (user != (s.init == ZOPT_INIT_USER))
      return fail(ZOPT_ERR_ABI, "state %u (%s): init %u does not fit the kind", i, state_kind_name(s.kind), s.init);
    if (s.flags & ~(ZOPT_STATE_PARTITIONED | ZOPT_STATE_PER_BLOCK) || s.reserved)
      return fail(ZOPT_ERR_ABI, "state %u (%s): unknown flags 0x%x", i, state_kind_name(s.kind), s.flags);
    if (seen_kind[s.kind]++)
      return fail(ZOPT_ERR_ABI, "descriptor has more than one %s state", state_kind_name(s.kind));
  }
  if (seen_kind[ZOPT_STATE_PARAM] != 1 || seen_kind[ZOPT_STATE_GRAD] != 1)
    return fail(ZOPT_ERR_ABI, "descriptor needs exactly one param and one grad state");
  // A Kahan param's compensation (abi.h "Kahan-compensated params").
  for (uint32_t i = 0; i < d->num_states; ++i) {
    const zopt_state_desc &s = d->states[i];
    if (s.kind != ZOPT_STATE_KAHAN_COMP) continue;
    const zopt_state_desc *p = nullptr;
    for (uint32_t j = 0; j < d->num_states; ++j)
      if (d->states[j].kind == ZOPT_STATE_PARAM) p = &d->states[j];
    if (s.dtype != ZOPT_DTYPE_BF16 || s.init != ZOPT_INIT_ZERO ||
        s.access != (ZOPT_ACCESS_READ | ZOPT_ACCESS_WRITE) || p->dtype != ZOPT_DTYPE_BF16 ||
        p->placement != s.placement || !(p->access & ZOPT_ACCESS_WRITE) || seen_kind[ZOPT_STATE_MASTER])
      return fail(ZOPT_ERR_ABI,
                  "state %u (kahan_comp): a Kahan compensation is bf16, zero-initialized, read and "
                  "written, beside a written bf16 param on its placement, in a step without a master",
                  i);
  }
  if (zopt_status st = validate_q8(d)) return st;
  int seen_hyper[9] = {0};
  for (uint32_t i = 0; i < d->num_hypers; ++i) {
    const zopt_hyper_desc &h = d->hypers[i];
    if (h.kind < ZOPT_HYPER_LR || h.kind > ZOPT_HYPER_BIAS_CORRECTION)
      return fail(ZOPT_ERR_ABI, "hyper %u: kind %u out of range", i, h.kind);
    if (seen_hyper[h.kind]++)
      return fail(ZOPT_ERR_ABI, "descriptor has more than one %s hyper", hyper_name(h.kind));
    if (h.max_exclusive > 1)
      return fail(ZOPT_ERR_ABI, "hyper %s: max_exclusive %u is not 0/1", hyper_name(h.kind), h.max_exclusive);
    if (std::isnan(h.min_value) || std::isnan(h.max_value) || !(h.min_value <= h.max_value))
      return fail(ZOPT_ERR_ABI, "hyper %s: bad range [%g, %g]", hyper_name(h.kind), h.min_value, h.max_value);
    bool ok = std::isfinite(h.default_value) && h.default_value >= h.min_value &&
              (h.max_exclusive ? h.default_value < h.max_value : h.default_value <= h.max_value);
    if (!ok)
      return fail(ZOPT_ERR_ABI, "hyper %s: default %g outside its range", hyper_name(h.kind), h.default_value);
  }
  int nsumsq = 0;
  for (uint32_t i = 0; i < d->num_kernels; ++i) {
    const zopt_kernel_desc &k = d->kernels[i];
    if (k.device != ZOPT_PLACE_CPU && k.device != ZOPT_PLACE_GPU)
      return fail(ZOPT_ERR_ABI, "kernel %u: device %u out of range", i, k.device);
    if (k.device == ZOPT_PLACE_CPU) {
      if ((k.role < ZOPT_KERNEL_PREPARE || k.role > ZOPT_KERNEL_SUMSQ) && k.role != ZOPT_KERNEL_CONTROL)
        return fail(ZOPT_ERR_ABI, "kernel %u: role %u out of range", i, k.role);
      if ((k.role == ZOPT_KERNEL_PREPARE || k.role == ZOPT_KERNEL_CONTROL) && k.isa != ZOPT_ISA_NONE)
        return fail(ZOPT_ERR_ABI, "kernel %u: a %s kernel is baseline x86-64 (isa %u)", i,
                    k.role == ZOPT_KERNEL_CONTROL ? "CONTROL" : "PREPARE", k.isa);
      if (k.isa > ZOPT_ISA_MAX)
        return fail(ZOPT_ERR_ABI, "kernel %u: isa %u out of range", i, k.isa);
    } else {
      // GPU entries (abi.h "GPU kernels"): images carry the SM number in
      // `isa`; kernel entries name an .entry inside the images.
      if (k.role < ZOPT_KERNEL_PREPARE || k.role > ZOPT_KERNEL_FINISH)
        return fail(ZOPT_ERR_ABI, "GPU kernel %u: role %u out of range", i, k.role);
      if (k.role == ZOPT_KERNEL_GPU_IMAGE && (k.isa < 50 || k.isa > 200))
        return fail(ZOPT_ERR_ABI, "GPU image %u: sm_%u is not a CUDA architecture", i, k.isa);
    }
    if (!nul_terminated(k.symbol, ZOPT_NAME_LEN) || !k.symbol[0])
      return fail(ZOPT_ERR_ABI, "kernel %u: symbol is empty or not NUL-terminated", i);
    if (k.role == ZOPT_KERNEL_SUMSQ) ++nsumsq;
  }
  if ((d->flags & ZOPT_FLAG_SUMSQ) && !nsumsq)
    return fail(ZOPT_ERR_ABI, "descriptor flags SUMSQ but names no SUMSQ kernel");
  // The step program (abi.h): every field in range; whether the runtime can
  // run it for this optimizer is decided at finalize.
  if (d->num_program < 1 || d->num_program > ZOPT_MAX_PROGRAM)
    return fail(ZOPT_ERR_ABI, "descriptor num_program %u out of range [1, %d]", d->num_program, ZOPT_MAX_PROGRAM);
  if (d->reserved1) return fail(ZOPT_ERR_ABI, "descriptor reserved field is not 0");
  for (uint32_t i = 0; i < d->num_program; ++i) {
    const zopt_program_op &p = d->program[i];
    auto place_ok = [](uint32_t v) { return v == ZOPT_PLACE_CPU || v == ZOPT_PLACE_GPU; };
    if (p.code < ZOPT_OP_COPY || p.code > ZOPT_OP_FINISH)
      return fail(ZOPT_ERR_ABI, "program op %u: code %u out of range", i, p.code);
    if (p.state >= d->num_states) return fail(ZOPT_ERR_ABI, "program op %u: state %u out of range", i, p.state);
    if (p.range > ZOPT_RANGE_ALL) return fail(ZOPT_ERR_ABI, "program op %u: range %u out of range", i, p.range);
    bool needs_range = p.code == ZOPT_OP_NORM_PARTIALS || p.code == ZOPT_OP_UPDATE;
    if (needs_range != (p.range != 0))
      return fail(ZOPT_ERR_ABI, "program op %u: range %u does not fit the op", i, p.range);
    bool moves = p.code == ZOPT_OP_COPY || p.code == ZOPT_OP_REDUCE_SCATTER || p.code == ZOPT_OP_ALL_GATHER;
    if (moves ? !dtype_size(p.dtype) : p.dtype != 0)
      return fail(ZOPT_ERR_ABI, "program op %u: dtype %u does not fit the op", i, p.dtype);
    if ((p.code == ZOPT_OP_REDUCE_SCATTER) != (p.accum != 0) || (p.accum && !dtype_size(p.accum)))
      return fail(ZOPT_ERR_ABI, "program op %u: accumulation dtype %u does not fit the op", i, p.accum);
    if (!place_ok(p.src) || !place_ok(p.dst) || ((p.code != ZOPT_OP_COPY) && p.src != p.dst))
      return fail(ZOPT_ERR_ABI, "program op %u: placements %u -> %u out of range", i, p.src, p.dst);
    if (p.flags & ~ZOPT_OPF_UNLESS_SKIPPED)
      return fail(ZOPT_ERR_ABI, "program op %u: unknown flags 0x%x", i, p.flags);
  }
  return ZOPT_OK;
}

// dlopen() of a truncated ELF whose headers survive maps segments past the
// end of the file and dies with SIGBUS on first touch, so the file is
// checked first: ELF magic, 64-bit little-endian x86-64 shared object,
// program headers, every PT_LOAD segment and the section header table
// inside the file.
zopt_status check_elf(const char *path, uint64_t size) {
  FILE *f = fopen(path, "rb");
  if (!f) return fail(ZOPT_ERR_IO, "cannot open step '%s': %s", path, strerror(errno));
  ElfW(Ehdr) eh;
  size_t got = fread(&eh, 1, sizeof eh, f);
  auto done = [&](zopt_status st) {
    fclose(f);
    return st;
  };
  if (got < 4 || memcmp(eh.e_ident, ELFMAG, SELFMAG) != 0)
    return done(fail(ZOPT_ERR_ABI, "'%s' is not an ELF shared library (bad ELF magic)", path));
  if (got < sizeof eh)
    return done(fail(ZOPT_ERR_ABI, "'%s' is truncated (%llu bytes, shorter than an ELF header)", path,
                     (unsigned long long)size));
  if (eh.e_ident[EI_CLASS] != ELFCLASS64 || eh.e_ident[EI_DATA] != ELFDATA2LSB)
    return done(fail(ZOPT_ERR_ABI, "'%s' is not a 64-bit little-endian ELF file", path));
  if (eh.e_type != ET_DYN) return done(fail(ZOPT_ERR_ABI, "'%s' is not a shared library (ELF type %u)", path, eh.e_type));
#if defined(__x86_64__)
  if (eh.e_machine != EM_X86_64)
    return done(fail(ZOPT_ERR_ABI, "'%s' is built for another machine (ELF machine %u)", path, eh.e_machine));
#endif
  if (eh.e_phentsize != sizeof(ElfW(Phdr)) || eh.e_phnum == 0 ||
      eh.e_phoff + (uint64_t)eh.e_phnum * sizeof(ElfW(Phdr)) > size)
    return done(fail(ZOPT_ERR_ABI, "'%s' is truncated or corrupt (program headers outside the file)", path));
  if (eh.e_shnum && eh.e_shoff + (uint64_t)eh.e_shnum * eh.e_shentsize > size)
    return done(fail(ZOPT_ERR_ABI,
                     "'%s' is truncated (%llu bytes; section headers end at %llu)", path, (unsigned long long)size,
                     (unsigned long long)(eh.e_shoff + (uint64_t)eh.e_shnum * eh.e_shentsize)));
  if (fseek(f, (long)eh.e_phoff, SEEK_SET) != 0) return done(fail(ZOPT_ERR_IO, "cannot read '%s'", path));
  for (unsigned i = 0; i < eh.e_phnum; ++i) {
    ElfW(Phdr) ph;
    if (fread(&ph, 1, sizeof ph, f) != sizeof ph)
      return done(fail(ZOPT_ERR_ABI, "'%s' is truncated (program header %u)", path, i));
    if (ph.p_type == PT_LOAD && ph.p_offset + ph.p_filesz > size)
      return done(fail(ZOPT_ERR_ABI, "'%s' is truncated (%llu bytes; a loadable segment ends at %llu)", path,
                       (unsigned long long)size, (unsigned long long)(ph.p_offset + ph.p_filesz)));
  }
  return done(ZOPT_OK);
}

}  // namespace

namespace zopt {
void release_step(const zopt_step *cs) {
  zopt_step *s = const_cast<zopt_step *>(cs);
  if (--s->refcount > 0) return;
  if (s->handle) dlclose(s->handle);
  delete s;
}
}  // namespace zopt

extern "C" {

ZOPT_API zopt_status zopt_step_load(const char *path, zopt_step **out) {
  if (!out) return fail(ZOPT_ERR_INVALID_ARGUMENT, "zopt_step_load: out is NULL");
  *out = nullptr;
  if (!path || !*path) return fail(ZOPT_ERR_INVALID_ARGUMENT, "zopt_step_load: path is NULL or empty");
  struct stat st;
  if (stat(path, &st) != 0)
    return fail(ZOPT_ERR_IO, "cannot open step '%s': %s", path, strerror(errno));
  if (!S_ISREG(st.st_mode))
    return fail(ZOPT_ERR_IO, "step '%s' is not a regular file", path);

  // ZOPT_CPU override, validated before loading anything.
  int max_isa = (int)zopt_cpu_best_isa();
  if (const char *env = getenv("ZOPT_CPU")) {
    if (*env) {
      int want = zopt_isa_from_name(env);
      if (want < 0)
        return fail(ZOPT_ERR_INVALID_ARGUMENT,
                    "ZOPT_CPU='%s' is not one of avx512bf16, avx512, avx2, none", env);
      if (!zopt_cpu_runs_isa((uint32_t)want))
        return fail(ZOPT_ERR_UNSUPPORTED, "ZOPT_CPU=%s but this CPU lacks %s", env, env);
      max_isa = want;
    }
  }

  if (zopt_status est = check_elf(path, (uint64_t)st.st_size)) return est;
  dlerror();
  void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (!h) {
    const char *e = dlerror();
    return fail(ZOPT_ERR_ABI, "cannot load step '%s' (truncated or not a shared library?): %s",
                path, e ? e : "unknown dlopen error");
  }
  auto bail = [&](zopt_status st) {
    dlclose(h);
    return st;
  };
  dlerror();
  void *sym = dlsym(h, ZOPT_DESC_SYMBOL);
  if (!sym) return bail(fail(ZOPT_ERR_ABI, "'%s' is not a zopt step (no zopt_step_descriptor symbol)", path));
  size_t symsize = 0;
  {
    Dl_info info;
    const ElfW(Sym) *es = nullptr;
    if (dladdr1(sym, &info, (void **)&es, RTLD_DL_SYMENT) && es) symsize = es->st_size;
  }
  const zopt_step_descriptor *d = (const zopt_step_descriptor *)sym;
  if (symsize && symsize < sizeof(zopt_step_descriptor))  // never read past the object
    return bail(fail(ZOPT_ERR_ABI, "'%s': zopt_step_descriptor is only %zu bytes, expected %zu", path, symsize,
                     sizeof(zopt_step_descriptor)));
  if (memcmp(d->magic, ZOPT_DESC_MAGIC, 8) != 0)
    return bail(fail(ZOPT_ERR_ABI, "'%s': bad descriptor magic (expected \"%s\")", path, ZOPT_DESC_MAGIC));
  if (d->abi_version != ZOPT_ABI_VERSION)
    return bail(fail(ZOPT_ERR_ABI, "'%s': step ABI version %u, this runtime reads ABI version %u: %s", path,
                     d->abi_version, ZOPT_ABI_VERSION,
                     d->abi_version < ZOPT_ABI_VERSION ? "recompile the step with this zopt-compile"
                                                       : "use the runtime of the zopt-compile that built it"));
  if (d->size != sizeof(zopt_step_descriptor))
    return bail(fail(ZOPT_ERR_ABI, "'%s': descriptor size %u, expected %zu", path, d->size,
                     sizeof(zopt_step_descriptor)));
  zopt_step *s = new (std::nothrow) zopt_step;
  if (!s) return bail(fail(ZOPT_ERR_OUT_OF_MEMORY, "out of memory"));
  memcpy(&s->desc, d, sizeof s->desc);
  d = &s->desc;
  auto bail2 = [&](zopt_status st) {
    delete s;
    return bail(st);
  };
  uint64_t ck = zopt_desc_checksum(d);
  if (ck != d->checksum)
    return bail2(fail(ZOPT_ERR_ABI, "'%s': descriptor checksum mismatch (stored %016llx, computed %016llx)", path,
                      (unsigned long long)d->checksum, (unsigned long long)ck));
  if (zopt_status st = validate_fields(d)) {
    std::string m = zopt_last_error();
    return bail2(fail(st, "'%s': %s", path, m.c_str()));
  }
  for (uint32_t i = 0; i < d->num_states; ++i) {
    if (d->states[i].kind == ZOPT_STATE_PARAM) s->param_index = (int)i;
    if (d->states[i].kind == ZOPT_STATE_GRAD) s->grad_index = (int)i;
  }
  // Resolve every CPU kernel; keep the best variant per role.
  int best[ZOPT_KERNEL_CONTROL + 1];
  void *fn[ZOPT_KERNEL_CONTROL + 1];
  for (int r = 0; r <= ZOPT_KERNEL_CONTROL; ++r) best[r] = -1, fn[r] = nullptr;
  bool any_cpu = false;
  for (uint32_t i = 0; i < d->num_kernels; ++i) {
    const zopt_kernel_desc &k = d->kernels[i];
    if (k.device != ZOPT_PLACE_CPU) {
      // Device code lives in the images; check that each image is exported.
      if (k.role == ZOPT_KERNEL_GPU_IMAGE) {
        std::string size_sym = std::string(k.symbol) + "_size";
        if (!dlsym(h, k.symbol) || !dlsym(h, size_sym.c_str()))
          return bail2(fail(ZOPT_ERR_ABI, "'%s': GPU image '%s' or its size is not exported", path,
                            k.symbol));
        s->has_gpu_code = true;
      }
      continue;
    }
    any_cpu = true;
    dlerror();
    void *f = dlsym(h, k.symbol);
    if (!f) {
      const char *e = dlerror();
      return bail2(fail(ZOPT_ERR_ABI, "'%s': kernel symbol '%s' not found: %s", path, k.symbol, e ? e : ""));
    }
    if ((int)k.isa <= max_isa && (int)k.isa > best[k.role]) {
      best[k.role] = (int)k.isa;
      fn[k.role] = f;
      if (k.role == ZOPT_KERNEL_SUMSQ) {
        // abi.h "SUMSQ pairs": the chosen variant's pair entry, if exported.
        std::string x2 = std::string(k.symbol) + "_x2";
        s->sumsq2 = (zopt_sumsq2_fn)dlsym(h, x2.c_str());
        dlerror();
      }
    }
  }
  if (any_cpu) {
    for (int role : {ZOPT_KERNEL_PREPARE, ZOPT_KERNEL_UPDATE, ZOPT_KERNEL_SUMSQ, ZOPT_KERNEL_CONTROL}) {
      // A GPU step keeps only its host PREPARE and CONTROL on the CPU.
      bool needed = role == ZOPT_KERNEL_PREPARE || role == ZOPT_KERNEL_CONTROL ||
                    (!s->has_gpu_code && (role != ZOPT_KERNEL_SUMSQ || (d->flags & ZOPT_FLAG_SUMSQ)));
      bool present = false;
      for (uint32_t i = 0; i < d->num_kernels; ++i)
        present |= d->kernels[i].role == (uint32_t)role && d->kernels[i].device == ZOPT_PLACE_CPU;
      const char *name = role == ZOPT_KERNEL_PREPARE  ? "PREPARE"
                         : role == ZOPT_KERNEL_UPDATE ? "UPDATE"
                         : role == ZOPT_KERNEL_SUMSQ  ? "SUMSQ"
                                                      : "CONTROL";
      if (needed && !present)
        return bail2(fail(ZOPT_ERR_ABI, "'%s': no CPU %s kernel%s", path, name,
                          role == ZOPT_KERNEL_CONTROL ? " (compiled by an older zopt-compile? recompile the step)" : ""));
      if (needed && !fn[role])
        return bail2(fail(ZOPT_ERR_UNSUPPORTED, "'%s': no %s kernel variant runs on this CPU (best allowed ISA: %s)",
                          path, name, zopt_isa_name((uint32_t)max_isa)));
    }
    s->control = (zopt_control_fn)fn[ZOPT_KERNEL_CONTROL];
    s->prepare = (zopt_prepare_fn)fn[ZOPT_KERNEL_PREPARE];
    s->update = (zopt_update_fn)fn[ZOPT_KERNEL_UPDATE];
    s->sumsq = (zopt_sumsq_fn)fn[ZOPT_KERNEL_SUMSQ];
    s->update_isa = best[ZOPT_KERNEL_UPDATE] < 0 ? ZOPT_ISA_NONE : (zopt_isa)best[ZOPT_KERNEL_UPDATE];
    s->has_cpu_kernels = true;
  }
  s->handle = h;
  s->path = path;
  *out = s;
  return ZOPT_OK;
}

ZOPT_API void zopt_step_free(zopt_step *step) {
  if (step) release_step(step);
}

ZOPT_API const zopt_step_descriptor *zopt_step_get_descriptor(const zopt_step *step) {
  if (!step) {
    fail(ZOPT_ERR_INVALID_ARGUMENT, "zopt_step_get_descriptor: step is NULL");
    return nullptr;
  }
  return &step->desc;
}

ZOPT_API zopt_isa zopt_step_isa(const zopt_step *step) {
  if (!step) {
    fail(ZOPT_ERR_INVALID_ARGUMENT, "zopt_step_isa: step is NULL");
    return ZOPT_ISA_NONE;
  }
  return step->update_isa;
}

}  // extern "C"
