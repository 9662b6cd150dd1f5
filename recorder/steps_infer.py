"""Steps without markers: step boundaries recovered from the periodic structure of the trace.

A training step ends with the host waiting for the device (a stream or device synchronisation, a
copy of the loss to the host, a collective), so the synchronising calls of the training thread
repeat once per step. For each thread of a process that called no `recorder.step`:

1. Its synchronising calls in time order, each named by a key: the CUDA API family
   (cudaStreamSynchronize, cudaDeviceSynchronize, cudaEventSynchronize, cuStreamSynchronize,
   cuCtxSynchronize, cuEventSynchronize, a synchronous cudaMemcpy device->host or of unknown
   direction, cuMemcpyDtoH, cuMemcpy) plus its Python call site when the stack was recorded (a
   logging `.item()` is not the loss's `.item()`), or the NCCL collective / point-to-point name.
2. Candidate anchors: for each key, stride k (1..MAX_STRIDE) and phase (0..k-1), the key's
   occurrences phase, phase + k, phase + 2k, ... A stride above 1 covers steps in which every
   synchronising call occurs more than once; it counts only when each of the k occurrences has a
   regular place in the step (the k sub-intervals are each regular). A candidate describes steps
   when
   - it has at least MIN_STEPS + 1 anchors (MIN_STEPS whole steps);
   - the keys between consecutive anchors are the same, in the same order, for at least
     CONSISTENCY of the steps, after leaving out keys seen in fewer than 1 - CONSISTENCY of the
     steps (noise: an occasional copy, a logging synchronisation every 10 steps);
   - the time between consecutive anchors is regular: its median absolute deviation is at most
     MAX_DISPERSION of its median (robust: a few slow steps do not count);
   - it does not divide a longer cycle: intervals longer than LONG_INTERVAL x the median that
     recur at a regular spacing (at least MIN_STEPS of them) and hold at least
     MAX_CYCLE_SHARE of the time mean the anchor marks sub-steps (e.g. each of the 25 gradient
     all-reduces of a step, the forward pass being the long interval).
3. The shortest period wins (most anchors, within SAME_PERIOD): when calls repeat at two scales,
   e.g. a logging synchronisation every 10 steps, the inner loop is the step. Among those, the
   anchor preceded by the longest idle time (median time from the previous synchronising call's
   return to the anchor's entry) wins: the host's own work between steps (data loading, logging,
   the loop) comes before a step's first wait for the device.
4. A step begins at each anchor's entry. Per process, the thread with the most steps gives the
   process's steps, numbered 0, 1, ... in time order, stored as step_mark rows with inferred = 1.

The boundary is the step's first synchronising call, not the top of the loop: an inferred step
begins later than a marker would by the host work before that call, so a stall there (a slow data
loader) counts in the previous inferred step; each inferred start still lies inside the marked step
it stands for (tests/test_steps_infer_bpf.py). Threads that
never synchronise, or whose synchronising calls repeat fewer than MIN_STEPS times, get no steps.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import pairwise
from statistics import median

from store.db import Store

MIN_STEPS = 5
MAX_STRIDE = 4
CONSISTENCY = 0.8
MAX_DISPERSION = 0.3
LONG_INTERVAL = 2.0
MAX_CYCLE_SHARE = 0.25
SAME_PERIOD = 0.9

SYNC_FAMILIES = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize",
                 "cuStreamSynchronize", "cuCtxSynchronize", "cuEventSynchronize", "cuMemcpyDtoH", "cuMemcpy")
MEMCPY_TO_HOST = (2, 4)  # cudaMemcpyDeviceToHost, cudaMemcpyDefault (direction from the pointers)


@dataclass(frozen=True)
class SyncCall:
    """One synchronising call of a thread."""

    ts: int  # ns at entry
    dur: int  # ns entry -> return
    key: str  # what repeats: API family or NCCL name, with the call site when known


@dataclass(frozen=True)
class Pattern:
    """The calls that begin each step of a thread: every stride-th call of one key from phase."""

    key: str
    stride: int
    phase: int
    anchors: tuple[int, ...]  # positions in the thread's call list, one per step
    dispersion: float  # median absolute deviation / median of the step lengths
    idle_before: float  # ns, median time from the previous call's return to an anchor's entry


def step_starts(calls: Sequence[SyncCall]) -> list[int]:
    """The ts of each inferred step start of one thread's calls (in time order); [] if none."""
    pattern = find_pattern(calls)
    return [calls[i].ts for i in pattern.anchors] if pattern else []


def find_pattern(calls: Sequence[SyncCall]) -> Pattern | None:
    """The step pattern of a thread's synchronising calls, None when they show no steps."""
    keys = [c.key for c in calls]
    positions: dict[str, list[int]] = defaultdict(list)
    for i, key in enumerate(keys):
        positions[key].append(i)
    candidates = []
    for where in positions.values():
        for stride in range(1, MAX_STRIDE + 1):
            if len(where) < stride * (MIN_STEPS + 1):
                break
            for phase in range(stride):
                pattern = _candidate(calls, keys, where, stride, phase)
                if pattern:
                    candidates.append(pattern)
    if not candidates:
        return None
    most = max(len(p.anchors) for p in candidates)
    shortest = [p for p in candidates if len(p.anchors) >= SAME_PERIOD * most]
    return max(shortest, key=lambda p: (p.idle_before, -p.dispersion, -p.anchors[0]))


def _candidate(calls: Sequence[SyncCall], keys: list[str], where: list[int], stride: int,
               phase: int) -> Pattern | None:
    """The pattern anchored on every stride-th occurrence (from phase) of one key, if it is one."""
    anchors = where[phase::stride]
    if len(anchors) < MIN_STEPS + 1 or not _same_calls_between(keys, anchors):
        return None
    lengths = [calls[b].ts - calls[a].ts for a, b in pairwise(anchors)]
    dispersion = _dispersion(lengths)
    if dispersion > MAX_DISPERSION or _divides_longer_cycle(lengths):
        return None
    if stride > 1:
        # the key's occurrences within a step must each have their own regular place in it, or
        # grouping them by stride only averages out random times
        parts = [ts - prev for prev, ts in pairwise(calls[i].ts for i in where[phase:])]
        if any(_dispersion(parts[k::stride]) > MAX_DISPERSION for k in range(stride)):
            return None
    idle = [calls[i].ts - calls[i - 1].ts - calls[i - 1].dur for i in anchors if i > 0]
    return Pattern(keys[anchors[0]], stride, phase, tuple(anchors), dispersion, median(idle) if idle else 0.0)


def _dispersion(lengths: Sequence[int]) -> float:
    """Median absolute deviation over median: 0 for identical lengths, robust to a few outliers."""
    typical = median(lengths)
    return median(abs(x - typical) for x in lengths) / typical if typical > 0 else float("inf")


def _same_calls_between(keys: list[str], anchors: list[int]) -> bool:
    """True when the keys between consecutive anchors are the same sequence in most steps. Keys
    seen in fewer than 1 - CONSISTENCY of the steps are noise (an occasional copy, a logging
    synchronisation every 10 steps) and are left out first, so that several kinds of noise,
    each rare, do not add up to an inconsistent pattern."""
    units = [tuple(keys[a + 1:b]) for a, b in pairwise(anchors)]
    seen_in = Counter(key for unit in units for key in set(unit))
    rare = {key for key, n in seen_in.items() if n < (1 - CONSISTENCY) * len(units)}
    if rare:
        units = [tuple(key for key in unit if key not in rare) for unit in units]
    return Counter(units).most_common(1)[0][1] >= CONSISTENCY * len(units)


def _divides_longer_cycle(lengths: list[int]) -> bool:
    """True when long intervals recur at a regular spacing and hold a large share of the time:
    the anchor then repeats within each step, and the long interval is the rest of the step. Slow
    steps at irregular times (stalls) or rare ones (a checkpoint every 500 steps) do not count."""
    typical = median(lengths)
    long = [i for i, x in enumerate(lengths) if x > LONG_INTERVAL * typical]
    if len(long) < MIN_STEPS or _dispersion([b - a for a, b in pairwise(long)]) > MAX_DISPERSION:
        return False
    return sum(lengths[i] for i in long) >= MAX_CYCLE_SHARE * sum(lengths)


# -- the database -----------------------------------------------------------------------------------
# Each thread's synchronising calls; {cuda_range} and {nccl_range} narrow the rows read (the flight
# recorder reads only those written since its last look). The API ids are looked up once, not
# joined per call: most calls are launches, and only the synchronising ones reach the join.
_SYNC_CALLS = (
    "SELECT c.thread_id, c.ts, c.dur, a.family || coalesce('@' || c.python_stack_id, '')"
    " FROM cuda_call c JOIN cuda_api a ON a.id = c.api_id"
    " WHERE c.session_id = ? AND c.ret = 0 AND (c.api_id IN (SELECT id FROM cuda_api WHERE family IN ({families}))"
    "  OR (c.api_id IN (SELECT id FROM cuda_api WHERE family = 'cudaMemcpy')"
    "      AND coalesce(c.memcpy_kind, 4) IN ({kinds}))){cuda_range}"
    " UNION ALL"
    " SELECT n.thread_id, n.ts, n.dur, a.name FROM nccl_call n JOIN nccl_api a ON a.id = n.api_id"
    " WHERE n.session_id = ? AND a.kind IN ('collective', 'p2p'){nccl_range}"
    " ORDER BY 1, 2")


def sync_call_rows(conn, session_id: int, cuda_ids: tuple[int, int] | None = None,
                   nccl_ids: tuple[int, int] | None = None,
                   skip_threads: Iterable[int] = ()) -> list[tuple[int, int, int, str]]:
    """(thread_id, ts, dur, key) of the session's synchronising calls, by thread and time; with
    cuda_ids / nccl_ids (lo, hi) only the calls whose row id is in (lo, hi] of that table, and no
    call still open (a call in flight is written as an open row only for an incident's copy);
    none of the threads in skip_threads (row ids)."""
    skip = ",".join(str(int(t)) for t in skip_threads)
    sql = _SYNC_CALLS.format(
        families=",".join("?" * len(SYNC_FAMILIES)), kinds=",".join("?" * len(MEMCPY_TO_HOST)),
        cuda_range=(" AND c.id > ? AND c.id <= ? AND c.open = 0" if cuda_ids else "")
        + (f" AND c.thread_id NOT IN ({skip})" if skip else ""),
        nccl_range=(" AND n.id > ? AND n.id <= ? AND n.open = 0" if nccl_ids else "")
        + (f" AND n.thread_id NOT IN ({skip})" if skip else ""))
    params = (session_id, *SYNC_FAMILIES, *MEMCPY_TO_HOST, *(cuda_ids or ()), session_id, *(nccl_ids or ()))
    return conn.execute(sql, params).fetchall()


def sync_calls(store: Store, session_id: int) -> dict[int, list[SyncCall]]:
    """Each thread's synchronising CUDA and NCCL calls in the session, in time order."""
    out: dict[int, list[SyncCall]] = defaultdict(list)
    for thread_id, ts, dur, key in sync_call_rows(store.conn, session_id):
        out[thread_id].append(SyncCall(ts, dur, key))
    return dict(out)


def inferred_steps(store: Store, session_id: int, *, skip_marked: bool = True) -> list[tuple[int, int, int]]:
    """(thread_id, ts, step) of the steps the heuristic finds, one thread per process.

    Processes with recorder.step markers are left out unless skip_marked is False (which is how
    the heuristic is checked against the markers)."""
    process_of = dict(store.conn.execute("SELECT id, process_id FROM thread WHERE session_id = ?",
                                         (session_id,)).fetchall())
    marked = set()
    if skip_marked:
        marked = {p for (p,) in store.conn.execute(
            "SELECT DISTINCT t.process_id FROM step_mark m JOIN thread t ON t.id = m.thread_id"
            " WHERE m.session_id = ? AND m.inferred = 0", (session_id,))}
    best: dict[int, tuple[int, list[int]]] = {}  # process (or -thread without one) -> its steps
    for thread_id, calls in sync_calls(store, session_id).items():
        process = process_of.get(thread_id)
        if process in marked:
            continue
        group = process if process is not None else -thread_id
        starts = step_starts(calls)
        if len(starts) > len(best.get(group, (0, []))[1]):
            best[group] = (thread_id, starts)
    return [(thread_id, ts, n) for thread_id, starts in best.values() for n, ts in enumerate(starts)]


def infer_steps(store: Store, session_id: int) -> int:
    """Replace the session's inferred steps by the heuristic's; returns the rows stored.

    Idempotent: running it again on the same recording stores the same rows. A session whose causal
    links were stored already (a flight recorder's incident, cut and finished before its steps are
    inferred) has them stored again: the steps' links are part of them."""
    rows = inferred_steps(store, session_id)
    with store.conn:
        store.conn.execute("DELETE FROM step_mark WHERE session_id = ? AND inferred = 1", (session_id,))
        store.conn.executemany(
            "INSERT INTO step_mark (session_id, ts, thread_id, step, inferred) VALUES (?, ?, ?, ?, 1)",
            [(session_id, ts, thread_id, step) for thread_id, ts, step in rows])
        if store.conn.execute("SELECT 1 FROM causal_link_session WHERE session_id = ?", (session_id,)).fetchone():
            store.store_links(session_id)
    return len(rows)
