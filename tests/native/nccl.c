/* Stand-in libnccl.so.2: NCCL's exported names and signatures (x86-64 ABI) with a real rendezvous
 * between ranks, so a rank that arrives late at a collective (or at the communicator's init) makes
 * the others wait, as in NCCL.
 *
 * Ranks of one communicator are separate processes; they meet in a shared-memory segment named
 * after the communicator's unique id (/dev/shm/standin-nccl-<hex>). Every collective call
 * advances the rank's sequence number, runs its own configured behaviour (standin.h: work, sleep,
 * return value; a test slows one rank this way), then arrives and waits until every rank of the
 * communicator has arrived for that sequence number. Built by tests/native/native_libs.py.
 */
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <unistd.h>
#include "standin.h"

#define API __attribute__((visibility("default"), noinline))

typedef int ncclResult_t;
typedef int ncclDataType_t;
typedef int ncclRedOp_t;
typedef void *cudaStream_t;
typedef struct { char internal[128]; } ncclUniqueId;
typedef struct { size_t size; unsigned int magic, version; int blocking; } ncclConfig_t;

#define MAX_RANKS 64
struct shared {
    volatile uint64_t arrived[MAX_RANKS]; /* per rank: the last sequence number it arrived for */
    volatile uint32_t joined[MAX_RANKS];  /* per rank: 1 once it entered ncclCommInitRank */
};

struct standin_comm {
    int nranks, rank;
    uint64_t seq;
    struct shared *shm;
    ncclUniqueId id;
};

static int id_counter;

API ncclResult_t ncclGetUniqueId(ncclUniqueId *id)
{
    memset(id, 0, sizeof(*id));
    snprintf(id->internal, sizeof(id->internal), "%d-%d-%ld", getpid(), ++id_counter, (long)time(NULL));
    return standin_run("ncclGetUniqueId");
}

static void shm_name(const ncclUniqueId *id, char *out, size_t n)
{
    uint64_t h = 1469598103934665603ull;
    for (int i = 0; i < 128; i++)
        h = (h ^ (unsigned char)id->internal[i]) * 1099511628211ull;
    snprintf(out, n, "/standin-nccl-%016llx", (unsigned long long)h);
}

static ncclResult_t init_rank(struct standin_comm **comm, int nranks, ncclUniqueId id, int rank,
                              const char *api)
{
    int r = standin_run(api);
    if (r)
        return r;
    if (nranks < 1 || nranks > MAX_RANKS || rank < 0 || rank >= nranks)
        return 4; /* ncclInvalidArgument */
    char name[64];
    shm_name(&id, name, sizeof(name));
    int fd = shm_open(name, O_RDWR | O_CREAT, 0600);
    if (fd < 0 || ftruncate(fd, sizeof(struct shared)) < 0)
        return 2; /* ncclSystemError */
    struct shared *shm = mmap(NULL, sizeof(struct shared), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (shm == MAP_FAILED)
        return 2;
    /* the init is collective, as NCCL's: it returns once every rank has entered it */
    __atomic_store_n(&shm->joined[rank], 1, __ATOMIC_RELEASE);
    for (int all = 0; !all;) {
        all = 1;
        for (int i = 0; i < nranks; i++)
            if (!__atomic_load_n(&shm->joined[i], __ATOMIC_ACQUIRE))
                all = 0;
        if (!all) {
            struct timespec ts = {0, 50000};
            nanosleep(&ts, NULL);
        }
    }
    struct standin_comm *c = calloc(1, sizeof(*c));
    c->nranks = nranks;
    c->rank = rank;
    c->shm = shm;
    c->id = id;
    *comm = c;
    return 0;
}

API ncclResult_t ncclCommInitRank(struct standin_comm **comm, int nranks, ncclUniqueId id, int rank)
{
    return init_rank(comm, nranks, id, rank, "ncclCommInitRank");
}

API ncclResult_t ncclCommInitRankConfig(struct standin_comm **comm, int nranks, ncclUniqueId id,
                                        int rank, ncclConfig_t *config)
{
    (void)config;
    return init_rank(comm, nranks, id, rank, "ncclCommInitRankConfig");
}

API ncclResult_t ncclCommDestroy(struct standin_comm *comm)
{
    int r = standin_run("ncclCommDestroy");
    if (comm) {
        if (comm->rank == 0) {
            char name[64];
            shm_name(&comm->id, name, sizeof(name));
            shm_unlink(name);
        }
        munmap(comm->shm, sizeof(struct shared));
        free(comm);
    }
    return r;
}

API ncclResult_t ncclCommCount(const struct standin_comm *comm, int *count)
{
    *count = comm->nranks;
    return 0;
}

API ncclResult_t ncclCommUserRank(const struct standin_comm *comm, int *rank)
{
    *rank = comm->rank;
    return 0;
}

/* Arrive for the next collective and wait for every rank: the wait NCCL imposes on early ranks. */
static ncclResult_t collective(struct standin_comm *comm, const char *api)
{
    int r = standin_run(api);
    if (r || !comm)
        return r ? r : 4;
    uint64_t seq = ++comm->seq;
    __atomic_store_n(&comm->shm->arrived[comm->rank], seq, __ATOMIC_RELEASE);
    for (;;) {
        int all = 1;
        for (int i = 0; i < comm->nranks; i++)
            if (__atomic_load_n(&comm->shm->arrived[i], __ATOMIC_ACQUIRE) < seq)
                all = 0;
        if (all)
            return 0;
        struct timespec ts = {0, 50000};
        nanosleep(&ts, NULL);
    }
}

API ncclResult_t ncclAllReduce(const void *sendbuff, void *recvbuff, size_t count, ncclDataType_t dt,
                               ncclRedOp_t op, struct standin_comm *comm, cudaStream_t stream)
{
    (void)sendbuff; (void)recvbuff; (void)count; (void)dt; (void)op; (void)stream;
    return collective(comm, "ncclAllReduce");
}

API ncclResult_t ncclAllGather(const void *sendbuff, void *recvbuff, size_t sendcount,
                               ncclDataType_t dt, struct standin_comm *comm, cudaStream_t stream)
{
    (void)sendbuff; (void)recvbuff; (void)sendcount; (void)dt; (void)stream;
    return collective(comm, "ncclAllGather");
}

API ncclResult_t ncclReduceScatter(const void *sendbuff, void *recvbuff, size_t recvcount,
                                   ncclDataType_t dt, ncclRedOp_t op, struct standin_comm *comm,
                                   cudaStream_t stream)
{
    (void)sendbuff; (void)recvbuff; (void)recvcount; (void)dt; (void)op; (void)stream;
    return collective(comm, "ncclReduceScatter");
}

API ncclResult_t ncclBroadcast(const void *sendbuff, void *recvbuff, size_t count, ncclDataType_t dt,
                               int root, struct standin_comm *comm, cudaStream_t stream)
{
    (void)sendbuff; (void)recvbuff; (void)count; (void)dt; (void)root; (void)stream;
    return collective(comm, "ncclBroadcast");
}

API ncclResult_t ncclBcast(void *buff, size_t count, ncclDataType_t dt, int root,
                           struct standin_comm *comm, cudaStream_t stream)
{
    (void)buff; (void)count; (void)dt; (void)root; (void)stream;
    return collective(comm, "ncclBcast");
}

API ncclResult_t ncclReduce(const void *sendbuff, void *recvbuff, size_t count, ncclDataType_t dt,
                            ncclRedOp_t op, int root, struct standin_comm *comm, cudaStream_t stream)
{
    (void)sendbuff; (void)recvbuff; (void)count; (void)dt; (void)op; (void)root; (void)stream;
    return collective(comm, "ncclReduce");
}

/* Point-to-point calls do not rendezvous here: a test uses them for argument capture only. */
API ncclResult_t ncclSend(const void *sendbuff, size_t count, ncclDataType_t dt, int peer,
                          struct standin_comm *comm, cudaStream_t stream)
{
    (void)sendbuff; (void)count; (void)dt; (void)peer; (void)comm; (void)stream;
    return standin_run("ncclSend");
}

API ncclResult_t ncclRecv(void *recvbuff, size_t count, ncclDataType_t dt, int peer,
                          struct standin_comm *comm, cudaStream_t stream)
{
    (void)recvbuff; (void)count; (void)dt; (void)peer; (void)comm; (void)stream;
    return standin_run("ncclRecv");
}

API ncclResult_t ncclGroupStart(void) { return standin_run("ncclGroupStart"); }
API ncclResult_t ncclGroupEnd(void) { return standin_run("ncclGroupEnd"); }

/* NCCL exports every entry point twice: ncclX and the profiling alias pncclX at the same address. */
#define ALIAS(name) extern __typeof__(name) p##name __attribute__((alias(#name), visibility("default")));
ALIAS(ncclAllReduce)
ALIAS(ncclAllGather)
ALIAS(ncclReduceScatter)
ALIAS(ncclBroadcast)
ALIAS(ncclBcast)
ALIAS(ncclReduce)
ALIAS(ncclSend)
ALIAS(ncclRecv)
ALIAS(ncclGroupStart)
ALIAS(ncclGroupEnd)
ALIAS(ncclCommInitRank)
ALIAS(ncclCommInitRankConfig)
ALIAS(ncclCommDestroy)
ALIAS(ncclGetUniqueId)
