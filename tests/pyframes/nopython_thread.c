/* Calls a function pointer from a fresh pthread that never runs Python, as autograd and NCCL
 * worker threads call CUDA: the walker must report "no python thread state", not another
 * thread's stack. Built by tests/test_pyframes.py. */
#include <pthread.h>

typedef int (*cuda_malloc_fn)(void **, unsigned long);

static void *run(void *fn)
{
    void *p;
    ((cuda_malloc_fn)fn)(&p, 4242);
    return 0;
}

int call_from_new_thread(void *fn)
{
    pthread_t t;
    if (pthread_create(&t, 0, run, fn) != 0)
        return -1;
    return pthread_join(t, 0);
}
