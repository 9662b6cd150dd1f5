/* Stand-in libnvidia-ml.so.1: the NVML entry points nvidia-ml-py (pynvml) calls to sample GPUs,
 * with the real exported names, signatures and struct layouts of nvml.h (x86-64 ABI). Built by
 * tests/native/native_libs.py. Its behaviour comes from the environment, read at every call, so a
 * test controls a running recorder's GPUs through a file:
 *
 *   STANDIN_NVML_GPUS=N           number of GPUs (default 1, at most 8)
 *   STANDIN_NVML_INIT_ERROR=CODE  nvmlInit* returns this nvmlReturn_t (9: driver not loaded)
 *   STANDIN_NVML_UTIL_FILE=PATH   line i is "GPU_PERCENT MEMORY_PERCENT" of GPU i (the last line
 *                                 serves GPUs beyond it); missing or unreadable: 0 0
 *   STANDIN_NVML_NO_POWER=1       nvmlDeviceGetPowerUsage answers NVML_ERROR_NOT_SUPPORTED
 *   STANDIN_NVML_UTIL_ERROR=CODE  nvmlDeviceGetUtilizationRates answers this (15: GPU is lost)
 *   STANDIN_NVML_CALLS_FILE=PATH  every nvmlDeviceGetUtilizationRates appends "pid tid\n" to PATH
 *   STANDIN_NVML_SAMPLE_MS=N      nvmlDeviceGetSamples(NVML_GPU_UTILIZATION_SAMPLES) keeps a sample
 *                                 buffer: one sample every N ms of CLOCK_REALTIME (microseconds, as
 *                                 the driver stamps them), the last 2 s, valued as the util file
 *                                 says when read; unset or 0: NVML_ERROR_NOT_SUPPORTED
 *
 * GPU i is "NVIDIA Stand-in GPU i" at PCI 00000000:(0x1b + i):00.0, 80 GiB with (i + 1) GiB used,
 * SM clock 1410 MHz, 250 W, 40 + i degrees C.
 */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define API __attribute__((visibility("default")))

typedef int nvmlReturn_t;
enum {
    NVML_SUCCESS = 0,
    NVML_ERROR_UNINITIALIZED = 1,
    NVML_ERROR_INVALID_ARGUMENT = 2,
    NVML_ERROR_NOT_SUPPORTED = 3,
    NVML_ERROR_NOT_FOUND = 6,
    NVML_ERROR_INSUFFICIENT_SIZE = 7,
    NVML_ERROR_UNKNOWN = 999,
};
#define MAX_GPUS 8

struct nvmlDevice_st { unsigned int index; };
typedef struct nvmlDevice_st *nvmlDevice_t;
typedef struct { unsigned int gpu, memory; } nvmlUtilization_t;
typedef struct { unsigned long long total, free, used; } nvmlMemory_t;
typedef union { double dVal; unsigned int uiVal; unsigned long ulVal; unsigned long long ullVal;
                signed long long sllVal; int siVal; unsigned short usVal; } nvmlValue_t;
typedef struct { unsigned long long timeStamp; nvmlValue_t sampleValue; } nvmlSample_t;
typedef struct {
    char busIdLegacy[16];
    unsigned int domain, bus, device, pciDeviceId, pciSubSystemId;
    char busId[32];
} nvmlPciInfo_t;

static struct nvmlDevice_st devices[MAX_GPUS] = {{0}, {1}, {2}, {3}, {4}, {5}, {6}, {7}};
static int initialised;

static int env_int(const char *name, int fallback)
{
    const char *v = getenv(name);
    return v && *v ? atoi(v) : fallback;
}

static unsigned int gpu_count(void)
{
    int n = env_int("STANDIN_NVML_GPUS", 1);
    return n < 0 ? 0 : (n > MAX_GPUS ? MAX_GPUS : (unsigned int)n);
}

static nvmlReturn_t check(nvmlDevice_t device)
{
    if (!initialised)
        return NVML_ERROR_UNINITIALIZED;
    if (device < devices || device >= devices + gpu_count())
        return NVML_ERROR_INVALID_ARGUMENT;
    return NVML_SUCCESS;
}

static nvmlReturn_t init(void)
{
    nvmlReturn_t r = env_int("STANDIN_NVML_INIT_ERROR", 0);
    if (r == NVML_SUCCESS)
        initialised++;
    return r;
}

API nvmlReturn_t nvmlInit(void) { return init(); }
API nvmlReturn_t nvmlInit_v2(void) { return init(); }
API nvmlReturn_t nvmlInitWithFlags(unsigned int flags) { (void)flags; return init(); }

API nvmlReturn_t nvmlShutdown(void)
{
    if (!initialised)
        return NVML_ERROR_UNINITIALIZED;
    initialised--;
    return NVML_SUCCESS;
}

API const char *nvmlErrorString(nvmlReturn_t result)
{
    switch (result) {
    case NVML_SUCCESS: return "Success";
    case NVML_ERROR_UNINITIALIZED: return "Uninitialized";
    case NVML_ERROR_INVALID_ARGUMENT: return "Invalid Argument";
    case NVML_ERROR_NOT_SUPPORTED: return "Not Supported";
    case 9: return "Driver Not Loaded";
    case 15: return "GPU is lost";
    default: return "Unknown Error";
    }
}

API nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length)
{
    if (!initialised)
        return NVML_ERROR_UNINITIALIZED;
    if (length < 8)
        return NVML_ERROR_INSUFFICIENT_SIZE;
    snprintf(version, length, "999.99");
    return NVML_SUCCESS;
}

API nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *count)
{
    if (!initialised)
        return NVML_ERROR_UNINITIALIZED;
    *count = gpu_count();
    return NVML_SUCCESS;
}

API nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device)
{
    if (!initialised)
        return NVML_ERROR_UNINITIALIZED;
    if (index >= gpu_count())
        return NVML_ERROR_INVALID_ARGUMENT;
    *device = &devices[index];
    return NVML_SUCCESS;
}

API nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t device, char *name, unsigned int length)
{
    nvmlReturn_t r = check(device);
    if (r)
        return r;
    if (snprintf(name, length, "NVIDIA Stand-in GPU %u", device->index) >= (int)length)
        return NVML_ERROR_INSUFFICIENT_SIZE;
    return NVML_SUCCESS;
}

static nvmlReturn_t pci_info(nvmlDevice_t device, nvmlPciInfo_t *pci)
{
    nvmlReturn_t r = check(device);
    if (r)
        return r;
    memset(pci, 0, sizeof(*pci));
    pci->bus = 0x1b + device->index;
    pci->pciDeviceId = 0x233010de;
    snprintf(pci->busIdLegacy, sizeof(pci->busIdLegacy), "0000:%02X:00.0", pci->bus);
    snprintf(pci->busId, sizeof(pci->busId), "00000000:%02X:00.0", pci->bus);
    return NVML_SUCCESS;
}

API nvmlReturn_t nvmlDeviceGetPciInfo_v2(nvmlDevice_t d, nvmlPciInfo_t *pci) { return pci_info(d, pci); }
API nvmlReturn_t nvmlDeviceGetPciInfo_v3(nvmlDevice_t d, nvmlPciInfo_t *pci) { return pci_info(d, pci); }

/* GPU i's "GPU_PERCENT MEMORY_PERCENT" from the util file (the last line for GPUs beyond it). */
static void read_util(nvmlDevice_t device, nvmlUtilization_t *util)
{
    util->gpu = util->memory = 0;
    const char *path = getenv("STANDIN_NVML_UTIL_FILE");
    FILE *f = path && *path ? fopen(path, "r") : NULL;
    if (!f)
        return;
    unsigned int gpu, memory;
    for (unsigned int line = 0; fscanf(f, "%u %u", &gpu, &memory) == 2; line++) {
        util->gpu = gpu;
        util->memory = memory;
        if (line == device->index)
            break;
    }
    fclose(f);
}

API nvmlReturn_t nvmlDeviceGetUtilizationRates(nvmlDevice_t device, nvmlUtilization_t *util)
{
    nvmlReturn_t r = check(device);
    if (r)
        return r;
    const char *calls = getenv("STANDIN_NVML_CALLS_FILE");
    if (calls && *calls) {
        FILE *f = fopen(calls, "a");
        if (f) {
            fprintf(f, "%d %ld\n", getpid(), (long)syscall(SYS_gettid));
            fclose(f);
        }
    }
    r = env_int("STANDIN_NVML_UTIL_ERROR", 0);
    if (r)
        return r;
    read_util(device, util);
    return NVML_SUCCESS;
}

/* nvmlDeviceGetSamples: samples newer than lastSeenTimeStamp (us); with samples NULL, how many. */
API nvmlReturn_t nvmlDeviceGetSamples(nvmlDevice_t device, int type, unsigned long long lastSeenTimeStamp,
                                      int *sampleValType, unsigned int *sampleCount, nvmlSample_t *samples)
{
    nvmlReturn_t r = check(device);
    if (r)
        return r;
    unsigned long long period = (unsigned long long)env_int("STANDIN_NVML_SAMPLE_MS", 0) * 1000;
    if (!period || type != 1)  /* NVML_GPU_UTILIZATION_SAMPLES */
        return NVML_ERROR_NOT_SUPPORTED;
    if (!sampleValType || !sampleCount)
        return NVML_ERROR_INVALID_ARGUMENT;
    struct timespec now;
    clock_gettime(CLOCK_REALTIME, &now);
    unsigned long long now_us = (unsigned long long)now.tv_sec * 1000000 + now.tv_nsec / 1000;
    unsigned long long first = now_us - 2000000;
    if (lastSeenTimeStamp + 1 > first)
        first = lastSeenTimeStamp + 1;
    first = (first + period - 1) / period * period;
    unsigned int n = first <= now_us ? (unsigned int)((now_us - first) / period + 1) : 0;
    *sampleValType = 1;  /* NVML_VALUE_TYPE_UNSIGNED_INT */
    if (!n)
        return NVML_ERROR_NOT_FOUND;
    if (!samples) {
        *sampleCount = n;
        return NVML_SUCCESS;
    }
    if (n > *sampleCount)
        n = *sampleCount;
    nvmlUtilization_t util;
    read_util(device, &util);
    for (unsigned int i = 0; i < n; i++) {
        samples[i].timeStamp = first + i * period;
        samples[i].sampleValue.uiVal = util.gpu;
    }
    *sampleCount = n;
    return NVML_SUCCESS;
}

API nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory)
{
    nvmlReturn_t r = check(device);
    if (r)
        return r;
    memory->total = 80ull << 30;
    memory->used = (unsigned long long)(device->index + 1) << 30;
    memory->free = memory->total - memory->used;
    return NVML_SUCCESS;
}

API nvmlReturn_t nvmlDeviceGetClockInfo(nvmlDevice_t device, int type, unsigned int *clock)
{
    nvmlReturn_t r = check(device);
    if (r)
        return r;
    if (type < 0 || type > 3)
        return NVML_ERROR_INVALID_ARGUMENT;
    *clock = type == 1 ? 1410 : 1000;  /* NVML_CLOCK_SM = 1 */
    return NVML_SUCCESS;
}

API nvmlReturn_t nvmlDeviceGetPowerUsage(nvmlDevice_t device, unsigned int *power)
{
    nvmlReturn_t r = check(device);
    if (r)
        return r;
    if (env_int("STANDIN_NVML_NO_POWER", 0))
        return NVML_ERROR_NOT_SUPPORTED;
    *power = 250000;
    return NVML_SUCCESS;
}

API nvmlReturn_t nvmlDeviceGetTemperature(nvmlDevice_t device, int sensor, unsigned int *temp)
{
    nvmlReturn_t r = check(device);
    if (r)
        return r;
    if (sensor != 0)  /* NVML_TEMPERATURE_GPU */
        return NVML_ERROR_NOT_SUPPORTED;
    *temp = 40 + device->index;
    return NVML_SUCCESS;
}
