/* Stand-in libcuda.so.1: the CUDA driver's exported names and signatures (x86-64 ABI), with
 * behaviour controlled by tests (standin.h). Built by tests/native/native_libs.py. */
#include <stddef.h>
#include "standin.h"

#define API __attribute__((visibility("default"), noinline))

typedef int CUresult;
typedef unsigned long long CUdeviceptr;
typedef void *CUfunction;
typedef void *CUstream;
typedef void *CUcontext;
typedef struct {
    unsigned int gridDimX, gridDimY, gridDimZ;
    unsigned int blockDimX, blockDimY, blockDimZ;
    unsigned int sharedMemBytes;
    CUstream hStream;
    void *attrs;
    unsigned int numAttrs;
} CUlaunchConfig;

API CUresult cuLaunchKernel(CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz,
                            unsigned int bx, unsigned int by, unsigned int bz, unsigned int shmem,
                            CUstream stream, void **params, void **extra)
{
    (void)f; (void)gx; (void)gy; (void)gz; (void)bx; (void)by; (void)bz; (void)shmem;
    (void)stream; (void)params; (void)extra;
    return standin_run("cuLaunchKernel");
}

API CUresult cuLaunchKernel_ptsz(CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz,
                                 unsigned int bx, unsigned int by, unsigned int bz,
                                 unsigned int shmem, CUstream stream, void **params, void **extra)
{
    (void)f; (void)gx; (void)gy; (void)gz; (void)bx; (void)by; (void)bz; (void)shmem;
    (void)stream; (void)params; (void)extra;
    return standin_run("cuLaunchKernel_ptsz");
}

API CUresult cuLaunchKernelEx(const CUlaunchConfig *config, CUfunction f, void **params, void **extra)
{
    (void)config; (void)f; (void)params; (void)extra;
    return standin_run("cuLaunchKernelEx");
}

API CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize)
{
    int r = standin_run("cuMemAlloc_v2");
    if (r == 0)
        *dptr = standin_alloc(bytesize);
    return r;
}

API CUresult cuMemFree_v2(CUdeviceptr dptr) { (void)dptr; return standin_run("cuMemFree_v2"); }

API CUresult cuMemcpyHtoD_v2(CUdeviceptr dst, const void *src, size_t n)
{
    (void)dst; (void)src; (void)n;
    return standin_run("cuMemcpyHtoD_v2");
}

API CUresult cuMemcpyHtoD_v2_ptds(CUdeviceptr dst, const void *src, size_t n)
{
    (void)dst; (void)src; (void)n;
    return standin_run("cuMemcpyHtoD_v2_ptds");
}

API CUresult cuMemcpyDtoH_v2(void *dst, CUdeviceptr src, size_t n)
{
    (void)dst; (void)src; (void)n;
    return standin_run("cuMemcpyDtoH_v2");
}

API CUresult cuStreamSynchronize(CUstream s) { (void)s; return standin_run("cuStreamSynchronize"); }
API CUresult cuStreamSynchronize_ptsz(CUstream s) { (void)s; return standin_run("cuStreamSynchronize_ptsz"); }
API CUresult cuCtxSynchronize(void) { return standin_run("cuCtxSynchronize"); }

/* CUDA graphs at the driver */
API CUresult cuGraphInstantiateWithFlags(void **exec, void *graph, unsigned long long flags)
{
    (void)flags;
    int r = standin_run("cuGraphInstantiateWithFlags");
    if (r == 0)
        *exec = (void *)((unsigned long long)graph | 0x10);
    return r;
}

API CUresult cuGraphLaunch(void *exec, CUstream s)
{
    (void)exec; (void)s;
    return standin_run("cuGraphLaunch");
}
