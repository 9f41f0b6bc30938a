/* JAX 0.12 on Hopper: give the mosaic kernels their register reallocation back.

   JAX 0.12's Mosaic GPU compiles a kernel through nvJitLink where that library loads, as
   relocatable code that it then links, and ptxas ignores `setmaxnreg` in relocatable code
   ("(C7504) ... 'setmaxnreg' ignored"): the kernels' consumer warpgroups keep 168 registers
   a thread instead of 232, and the backward spills (about half cuDNN's speed). Preloaded,
   this library makes JAX's own loads of libnvJitLink fail, so that XLA's compilation provider
   ("auto") falls back to the ptxas (and nvlink) executables where it finds them (the CUDA
   toolkit's /usr/local/cuda/bin, PATH; without a ptxas, compiling fails with an error that
   says so), and ptxas compiles each kernel whole. Libraries that list libnvJitLink as a
   dependency still get it (the dynamic loader maps those, not dlopen). hilbert_ring_jax sees
   the marker below and uses its blocks of 192 keys again (`hopper.REGISTERS_MOVE`).

     cc -shared -fPIC -O2 -o no_nvjitlink.so tools/no_nvjitlink.c -ldl
     LD_PRELOAD=$PWD/no_nvjitlink.so python3 train.py

   docs/performance.md, "JAX 0.12", has the figures with and without it. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <string.h>

int hilbert_ring_jax_no_nvjitlink = 1;

void *dlopen(const char *file, int flags) {
  static void *(*next)(const char *, int);
  if (!next) next = (void *(*)(const char *, int))dlsym(RTLD_NEXT, "dlopen");
  /* A path that cannot load, so that dlerror() explains the failure to the caller. */
  if (file && strstr(file, "nvJitLink")) return next("/nonexistent/libnvJitLink.so", flags);
  return next(file, flags);
}
