"""CUDA runtime and driver APIs the recorder traces, and the BPF programs generated for them.

Each API has an argument layout (which registers or stack slots hold size, stream, kernel function,
...). One entry and one return program is generated per exported symbol name: it only notes its API
and layout and tail-calls the body program of its kind (launch or not, runtime or driver), which
reads the arguments by the layout, so that each body is compiled and verified once, not once per
API or layout (bpf/cuda.bpf.c cuda_dispatch). Variants (`_v2`, `_ptsz`, `_ptds`) are separate
exported functions and are listed explicitly.
"""

from __future__ import annotations

from dataclasses import dataclass

from recorder.core.libraries import cuda_library_kind

# Argument layouts. Registers follow the x86-64 System V ABI: PARM1..PARM6 = rdi, rsi, rdx, rcx,
# r8, r9; a dim3 passed by value (12 bytes) takes two registers; further arguments are on the
# stack at sp+8, sp+16, ... at the first instruction of the callee.
ARG_LAYOUTS = {
    "none": "",
    "malloc": "e.out_ptr = PT_REGS_PARM1(ctx); e.size = PT_REGS_PARM2(ctx);",
    "malloc_async": (
        "e.out_ptr = PT_REGS_PARM1(ctx); e.size = PT_REGS_PARM2(ctx); e.stream = PT_REGS_PARM3(ctx);"
    ),
    "free": "e.pointer = PT_REGS_PARM1(ctx);",
    "free_async": "e.pointer = PT_REGS_PARM1(ctx); e.stream = PT_REGS_PARM2(ctx);",
    "memcpy": "e.size = PT_REGS_PARM3(ctx); e.memcpy_kind = (s32)PT_REGS_PARM4(ctx);",
    "memcpy_async": (
        "e.size = PT_REGS_PARM3(ctx); e.memcpy_kind = (s32)PT_REGS_PARM4(ctx);"
        " e.stream = PT_REGS_PARM5(ctx);"
    ),
    # cuMemcpyHtoD(dst, src, n), cuMemcpyDtoH(dst, src, n), cuMemcpy(dst, src, n)
    "memcpy_drv": "e.size = PT_REGS_PARM3(ctx);",
    "memcpy_drv_async": "e.size = PT_REGS_PARM3(ctx); e.stream = PT_REGS_PARM4(ctx);",
    "stream": "e.stream = PT_REGS_PARM1(ctx);",
    "event": "e.handle = PT_REGS_PARM1(ctx);",
    # cudaGraphLaunch(exec, stream), cuGraphLaunch(exec, stream)
    "graph_launch": "e.handle = PT_REGS_PARM1(ctx); e.stream = PT_REGS_PARM2(ctx);",
    # cudaGraphInstantiate(cudaGraphExec_t *exec, cudaGraph_t graph, ...): the exec handle it writes
    # is the row's pointer, the graph its handle
    "graph_instantiate": "e.out_ptr = PT_REGS_PARM1(ctx); e.handle = PT_REGS_PARM2(ctx);",
    # cudaStreamEndCapture(stream, cudaGraph_t *graph): the graph it writes is the row's pointer
    "capture_end": "e.stream = PT_REGS_PARM1(ctx); e.out_ptr = PT_REGS_PARM2(ctx);",
    # cudaLaunchKernel(func, dim3 grid, dim3 block, void **args, size_t shmem, cudaStream_t s)
    "launch_rt": (
        "e.function = PT_REGS_PARM1(ctx);"
        " e.grid_x = (u32)PT_REGS_PARM2(ctx); e.grid_y = (u32)(PT_REGS_PARM2(ctx) >> 32);"
        " e.grid_z = (u32)PT_REGS_PARM3(ctx);"
        " e.block_x = (u32)PT_REGS_PARM4(ctx); e.block_y = (u32)(PT_REGS_PARM4(ctx) >> 32);"
        " e.block_z = (u32)PT_REGS_PARM5(ctx);"
        " { u64 st[2] = {}; bpf_probe_read_user(st, sizeof(st), (void *)(PT_REGS_SP(ctx) + 8));"
        "   e.shared_mem = (u32)st[0]; e.stream = st[1]; }"
    ),
    # cuLaunchKernel(f, gx, gy, gz, bx, by, bz, shmem, stream, params, extra)
    "launch_drv": (
        "e.function = PT_REGS_PARM1(ctx);"
        " e.grid_x = (u32)PT_REGS_PARM2(ctx); e.grid_y = (u32)PT_REGS_PARM3(ctx);"
        " e.grid_z = (u32)PT_REGS_PARM4(ctx); e.block_x = (u32)PT_REGS_PARM5(ctx);"
        " e.block_y = (u32)PT_REGS_PARM6(ctx);"
        " { u64 st[3] = {}; bpf_probe_read_user(st, sizeof(st), (void *)(PT_REGS_SP(ctx) + 8));"
        "   e.block_z = (u32)st[0]; e.shared_mem = (u32)st[1]; e.stream = st[2]; }"
    ),
    # cuLaunchKernelEx(const CUlaunchConfig *c, CUfunction f, ...): c = {gridDimX..blockDimZ,
    # sharedMemBytes (u32 each), hStream at offset 32}
    "launch_drv_ex": (
        "e.function = PT_REGS_PARM2(ctx);"
        " { u32 c[10] = {}; bpf_probe_read_user(c, sizeof(c), (void *)PT_REGS_PARM1(ctx));"
        "   e.grid_x = c[0]; e.grid_y = c[1]; e.grid_z = c[2]; e.block_x = c[3];"
        "   e.block_y = c[4]; e.block_z = c[5]; e.shared_mem = c[6];"
        "   e.stream = ((u64)c[9] << 32) | c[8]; }"
    ),
    # cudaLaunchKernelExC(const cudaLaunchConfig_t *c, const void *func, void **args): c = {dim3
    # grid, dim3 block, size_t dynamicSmemBytes at 24, cudaStream_t stream at 32}
    "launch_rt_ex": (
        "e.function = PT_REGS_PARM2(ctx);"
        " { u32 c[10] = {}; bpf_probe_read_user(c, sizeof(c), (void *)PT_REGS_PARM1(ctx));"
        "   e.grid_x = c[0]; e.grid_y = c[1]; e.grid_z = c[2]; e.block_x = c[3];"
        "   e.block_y = c[4]; e.block_z = c[5]; e.shared_mem = c[6];"
        "   e.stream = ((u64)c[9] << 32) | c[8]; }"
    ),
}


@dataclass(frozen=True)
class Api:
    name: str  # the exported symbol
    family: str  # the API without variant suffix, used for baselines (cudaMemcpy_ptds -> cudaMemcpy)
    library: str  # "runtime" (libcudart) or "driver" (libcuda)
    layout: str


def _apis() -> tuple[Api, ...]:
    runtime = {
        "cudaMalloc": "malloc",
        "cudaMallocHost": "malloc",
        "cudaMallocManaged": "malloc",
        "cudaHostAlloc": "malloc",
        "cudaMallocAsync": "malloc_async",
        "cudaFree": "free",
        "cudaFreeHost": "free",
        "cudaFreeAsync": "free_async",
        "cudaLaunchKernel": "launch_rt",
        "cudaLaunchKernelExC": "launch_rt_ex",
        "cudaMemcpy": "memcpy",
        "cudaMemcpyAsync": "memcpy_async",
        "cudaStreamSynchronize": "stream",
        "cudaDeviceSynchronize": "none",
        "cudaEventSynchronize": "event",
        "cudaGraphLaunch": "graph_launch",
        "cudaGraphInstantiate": "graph_instantiate",
        "cudaGraphInstantiateWithFlags": "graph_instantiate",
        "cudaStreamBeginCapture": "stream",
        "cudaStreamEndCapture": "capture_end",
    }
    driver = {
        "cuLaunchKernel": "launch_drv",
        "cuLaunchKernelEx": "launch_drv_ex",
        "cuMemAlloc": "malloc",
        "cuMemAllocAsync": "malloc_async",
        "cuMemAllocHost": "malloc",
        "cuMemFree": "free",
        "cuMemcpy": "memcpy_drv",
        "cuMemcpyAsync": "memcpy_drv_async",
        "cuMemcpyHtoD": "memcpy_drv",
        "cuMemcpyDtoH": "memcpy_drv",
        "cuMemcpyHtoDAsync": "memcpy_drv_async",
        "cuMemcpyDtoHAsync": "memcpy_drv_async",
        "cuStreamSynchronize": "stream",
        "cuCtxSynchronize": "none",
        "cuEventSynchronize": "event",
        "cuGraphLaunch": "graph_launch",
        "cuGraphInstantiate": "graph_instantiate",
        "cuGraphInstantiateWithFlags": "graph_instantiate",
        "cuStreamBeginCapture": "stream",
        "cuStreamEndCapture": "capture_end",
    }
    # Per-thread default stream variants: the runtime exports _ptds (synchronous calls) and _ptsz
    # (calls taking a stream); the driver exports _v2 generations and both suffixes on those.
    out: list[Api] = []
    for base, layout in runtime.items():
        for suffix in ("", "_ptds", "_ptsz"):
            out.append(Api(base + suffix, base, "runtime", layout))
    for base, layout in driver.items():
        for suffix in ("", "_v2", "_ptds", "_ptsz", "_v2_ptds", "_v2_ptsz"):
            out.append(Api(base + suffix, base, "driver", layout))
    return tuple(out)


APIS: tuple[Api, ...] = _apis()
API_INDEX: dict[str, int] = {api.name: i for i, api in enumerate(APIS)}
# runtime APIs come first: an index below this one is a runtime API's (bpf/cuda.bpf.c cuda_nested)
FIRST_DRIVER_API = next(i for i, api in enumerate(APIS) if api.library == "driver")


# Kernel launches: their stacks are taken at the return, when slow or sampled (bpf/cuda.bpf.c), and
# every launch API shares one return program
LAUNCH_LAYOUTS = frozenset({"launch_rt", "launch_drv", "launch_drv_ex", "launch_rt_ex"})
LAUNCH_RETURN = "cuda_launch_return"


def is_launch(api: Api) -> bool:
    return api.layout in LAUNCH_LAYOUTS


def return_program(api: Api) -> str:
    """The name of the program attached at the API's return."""
    return LAUNCH_RETURN if is_launch(api) else f"cuda_return_{API_INDEX[api.name]}"


CUDA_BODY_SLOTS = 64  # the size of bpf/cuda.bpf.c's cuda_bodies
LAYOUT_INDEX: dict[str, int] = {layout: i for i, layout in enumerate(ARG_LAYOUTS)}


def _kind(api: Api) -> tuple[int, int]:
    """(launch, runtime): the APIs of one kind share an entry body, which reads their arguments by
    their layout."""
    return int(is_launch(api)), int(api.library == "runtime")


def _bodies(chosen: tuple[Api, ...]) -> dict[tuple[int, int], int]:
    """(launch, runtime) -> slot of its entry body in cuda_bodies, in the APIs' order; the two
    return bodies (driver, runtime) follow."""
    slots: dict[tuple[int, int], int] = {}
    for api in chosen:
        slots.setdefault(_kind(api), len(slots))
    if len(slots) + 2 > CUDA_BODY_SLOTS:
        raise ValueError(f"{len(slots) + 2} CUDA body programs do not fit cuda_bodies ({CUDA_BODY_SLOTS})")
    return slots


def body_programs(names: list[str] | None = None) -> list[str]:
    """The body programs' names, by their slot in cuda_bodies (recorder/layers/cuda/layer.py loads
    them there)."""
    chosen = APIS if names is None else tuple(APIS[API_INDEX[n]] for n in names)
    slots = _bodies(chosen)
    return [f"cuda_body_{slot}" for slot in range(len(slots))] + ["cuda_return_body_0", "cuda_return_body_1"]


def bpf_programs(names: list[str] | None = None, counts: bool = False) -> str:
    """C text with an entry program per API symbol and a return program per API that is no launch
    (all known ones by default), each a note of its API and its argument layout and a tail call, and
    the bodies they call: an entry body per kind of API (launch or not, runtime or driver) and a
    return body per library. A driver API's entry body first checks whether its thread is inside a
    runtime call (which then makes the one event); a runtime API's marks its thread as inside it.
    `counts`: a launch's entry counts it in its thread's tally and keeps one in N as a sample
    (bpf/cuda.bpf.c cuda_count_launch), no return program is attached to it, and every other call's
    entry sends the thread's counts first (cuda_tally_flush)."""
    chosen = APIS if names is None else tuple(APIS[API_INDEX[n]] for n in names)
    slots = _bodies(chosen)
    returns = len(slots)
    parts = [f"#if CUDA_BODY_SLOTS != {CUDA_BODY_SLOTS}\n#error \"cuda_bodies' size differs from apis.py\"\n#endif\n"]
    for (launch, runtime), slot in slots.items():
        # with counts a driver launch inside a runtime launch is found by the tally (cuda_count_launch)
        nested = "" if runtime else (f"    if (cuda_nested(ctx, api, {0 if counts else launch}, {FIRST_DRIVER_API}))"
                                      " return 0;\n")
        entry_ip = "    e.entry_ip = PT_REGS_IP(ctx); e.entry_sp = PT_REGS_SP(ctx);\n" if launch and not counts else ""
        end = "return 0;" if launch else "return cuda_capture(ctx, e.ts, api);"
        save = f"    cuda_save(&e, api, {launch}, {runtime});\n"
        if launch and counts:
            save, end = "", f"return cuda_count_launch(ctx, &e, api, {runtime});"
        flush = "    cuda_tally_flush();\n" if counts and not launch else ""
        layouts = dict.fromkeys(api.layout for api in chosen if _kind(api) == (launch, runtime))
        cases = "".join(f"    case {LAYOUT_INDEX[layout]}: {{ {ARG_LAYOUTS[layout]} break; }}\n" for layout in layouts)
        parts.append(
            f"int cuda_body_{slot}(struct pt_regs *ctx) {{\n"
            "    u32 layout = 0;\n"
            "    s64 noted = cuda_noted_api(&layout);\n"
            "    if (noted < 0) return 0;\n"
            "    u32 api = (u32)noted;\n"
            f"{nested}"
            "    struct cuda_inflight e = {};\n"
            "    if (!cuda_begin(&e, api)) return 0;\n"
            f"{flush}"
            "    switch (layout) {\n"
            f"{cases}"
            "    }\n"
            f"{entry_ip}"
            f"{save}"
            f"    {end}\n"
            "}\n"
        )
    for runtime in (0, 1):
        parts.append(f"int cuda_return_body_{runtime}(struct pt_regs *ctx) {{\n"
                     "    u32 layout = 0;\n"
                     "    s64 noted = cuda_noted_api(&layout);\n"
                     f"    return noted < 0 ? 0 : cuda_end(ctx, (u32)noted, {runtime});\n"
                     "}\n")
    for api in chosen:
        i = API_INDEX[api.name]
        launch, runtime = _kind(api)
        layout = LAYOUT_INDEX[api.layout]
        parts.append(f"int cuda_entry_{i}(struct pt_regs *ctx) {{ return cuda_dispatch(ctx, {i}, "
                     f"{slots[(launch, runtime)]}, {layout}); }}\n")
        if not launch:
            parts.append(f"int cuda_return_{i}(struct pt_regs *ctx) {{ return cuda_dispatch(ctx, {i}, "
                         f"{returns + runtime}, {layout}); }}\n")
    parts.append(f"int {LAUNCH_RETURN}(struct pt_regs *ctx) {{ return cuda_launch_end(ctx, {FIRST_DRIVER_API}); }}\n")
    return "\n".join(parts)


library_kind = cuda_library_kind  # 'runtime', 'driver' or None for a mapped file name
