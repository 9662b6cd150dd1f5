/* Stand-in libcuda.so.1 whose launch entry points begin the ways a real driver's may, to measure and
 * test where the recorder puts its uprobes (recorder/core/x86insn.py). Each exported entry point is
 * written in assembly and tail-jumps (registers and stack untouched) to a C body that runs the
 * behaviour of standin.h:
 *
 *   cuLaunchKernel       mov counter(%rip),%rax; jmp body    a RIP-relative load (single-stepped),
 *                                                            then a jmp (emulated): moved to +7
 *   cuLaunchKernel_ptsz  the same load, then a loop that jumps back to +7 once: not moved
 *   cuLaunchKernel_ptds  push %rbp; pop %rbp; jmp body       an emulated entry
 *
 * Built by tests/native/native_libs.py (build_trap_library). */
#include <stddef.h>
#include "standin.h"

typedef int CUresult;

__attribute__((used, visibility("hidden"))) unsigned long trap_counter;

#define BODY(name)                                                                                    \
    __attribute__((used, noinline, visibility("hidden"))) CUresult name##_body(                       \
        void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,        \
        unsigned shmem, void *stream, void **params, void **extra)                                    \
    {                                                                                                 \
        (void)f; (void)gx; (void)gy; (void)gz; (void)bx; (void)by; (void)bz; (void)shmem;             \
        (void)stream; (void)params; (void)extra;                                                      \
        return standin_run(#name);                                                                    \
    }

BODY(cuLaunchKernel)
BODY(cuLaunchKernel_ptsz)
BODY(cuLaunchKernel_ptds)

__asm__(
    ".text\n"
    ".globl cuLaunchKernel\n.type cuLaunchKernel, @function\n"
    "cuLaunchKernel:\n"
    "    mov trap_counter(%rip), %rax\n"
    "    jmp cuLaunchKernel_body\n"
    ".size cuLaunchKernel, .-cuLaunchKernel\n"

    ".globl cuLaunchKernel_ptsz\n.type cuLaunchKernel_ptsz, @function\n"
    "cuLaunchKernel_ptsz:\n"
    "    mov trap_counter(%rip), %rax\n"
    "1:  push %rbp\n"
    "    pop %rbp\n"
    "    inc %rax\n"
    "    cmp $2, %rax\n"
    "    jb 1b\n"
    "    jmp cuLaunchKernel_ptsz_body\n"
    ".size cuLaunchKernel_ptsz, .-cuLaunchKernel_ptsz\n"

    ".globl cuLaunchKernel_ptds\n.type cuLaunchKernel_ptds, @function\n"
    "cuLaunchKernel_ptds:\n"
    "    push %rbp\n"
    "    pop %rbp\n"
    "    jmp cuLaunchKernel_ptds_body\n"
    ".size cuLaunchKernel_ptds, .-cuLaunchKernel_ptds\n");
