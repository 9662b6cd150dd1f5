/* Behaviour control shared by the stand-in CUDA and NCCL libraries.
 *
 * Every exported API looks up its behaviour by name: CPU work to burn (measured in thread CPU time,
 * so a preempted call takes longer on the wall clock, as a real driver call spinning on a lock or
 * a page-table walk would), time to sleep (waiting on the device) and the value to return. Tests set
 * it with standin_configure() and read call counts back with standin_calls().
 */
#define _GNU_SOURCE
#include <setjmp.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

#define STANDIN_MAX 128

struct standin_behaviour {
    char name[64];
    uint64_t work_ns;
    uint64_t sleep_ns;
    int ret;
    uint64_t calls;
};

static struct standin_behaviour standin_table[STANDIN_MAX];
static int standin_count;
static struct standin_behaviour standin_default;

static uint64_t standin_clock(clockid_t clock)
{
    struct timespec ts;
    clock_gettime(clock, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static struct standin_behaviour *standin_find(const char *name, int create)
{
    for (int i = 0; i < standin_count; i++)
        if (strcmp(standin_table[i].name, name) == 0)
            return &standin_table[i];
    if (!create || standin_count == STANDIN_MAX)
        return NULL;
    struct standin_behaviour *b = &standin_table[standin_count++];
    *b = standin_default;
    b->calls = 0;
    strncpy(b->name, name, sizeof(b->name) - 1);
    return b;
}

/* name "*" sets the default for every API not configured by name */
__attribute__((visibility("default"))) void standin_configure(const char *name, uint64_t work_ns,
                                                              uint64_t sleep_ns, int ret)
{
    struct standin_behaviour *b = strcmp(name, "*") == 0 ? &standin_default : standin_find(name, 1);
    if (!b)
        return;
    b->work_ns = work_ns;
    b->sleep_ns = sleep_ns;
    b->ret = ret;
}

__attribute__((visibility("default"))) uint64_t standin_calls(const char *name)
{
    struct standin_behaviour *b = standin_find(name, 0);
    return b ? __atomic_load_n(&b->calls, __ATOMIC_RELAXED) : 0;
}

static volatile uint64_t standin_sink;

/* The next call of this thread leaves by longjmp to `env` after its behaviour, as a C++ exception
 * thrown through the library would leave it: its caller never sees it return. */
static __thread jmp_buf *standin_escape;

__attribute__((visibility("default"))) void standin_escape_next(void *env)
{
    standin_escape = (jmp_buf *)env;
}

/* Runs the behaviour of one API call and returns the value the API must return. */
static __attribute__((noinline)) int standin_run(const char *name)
{
    struct standin_behaviour *b = standin_find(name, 1);
    if (!b)
        b = &standin_default;
    __atomic_add_fetch(&b->calls, 1, __ATOMIC_RELAXED);
    if (b->work_ns) {
        uint64_t until = standin_clock(CLOCK_THREAD_CPUTIME_ID) + b->work_ns;
        while (standin_clock(CLOCK_THREAD_CPUTIME_ID) < until)
            for (int i = 0; i < 200; i++)
                standin_sink += i;
    }
    if (b->sleep_ns) {
        struct timespec ts = {(time_t)(b->sleep_ns / 1000000000ull),
                              (long)(b->sleep_ns % 1000000000ull)};
        nanosleep(&ts, NULL);
    }
    if (standin_escape) {
        jmp_buf *env = standin_escape;
        standin_escape = NULL;
        longjmp(*env, 1);
    }
    return b->ret;
}

static uint64_t standin_next_pointer = 0x7f0000000000ull;

static uint64_t standin_alloc(uint64_t size)
{
    return __atomic_fetch_add(&standin_next_pointer, (size + 255) & ~255ull, __ATOMIC_RELAXED);
}
