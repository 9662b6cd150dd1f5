/* busy_loop: burns CPU until killed or for argv[1] seconds. The noisy neighbour of the demo and
 * the tests: pinned to the workload's CPU it preempts the training thread. */
#include <stdlib.h>
#include <time.h>

int main(int argc, char **argv)
{
    double seconds = argc > 1 ? atof(argv[1]) : 1e9;
    volatile unsigned long sink = 0;
    time_t end = time(NULL) + (time_t)seconds + 1;
    struct timespec start, now;
    clock_gettime(CLOCK_MONOTONIC, &start);
    for (;;) {
        for (int i = 0; i < 100000; i++)
            sink += i;
        clock_gettime(CLOCK_MONOTONIC, &now);
        if ((now.tv_sec - start.tv_sec) + (now.tv_nsec - start.tv_nsec) / 1e9 >= seconds || now.tv_sec > end)
            return 0;
    }
}
