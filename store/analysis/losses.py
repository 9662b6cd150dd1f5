"""What a session lost, per layer and reason, and in which window: the `loss` table read for the report.

A `loss` row is a count of records of one kind (`probe`) lost in the one-second window starting at `ts`
(for block requests aged out of the in-flight map: the second their bios were queued). The probe names
are the recorder layers' own: each layer declares its names with the layer they belong to, what was
lost and why, and the session stores them in `layer_vocabulary` at its start; they are read from there.
`KNOWN` holds the words of sessions recorded before that table (and of recordings written without a
recorder, the demos). A name neither knows keeps its own words.

A layer with a loss in a report's window has not been "checked and clean" there: `lossy_layers()` says
which, and the report words each loss as "block I/O requests: 16,680 requests lost after 12:03:07
(in-flight map full)".
"""

from __future__ import annotations

from store.db import Store

NS = 1_000_000_000

# probe -> (layer, what was lost, why) of sessions without `layer_vocabulary` rows; the layers declare
# their words since (recorder/layers/*: `losses`), so a new layer's words are not added here
KNOWN: dict[str, tuple[str, str, str]] = {
    "sched:offcpu ring buffer": ("sched", "off-CPU intervals", "ring buffer full"),
    "sched off-CPU map full": ("sched", "off-CPU intervals", "off-CPU map full"),
    "cuda ring buffer": ("cuda", "CUDA calls", "ring buffer full"),
    "cuda in-flight map full": ("cuda", "CUDA calls", "in-flight map full"),
    "cuda call's API note overwritten": ("cuda", "CUDA calls",
                                         "another thread's call on the same CPU overwrote the API its probe noted"),
    "task ring buffer": ("task", "process and thread events", "ring buffer full"),
    "block ring buffer": ("block", "requests", "ring buffer full"),
    "block in-flight map full": ("block", "requests", "in-flight map full"),
    "block request completion not seen": ("block", "requests", "completion not seen"),
    "block request aged out": ("block", "requests", "no end seen, aged out of the in-flight map"),
    "mm ring buffer": ("mm", "memory events", "ring buffer full"),
    "mm reclaim map full": ("mm", "reclaim intervals", "open-reclaim map full"),
    "net ring buffer": ("net", "TCP retransmits", "ring buffer full"),
    "dma ring buffer": ("dma", "DMA events", "ring buffer full"),
    "nccl ring buffer": ("nccl", "NCCL calls", "ring buffer full"),
    "nccl in-flight map full": ("nccl", "NCCL calls", "in-flight map full"),
    "nccl call's API note overwritten": ("nccl", "NCCL calls",
                                         "another thread's call on the same CPU overwrote the API its probe noted"),
    "marker ring buffer": ("markers", "step and lineage marks", "ring buffer full"),
    "checkpoint ring buffer": ("checkpoint", "checkpoint events", "ring buffer full"),
    "checkpoint descriptor map full": ("checkpoint", "checkpoint files", "descriptor map full"),  # before v14
    "checkpoint map full": ("checkpoint", "checkpoint file operations", "descriptor or call map full"),
    "nvml_sample": ("gpu", "GPU samples", "the GPU did not answer"),
    "ring record of unexpected size": ("recorder", "ring records", "unexpected size"),
}

# probe name prefixes of counts whose layer is in the name: "python stack <reason>",
# "bpf program <name> skipped (<layer>)"
PREFIXES: tuple[tuple[str, str, str], ...] = (
    ("python stack ", "python", "Python stacks"),
)


def vocabulary(store: Store, session_id: int) -> dict[str, tuple[str, str, str]]:
    """probe -> (layer, what was lost, why) of the loss words the session's layers declared."""
    return {r["word"]: (r["layer"], r["what"], r["why"]) for r in store.query(
        "SELECT word, layer, what, why FROM layer_vocabulary WHERE session_id = ? AND kind = 'loss'", (session_id,))}


def describe(probe: str, declared: dict[str, tuple[str, str, str]] | None = None) -> tuple[str, str, str]:
    """(layer, what was lost, why) of a `loss.probe` name, from the session's declared words if given."""
    if declared and probe in declared:
        return declared[probe]
    if probe in KNOWN:
        return KNOWN[probe]
    for prefix, layer, what in PREFIXES:
        if probe.startswith(prefix):
            return layer, what, probe[len(prefix):]
    if probe.startswith("bpf program ") and probe.endswith(")") and " skipped (" in probe:
        # "bpf program sched_waking skipped (sched)": the kernel did not run it (recursion)
        name, layer = probe[len("bpf program "):-1].rsplit(" skipped (", 1)
        short = name.rsplit("__", 1)[-1]  # tracepoint__sched__sched_waking -> sched_waking
        return layer, f"{short} runs", "the kernel skipped them: another BPF program was running on the CPU"
    head = probe.split(" ", 1)[0].split(":", 1)[0]
    return head, "events", probe


def losses(store: Store, session_id: int, start: int | None = None, end: int | None = None) -> list[dict]:
    """The session's losses per probe, in [start, end) when given (a row's second overlapping the window
    counts: the count is per second), largest first: layer, what, why, count, first and last ns."""
    where, params = "session_id = ?", [session_id]
    if start is not None and end is not None:
        where += " AND ts + ? > ? AND ts < ?"
        params += [NS, start, end]
    rows = store.query(f"SELECT probe, sum(dropped) AS n, min(ts) AS first, max(ts) AS last FROM loss"
                       f" WHERE {where} GROUP BY probe HAVING n > 0 ORDER BY n DESC, probe", tuple(params))
    out = []
    declared = vocabulary(store, session_id) if rows else {}
    for r in rows:
        layer, what, why = describe(r["probe"], declared)
        out.append({"layer": layer, "probe": r["probe"], "what": what, "reason": why, "count": r["n"],
                    "first_ts": r["first"], "last_ts": r["last"] + NS})
    return out


def lossy_layers(lost: list[dict]) -> set[str]:
    return {x["layer"] for x in lost}


def wording(loss: dict, label: str, first_utc: str) -> str:
    """'block I/O requests: 16,680 requests lost after 12:03:07 (in-flight map full)'."""
    return f"{label}: {loss['count']:,} {loss['what']} lost after {first_utc} ({loss['reason']})"
