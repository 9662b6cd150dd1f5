"""NCCL calls the recorder traces, their argument layouts, and the BPF programs generated for them.

Like recorder/layers/cuda.py: one small entry and return program per exported symbol, so the API is a
compile-time constant. `pnccl*` aliases share the address of `nccl*` and are not attached twice.
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


def bpf_programs() -> str:
    parts = []
    for i, api in enumerate(APIS):
        parts.append(
            f"int nccl_entry_{i}(struct pt_regs *ctx) {{\n"
            f"    struct nccl_inflight e = {{}};\n"
            f"    if (!nccl_begin(&e)) return 0;\n"
            f"    {ARG_LAYOUTS[api.layout]}\n"
            f"    nccl_save(&e, {i});\n"
            f"    PYSTACK_CAPTURE(ctx, e.ts);\n"
            f"}}\n"
            f"int nccl_return_{i}(struct pt_regs *ctx) {{ return nccl_end(ctx, {i}); }}\n"
        )
    return "\n".join(parts)


def is_nccl(path: str) -> bool:
    base = path.rsplit("/", 1)[-1]
    return base.startswith("libnccl")
