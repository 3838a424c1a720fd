//===- kernel_compute_bench.cpp - UPDATE kernel cost with data in L1 ------===//
//
//   zopt-bench-compute step.so <isa: 1 = avx2, 2 = avx512>
//
// Calls one UPDATE variant over 4096 elements (L1/L2-resident) many times on
// one thread: the kernel's compute cost per element, without memory. Used to
// tell a compute-bound layout from a memory-bound one (docs/benchmarks/cpu.md).
//===----------------------------------------------------------------------===//
#include <dlfcn.h>
#include <chrono>
#include <cstdio>
#include <cstdint>
#include <vector>
#include <cstring>
#include <cstdlib>
#include "zopt/abi.h"
int main(int argc,char**argv){
  if(argc<3){printf("usage: zopt-bench-compute step.so <1|2>\n");return 2;}
  void*h=dlopen(argv[1],RTLD_NOW); if(!h){printf("%s\n",dlerror());return 1;} auto*d=(zopt_step_descriptor*)dlsym(h,"zopt_step_descriptor");
  zopt_prepare_fn prep=nullptr; zopt_update_fn upd=nullptr;
  for(unsigned i=0;i<d->num_kernels;i++){auto&k=d->kernels[i]; if(k.role==1)prep=(zopt_prepare_fn)dlsym(h,k.symbol); if(k.role==2&&k.isa==(unsigned)atoi(argv[2]))upd=(zopt_update_fn)dlsym(h,k.symbol);}
  if(!prep||!upd){printf("no PREPARE or no UPDATE variant with that isa\n");return 1;}
  double hy[16]; for(unsigned i=0;i<d->num_hypers;i++)hy[i]=d->hypers[i].default_value; double gl[3]={3,1,1}; float co[64]; prep(hy,gl,co);
  long n=4096; std::vector<std::vector<uint32_t>> b(d->num_states, std::vector<uint32_t>(n,0x3f803f80)); void*p[12]; for(unsigned i=0;i<d->num_states;i++)p[i]=b[i].data();
  for(int r=0;r<1000;r++)upd(p,n,co);
  auto t0=std::chrono::steady_clock::now(); int R=20000; for(int r=0;r<R;r++) upd(p,n,co); auto t1=std::chrono::steady_clock::now();
  printf("%s isa %s: %.3f ns/elem (L1-resident, 1 thread)\n",d->name,argv[2],std::chrono::duration<double>(t1-t0).count()/R/n*1e9);
}
