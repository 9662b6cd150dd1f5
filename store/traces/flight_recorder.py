"""NCCL Flight Recorder dumps as PyTorch writes them (one file per rank, `TORCH_NCCL_DEBUG_INFO_TEMP_FILE`
+ rank, on a watchdog timeout or on request): a pickled dict, or the same dict as JSON.

    {"version": "2.x", "pg_config": {name: {"name", "desc", "ranks": "[0, 1]"}},
     "entries": [{"record_id", "process_group": (name, desc), "collective_seq_id", "p2p_seq_id", "op_id",
                  "profiling_name": "nccl:all_reduce", "state": "scheduled" | "started" | "completed",
                  "time_created_ns", "time_discovered_started_ns", "time_discovered_completed_ns",
                  "timeout_ms", "input_sizes", "output_sizes", "frames", ...}], ...}

A pickle can name any class and run it. The dump holds only dicts, lists, tuples, strings, numbers,
booleans and None, none of which pickle looks up by name, so the reader refuses every class lookup
(and persistent id): a file that needs one is not a dump and is refused without running anything.
"""

from __future__ import annotations

import io
import json
import pickle
import re
from dataclasses import dataclass, field
from pathlib import Path

from store.traces.chrome import TraceError

PICKLE_PROTOCOL_2_PLUS = b"\x80"
RANK_SUFFIX = re.compile(r"(\d+)(?:\.json|\.pkl|\.pickle)?$")


class _DataOnly(pickle.Unpickler):
    """Builds containers and scalars only: any class or function a pickle names is refused."""

    def find_class(self, module: str, name: str) -> object:
        raise pickle.UnpicklingError(f"the file asks for {module}.{name}")

    def persistent_load(self, pid: object) -> object:
        raise pickle.UnpicklingError("the file asks for a persistent object")


@dataclass
class Record:
    pg_name: str
    pg_desc: str | None
    collective_seq_id: int | None
    p2p_seq_id: int | None
    op_id: int | None
    profiling_name: str
    state: str
    ts: int | None
    started_ts: int | None
    completed_ts: int | None
    timeout_ms: int | None
    input_sizes: str | None
    output_sizes: str | None


@dataclass
class Dump:
    path: Path
    rank: int
    version: str
    pg_config: dict
    records: list[Record] = field(default_factory=list)


def looks_like_pickle(head: bytes) -> bool:
    return head[:1] == PICKLE_PROTOCOL_2_PLUS


def load_pickle(path: Path, raw: bytes) -> object:
    try:
        return _DataOnly(io.BytesIO(raw)).load()
    except pickle.UnpicklingError as e:
        raise TraceError(f"{path} is a pickle but not a Flight Recorder dump ({e}): nothing was run or imported") \
            from None
    except (EOFError, ValueError, IndexError, KeyError, TypeError, AttributeError, MemoryError,
            RecursionError) as e:
        raise TraceError(f"{path} is a truncated or damaged pickle ({type(e).__name__}): copy the dump again") \
            from None


def is_dump(doc: object) -> bool:
    return isinstance(doc, dict) and isinstance(doc.get("entries"), list) and "pg_config" in doc


def _opt_int(value: object) -> int | None:
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, int):
        return value
    try:
        return int(str(value))
    except ValueError:
        return None


def read(path: Path, doc: object) -> Dump:
    if not is_dump(doc):
        raise TraceError(f"{path} is not a Flight Recorder dump (no 'entries' and 'pg_config'): pass the files "
                         "PyTorch wrote to TORCH_NCCL_DEBUG_INFO_TEMP_FILE")
    assert isinstance(doc, dict)
    rank = _opt_int(doc.get("rank"))
    if rank is None:
        m = RANK_SUFFIX.search(path.name)
        if m is None:
            raise TraceError(f"{path}: the dump does not say its rank and its name does not end in it "
                             "(PyTorch names them PREFIX<rank>): rename it, e.g. nccl_trace_rank_3")
        rank = int(m.group(1))
    raw_config = doc.get("pg_config")
    config: dict = raw_config if isinstance(raw_config, dict) else {}
    dump = Dump(path=path, rank=rank, version=str(doc.get("version", "")), pg_config=config)
    for i, e in enumerate(doc["entries"]):
        if not isinstance(e, dict):
            raise TraceError(f"{path}: entry {i} is not a record: not a Flight Recorder dump")
        group = e.get("process_group")
        if isinstance(group, (list, tuple)) and group:
            name, desc = str(group[0]), (str(group[1]) if len(group) > 1 else None)
        else:
            name, desc = str(e.get("pg_id", "")), None
        state = str(e.get("state", ""))
        if state not in ("scheduled", "started", "completed"):
            raise TraceError(f"{path}: entry {i} has state {state!r}: not a Flight Recorder dump this version reads")
        sizes = [json.dumps(e.get(k)) if e.get(k) is not None else None for k in ("input_sizes", "output_sizes")]
        dump.records.append(Record(
            pg_name=name, pg_desc=desc, collective_seq_id=_opt_int(e.get("collective_seq_id")),
            p2p_seq_id=_opt_int(e.get("p2p_seq_id")), op_id=_opt_int(e.get("op_id", e.get("record_id"))),
            profiling_name=str(e.get("profiling_name", "")), state=state, ts=_opt_int(e.get("time_created_ns")),
            started_ts=_opt_int(e.get("time_discovered_started_ns")),
            completed_ts=_opt_int(e.get("time_discovered_completed_ns")), timeout_ms=_opt_int(e.get("timeout_ms")),
            input_sizes=sizes[0], output_sizes=sizes[1]))
    return dump
