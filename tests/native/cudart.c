/* Stand-in libcudart.so.12: the CUDA runtime's exported names and signatures (x86-64 ABI), with
 * behaviour controlled by tests (standin.h). Built by tests/native/native_libs.py. */
#include <stddef.h>
#include <dlfcn.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
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

/* The real runtime launches through the driver: cudaLaunchKernel calls the driver's exported
 * cuLaunchKernel, through a function pointer the driver hands out that points into executable
 * anonymous memory (not a file mapping). standin_use_driver(path) makes this stand-in do the same:
 * it loads the stand-in libcuda.so.1 and builds such a trampoline to its cuLaunchKernel. Until it
 * is called, cudaLaunchKernel only runs its own behaviour, as before. */
typedef int (*cu_launch_t)(void *f, unsigned int gx, unsigned int gy, unsigned int gz,
                           unsigned int bx, unsigned int by, unsigned int bz, unsigned int shmem,
                           void *stream, void **params, void **extra);
static cu_launch_t standin_driver_launch;
static int (*standin_driver_sync)(void *stream);
static void (*standin_driver_escape)(void *env);
static int standin_copy_kernels; /* cudaMemcpyAsync launches a copy kernel through the driver */

/* x86-64: a frame of its own (so a frame-pointer walk sees it) that passes the 11 arguments on:
 * the 5 on the stack are pushed again below an 8-byte pad that keeps the call 16-byte aligned. */
static const unsigned char standin_thunk[] = {
    0x55,                         /* push %rbp */
    0x48, 0x89, 0xe5,             /* mov %rsp,%rbp */
    0x48, 0x83, 0xec, 0x08,       /* sub $8,%rsp */
    0xff, 0x75, 0x30,             /* push 0x30(%rbp): extra */
    0xff, 0x75, 0x28,             /* push 0x28(%rbp): params */
    0xff, 0x75, 0x20,             /* push 0x20(%rbp): stream */
    0xff, 0x75, 0x18,             /* push 0x18(%rbp): shmem */
    0xff, 0x75, 0x10,             /* push 0x10(%rbp): block z */
    0x48, 0xb8, 0, 0, 0, 0, 0, 0, 0, 0, /* movabs $target,%rax */
    0xff, 0xd0,                   /* call *%rax */
    0xc9,                         /* leave */
    0xc3,                         /* ret */
};

API int standin_use_driver(const char *path)
{
    void *lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!lib)
        return -1;
    void *target = dlsym(lib, "cuLaunchKernel");
    if (!target)
        return -2;
    unsigned char *code = mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (code == MAP_FAILED)
        return -3;
    memcpy(code, standin_thunk, sizeof(standin_thunk));
    uint64_t at = (uint64_t)target;
    memcpy(code + 25, &at, sizeof(at));
    if (mprotect(code, 4096, PROT_READ | PROT_EXEC))
        return -4;
    standin_driver_launch = (cu_launch_t)(void *)code;
    standin_driver_sync = (int (*)(void *))dlsym(lib, "cuStreamSynchronize");
    standin_driver_escape = (void (*)(void *))dlsym(lib, "standin_escape_next");
    return 0;
}

/* cudaMemcpyAsync launches a copy kernel through the driver from now on (as the runtime does for
 * some copies), once standin_use_driver() ran. */
API void standin_use_copy_kernels(int on) { standin_copy_kernels = on; }

/* A driver launch that never returns to its caller: cuLaunchKernel (through the trampoline) leaves
 * by longjmp, as an exception thrown through the driver would. Returns 0 once it left so. */
API int standin_abandon_driver_launch(void)
{
    jmp_buf env;
    if (!standin_driver_launch || !standin_driver_escape)
        return -1;
    if (setjmp(env) == 0) {
        standin_driver_escape(&env);
        standin_driver_launch((void *)0x4000AB, 1, 1, 1, 32, 1, 1, 0, NULL, NULL, NULL);
        return -2;
    }
    return 0;
}

API cudaError_t cudaLaunchKernel(const void *func, dim3 grid, dim3 block, void **args,
                                 size_t shmem, cudaStream_t stream)
{
    int r = standin_run("cudaLaunchKernel");
    if (r == 0 && standin_driver_launch)
        /* the driver's handle for the kernel: the runtime looks it up from the host function */
        r = standin_driver_launch((void *)((uintptr_t)func | 0x1), grid.x, grid.y, grid.z, block.x,
                                  block.y, block.z, (unsigned int)shmem, stream, args, NULL);
    return r;
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
    (void)dst; (void)src; (void)count; (void)kind;
    int r = standin_run("cudaMemcpyAsync");
    if (r == 0 && standin_copy_kernels && standin_driver_launch)
        r = standin_driver_launch((void *)0x4000AC, 1, 1, 1, 128, 1, 1, 0, s, NULL, NULL);
    return r;
}

API cudaError_t cudaMemcpyAsync_ptsz(void *dst, const void *src, size_t count, int kind,
                                     cudaStream_t s)
{
    (void)dst; (void)src; (void)count; (void)kind; (void)s;
    return standin_run("cudaMemcpyAsync_ptsz");
}

API cudaError_t cudaStreamSynchronize(cudaStream_t s)
{
    int r = standin_run("cudaStreamSynchronize");
    if (r == 0 && standin_driver_sync) /* through the driver too, once standin_use_driver() ran */
        r = standin_driver_sync(s);
    return r;
}
API cudaError_t cudaDeviceSynchronize(void) { return standin_run("cudaDeviceSynchronize"); }
API cudaError_t cudaEventSynchronize(cudaEvent_t e) { (void)e; return standin_run("cudaEventSynchronize"); }

/* CUDA graphs: capture on a stream, instantiate, launch (replay) */
typedef void *cudaGraph_t;
typedef void *cudaGraphExec_t;
static uint64_t standin_next_graph = 0x6a0000;

API cudaError_t cudaStreamBeginCapture(cudaStream_t s, int mode)
{
    (void)s; (void)mode;
    return standin_run("cudaStreamBeginCapture");
}

API cudaError_t cudaStreamEndCapture(cudaStream_t s, cudaGraph_t *graph)
{
    (void)s;
    int r = standin_run("cudaStreamEndCapture");
    if (r == 0)
        *graph = (cudaGraph_t)__atomic_add_fetch(&standin_next_graph, 0x100, __ATOMIC_RELAXED);
    return r;
}

API cudaError_t cudaGraphInstantiate(cudaGraphExec_t *exec, cudaGraph_t graph, unsigned long long flags)
{
    (void)flags;
    int r = standin_run("cudaGraphInstantiate");
    if (r == 0)
        *exec = (cudaGraphExec_t)((uintptr_t)graph | 0x10);
    return r;
}

API cudaError_t cudaGraphLaunch(cudaGraphExec_t exec, cudaStream_t s)
{
    (void)exec; (void)s;
    return standin_run("cudaGraphLaunch");
}
