/* dma: streaming DMA mappings, SWIOTLB bounces and IOMMU faults, from tracepoints only.
 *
 * dma_map_phys (dma_map_page on older kernels) fires for every mapping on the machine, so it is
 * recorded only in target threads' context, and in MODE_ALL one mapping in DMA_MAP_SAMPLE.
 * SWIOTLB bounces and IOMMU faults are rare and say something about the device whoever caused
 * them: all are recorded. dma_map_latency (patch series) adds latency and bounce per mapping.
 */
BPF_RINGBUF_OUTPUT(dma_events, 64);

/* dma_map_phys declares `dir` with this enum (include/linux/dma-direction.h, not included here) */
enum dma_data_direction { DMA_BIDIRECTIONAL = 0, DMA_TO_DEVICE = 1, DMA_FROM_DEVICE = 2, DMA_NONE = 3 };
#define DMA_MAP_SAMPLE 64

static __always_inline int dma_wanted(u64 id)
{
    if (!is_target(id >> 32))
        return 0;
#if TARGET_MODE == MODE_ALL
    return bpf_get_prandom_u32() % DMA_MAP_SAMPLE == 0;
#else
    return 1;
#endif
}

static __always_inline struct dma_event *dma_reserve(u32 kind)
{
    struct dma_event *e = dma_events.ringbuf_reserve(sizeof(*e));
    if (!e) {
        count_drop(PROBE_DMA);
        return 0;
    }
    __builtin_memset(e, 0, sizeof(*e));
    u64 id = bpf_get_current_pid_tgid();
    e->ts = bpf_ktime_get_ns();
    e->pid = id >> 32;
    e->tid = id;
    e->kind = kind;
    bpf_get_current_comm(e->comm, sizeof(e->comm));
    return e;
}

static __always_inline void dma_name(struct dma_event *e, void *args, u32 loc)
{
    bpf_probe_read_kernel_str(e->device, sizeof(e->device), (char *)args + (loc & 0xffff));
}

/* dma_map_phys (recent kernels) and dma_map_page (older) carry the same fields */
static __always_inline int dma_map_send(void *args, u64 phys, u64 dma, u64 size, u64 attrs, s32 dir, u32 loc)
{
    if (!dma_wanted(bpf_get_current_pid_tgid()))
        return 0;
    struct dma_event *e = dma_reserve(DMA_KIND_MAP);
    if (!e)
        return 0;
    e->addr = phys;
    e->dma_addr = dma;
    e->size = size;
    e->attrs = attrs;
    e->dir = dir;
    e->nents = 1;
    dma_name(e, args, loc);
    dma_events.ringbuf_submit(e, ring_wake_deferred(0));
    return 0;
}

#if defined(HAVE_TP_dma_dma_map_phys)
TRACEPOINT_PROBE(dma, dma_map_phys)
{
    return dma_map_send(args, args->phys_addr, args->dma_addr, args->size, args->attrs, args->dir,
                        *(u32 *)&args->data_loc_device);
}
#elif defined(HAVE_TP_dma_dma_map_page)
TRACEPOINT_PROBE(dma, dma_map_page)
{
    return dma_map_send(args, args->phys_addr, args->dma_addr, args->size, args->attrs, args->dir,
                        *(u32 *)&args->data_loc_device);
}
#endif

#ifdef HAVE_TP_swiotlb_swiotlb_bounced
TRACEPOINT_PROBE(swiotlb, swiotlb_bounced)
{
    struct dma_event *e = dma_reserve(DMA_KIND_BOUNCE);
    if (!e)
        return 0;
    e->addr = args->dev_addr;
    e->dma_addr = args->dev_addr;
    e->size = args->size;
    e->attrs = args->dma_mask;
    e->dir = -1;
    e->flags = args->force ? DMA_FLAG_FORCE | DMA_FLAG_BOUNCED : DMA_FLAG_BOUNCED;
    dma_name(e, args, *(u32 *)&args->data_loc_dev_name);
    dma_events.ringbuf_submit(e, ring_wake_deferred(0));
    return 0;
}
#endif

#ifdef HAVE_TP_iommu_io_page_fault
TRACEPOINT_PROBE(iommu, io_page_fault)
{
    struct dma_event *e = dma_reserve(DMA_KIND_IOMMU_FAULT);
    if (!e)
        return 0;
    e->addr = args->iova;
    e->dir = -1;
    e->flags = (u32)args->flags << 16;
    dma_name(e, args, *(u32 *)&args->data_loc_device);
    dma_events.ringbuf_submit(e, ring_wake_deferred(0));
    return 0;
}
#endif

#ifdef HAVE_TP_dma_dma_map_latency
TRACEPOINT_PROBE(dma, dma_map_latency)
{
    if (!dma_wanted(bpf_get_current_pid_tgid()))
        return 0;
    struct dma_event *e = dma_reserve(DMA_KIND_AI_MAP);
    if (!e)
        return 0;
    e->dur = args->latency_ns;
    e->ts -= args->latency_ns;
    e->addr = args->phys_addr;
    e->dma_addr = args->dma_addr;
    e->size = args->size;
    e->attrs = args->attrs;
    e->dir = args->dir;
    e->nents = args->nents;
    e->flags = (args->direct ? DMA_FLAG_DIRECT : 0) | (args->bounced ? DMA_FLAG_BOUNCED : 0);
    dma_name(e, args, *(u32 *)&args->data_loc_device);
    dma_events.ringbuf_submit(e, ring_wake_deferred(0));
    return 0;
}
#endif
