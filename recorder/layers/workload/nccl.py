"""NCCL calls the recorder traces, their argument layouts, and the BPF programs generated for them.

Like recorder/layers/cuda/apis.py: one small entry and return program per exported symbol, which notes
its API and tail-calls one entry body (which reads the arguments by the API's layout) or the return
body (bpf/nccl.bpf.c nccl_dispatch). `pnccl*` aliases share the address of `nccl*` and are not attached
twice.
"""

from __future__ import annotations

from dataclasses import dataclass

# x86-64 System V: PARM1..6 = rdi, rsi, rdx, rcx, r8, r9; then the stack at sp+8, sp+16, ...
# ncclUniqueId (128 bytes) is passed by value in memory: it takes no register and sits at sp+8.
_STACK = "{ u64 st[2] = {}; bpf_probe_read_user(st, sizeof(st), (void *)(PT_REGS_SP(ctx) + 8));"
ARG_LAYOUTS = {
    "none": "",
    # ncclAllReduce/ReduceScatter(send, recv, count, dtype, op, comm, stream)
    "reduce_all": ("e.count = PT_REGS_PARM3(ctx); e.datatype = (s32)PT_REGS_PARM4(ctx);"
                   " e.op = (s32)PT_REGS_PARM5(ctx); e.comm = PT_REGS_PARM6(ctx);"
                   f" {_STACK} e.stream = st[0]; }}"),
    # ncclAllGather(send, recv, sendcount, dtype, comm, stream)
    "gather": ("e.count = PT_REGS_PARM3(ctx); e.datatype = (s32)PT_REGS_PARM4(ctx);"
               " e.comm = PT_REGS_PARM5(ctx); e.stream = PT_REGS_PARM6(ctx); e.op = -1;"),
    # ncclBroadcast(send, recv, count, dtype, root, comm, stream)
    "broadcast": ("e.count = PT_REGS_PARM3(ctx); e.datatype = (s32)PT_REGS_PARM4(ctx);"
                  " e.peer = (s32)PT_REGS_PARM5(ctx); e.comm = PT_REGS_PARM6(ctx); e.op = -1;"
                  f" {_STACK} e.stream = st[0]; }}"),
    # ncclBcast(buff, count, dtype, root, comm, stream)
    "bcast": ("e.count = PT_REGS_PARM2(ctx); e.datatype = (s32)PT_REGS_PARM3(ctx);"
              " e.peer = (s32)PT_REGS_PARM4(ctx); e.comm = PT_REGS_PARM5(ctx);"
              " e.stream = PT_REGS_PARM6(ctx); e.op = -1;"),
    # ncclReduce(send, recv, count, dtype, op, root, comm, stream)
    "reduce": ("e.count = PT_REGS_PARM3(ctx); e.datatype = (s32)PT_REGS_PARM4(ctx);"
               " e.op = (s32)PT_REGS_PARM5(ctx); e.peer = (s32)PT_REGS_PARM6(ctx);"
               f" {_STACK} e.comm = st[0]; e.stream = st[1]; }}"),
    # ncclSend/ncclRecv(buff, count, dtype, peer, comm, stream)
    "p2p": ("e.count = PT_REGS_PARM2(ctx); e.datatype = (s32)PT_REGS_PARM3(ctx);"
            " e.peer = (s32)PT_REGS_PARM4(ctx); e.comm = PT_REGS_PARM5(ctx);"
            " e.stream = PT_REGS_PARM6(ctx); e.op = -1;"),
    # ncclCommInitRank(ncclComm_t *comm, int nranks, ncclUniqueId id, int rank[, config])
    "init": ("e.out_comm = PT_REGS_PARM1(ctx); e.nranks = (s32)PT_REGS_PARM2(ctx);"
             " e.rank = (s32)PT_REGS_PARM3(ctx); e.op = -1; nccl_hash_id(ctx, &e);"),
    # ncclCommDestroy(comm)
    "destroy": "e.comm = PT_REGS_PARM1(ctx); e.op = -1;",
}


@dataclass(frozen=True)
class Api:
    name: str
    kind: str  # 'collective', 'p2p', 'group', 'init', 'destroy'
    layout: str


APIS: tuple[Api, ...] = (
    Api("ncclAllReduce", "collective", "reduce_all"),
    Api("ncclAllGather", "collective", "gather"),
    Api("ncclReduceScatter", "collective", "reduce_all"),
    Api("ncclBroadcast", "collective", "broadcast"),
    Api("ncclBcast", "collective", "bcast"),
    Api("ncclReduce", "collective", "reduce"),
    Api("ncclSend", "p2p", "p2p"),
    Api("ncclRecv", "p2p", "p2p"),
    Api("ncclGroupStart", "group", "none"),
    Api("ncclGroupEnd", "group", "none"),
    Api("ncclCommInitRank", "init", "init"),
    Api("ncclCommInitRankConfig", "init", "init"),
    Api("ncclCommDestroy", "destroy", "destroy"),
)
API_INDEX: dict[str, int] = {api.name: i for i, api in enumerate(APIS)}

# ncclDataType_t and ncclRedOp_t as NCCL numbers them, for the views
DATATYPES = {0: "int8", 1: "uint8", 2: "int32", 3: "uint32", 4: "int64", 5: "uint64", 6: "float16",
             7: "float32", 8: "float64", 9: "bfloat16"}
REDOPS = {0: "sum", 1: "prod", 2: "max", 3: "min", 4: "avg"}


NCCL_BODY_SLOTS = 2  # the size of bpf/nccl.bpf.c's nccl_bodies: the entry body, the return body


def body_programs() -> list[str]:
    """The body programs' names, by their slot in nccl_bodies (recorder/layers/workload/layer.py
    loads them there)."""
    return ["nccl_entry_body", "nccl_return_body"]


def bpf_programs() -> str:
    """C text with the two bodies (the entry's reads each API's arguments by its layout), then an
    entry and a return program per API, each a note of its API and a tail call."""
    cases = []
    for layout in dict.fromkeys(api.layout for api in APIS):
        labels = " ".join(f"case {i}:" for i, api in enumerate(APIS) if api.layout == layout)
        cases.append(f"    {labels} {{ {ARG_LAYOUTS[layout]} break; }}\n")
    parts = [
        f"#if NCCL_BODY_SLOTS != {NCCL_BODY_SLOTS}\n#error \"nccl_bodies' size differs from nccl.py\"\n#endif\n",
        "int nccl_entry_body(struct pt_regs *ctx) {\n"
        "    s64 noted = nccl_noted_api();\n"
        "    if (noted < 0) return 0;\n"
        "    struct nccl_inflight e = {};\n"
        "    if (!nccl_begin(&e)) return 0;\n"
        "    switch (noted) {\n"
        f"{''.join(cases)}"
        "    }\n"
        "    nccl_save(&e, (u32)noted);\n"
        "    PYSTACK_CAPTURE(ctx, e.ts);\n"
        "}\n",
        "int nccl_return_body(struct pt_regs *ctx) {\n"
        "    s64 noted = nccl_noted_api();\n"
        "    return noted < 0 ? 0 : nccl_end(ctx, (u32)noted);\n"
        "}\n",
    ]
    for i in range(len(APIS)):
        parts.append(f"int nccl_entry_{i}(struct pt_regs *ctx) {{ return nccl_dispatch(ctx, {i}, 0); }}\n"
                     f"int nccl_return_{i}(struct pt_regs *ctx) {{ return nccl_dispatch(ctx, {i}, 1); }}\n")
    return "\n".join(parts)


def is_nccl(path: str) -> bool:
    base = path.rsplit("/", 1)[-1]
    return base.startswith("libnccl")
