/* N threads each write one 4 KiB block with O_DIRECT to a block device at once (offsets 8 KiB apart,
 * so no two requests merge), after joining a cgroup. Built static by tests/test_losses_bpf.py and run
 * from tmpfs, so the process does no other block I/O. Prints {"writes": N, "failed": F}.
 * usage: parallel_writes DEVICE THREADS CGROUP_PROCS */
#define _GNU_SOURCE
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static const char *device;
static pthread_barrier_t start;
static int failed;

static void *writer(void *arg)
{
    long i = (long)arg;
    void *buf;
    if (posix_memalign(&buf, 4096, 4096))
        return NULL;
    memset(buf, 0x5a, 4096);
    int fd = open(device, O_WRONLY | O_DIRECT);
    pthread_barrier_wait(&start);
    if (fd < 0 || pwrite(fd, buf, 4096, i * 8192) != 4096)
        __sync_fetch_and_add(&failed, 1);
    if (fd >= 0)
        close(fd);
    free(buf);
    return NULL;
}

int main(int argc, char **argv)
{
    if (argc != 4)
        return 2;
    device = argv[1];
    int n = atoi(argv[2]);
    FILE *procs = fopen(argv[3], "w");
    if (!procs || fprintf(procs, "%d\n", getpid()) < 0 || fclose(procs))
        return 3;
    pthread_t *threads = calloc(n, sizeof(*threads));
    pthread_barrier_init(&start, NULL, n);
    for (long i = 0; i < n; i++)
        pthread_create(&threads[i], NULL, writer, (void *)i);
    for (int i = 0; i < n; i++)
        pthread_join(threads[i], NULL);
    printf("{\"writes\": %d, \"failed\": %d}\n", n, failed);
    return 0;
}
