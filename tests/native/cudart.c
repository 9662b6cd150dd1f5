/* Stand-in libcudart.so.12: the CUDA runtime's exported names and signatures (x86-64 ABI), with
 * behaviour controlled by tests (standin.h). Built by tests/native/native_libs.py. */
#include <stddef.h>
#include "standin.h"

#define API __attribute__((visibility("default"), noinline))

typedef int cudaError_t;
typedef void *cudaStream_t;
typedef void *cudaEvent_t;
typedef struct { unsigned int x, y, z; } dim3;
typedef struct {
    dim3 gridDim;
    dim3 blockDim;
    size_t dynamicSmemBytes;
    cudaStream_t stream;
    void *attrs;
    unsigned int numAttrs;
} cudaLaunchConfig_t;

API cudaError_t cudaMalloc(void **ptr, size_t size)
{
    int r = standin_run("cudaMalloc");
    if (r == 0)
        *ptr = (void *)standin_alloc(size);
    return r;
}

API cudaError_t cudaMallocHost(void **ptr, size_t size)
{
    int r = standin_run("cudaMallocHost");
    if (r == 0)
        *ptr = (void *)standin_alloc(size);
    return r;
}

API cudaError_t cudaMallocManaged(void **ptr, size_t size, unsigned int flags)
{
    (void)flags;
    int r = standin_run("cudaMallocManaged");
    if (r == 0)
        *ptr = (void *)standin_alloc(size);
    return r;
}

API cudaError_t cudaMallocAsync(void **ptr, size_t size, cudaStream_t stream)
{
    (void)stream;
    int r = standin_run("cudaMallocAsync");
    if (r == 0)
        *ptr = (void *)standin_alloc(size);
    return r;
}

API cudaError_t cudaFree(void *ptr) { (void)ptr; return standin_run("cudaFree"); }
API cudaError_t cudaFreeHost(void *ptr) { (void)ptr; return standin_run("cudaFreeHost"); }
API cudaError_t cudaFreeAsync(void *ptr, cudaStream_t s) { (void)ptr; (void)s; return standin_run("cudaFreeAsync"); }

API cudaError_t cudaLaunchKernel(const void *func, dim3 grid, dim3 block, void **args,
                                 size_t shmem, cudaStream_t stream)
{
    (void)func; (void)grid; (void)block; (void)args; (void)shmem; (void)stream;
    return standin_run("cudaLaunchKernel");
}

API cudaError_t cudaLaunchKernel_ptsz(const void *func, dim3 grid, dim3 block, void **args,
                                      size_t shmem, cudaStream_t stream)
{
    (void)func; (void)grid; (void)block; (void)args; (void)shmem; (void)stream;
    return standin_run("cudaLaunchKernel_ptsz");
}

API cudaError_t cudaLaunchKernelExC(const cudaLaunchConfig_t *config, const void *func, void **args)
{
    (void)config; (void)func; (void)args;
    return standin_run("cudaLaunchKernelExC");
}

API cudaError_t cudaMemcpy(void *dst, const void *src, size_t count, int kind)
{
    (void)dst; (void)src; (void)count; (void)kind;
    return standin_run("cudaMemcpy");
}

API cudaError_t cudaMemcpy_ptds(void *dst, const void *src, size_t count, int kind)
{
    (void)dst; (void)src; (void)count; (void)kind;
    return standin_run("cudaMemcpy_ptds");
}

API cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t count, int kind, cudaStream_t s)
{
    (void)dst; (void)src; (void)count; (void)kind; (void)s;
    return standin_run("cudaMemcpyAsync");
}

API cudaError_t cudaMemcpyAsync_ptsz(void *dst, const void *src, size_t count, int kind,
                                     cudaStream_t s)
{
    (void)dst; (void)src; (void)count; (void)kind; (void)s;
    return standin_run("cudaMemcpyAsync_ptsz");
}

API cudaError_t cudaStreamSynchronize(cudaStream_t s) { (void)s; return standin_run("cudaStreamSynchronize"); }
API cudaError_t cudaDeviceSynchronize(void) { return standin_run("cudaDeviceSynchronize"); }
API cudaError_t cudaEventSynchronize(cudaEvent_t e) { (void)e; return standin_run("cudaEventSynchronize"); }
