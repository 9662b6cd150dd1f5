"""Lining a profiler trace up with a recording of the same process (`recorder import --join`).

The trace's clock is Unix time (Kineto's baseTimeNanoseconds + ts); the recording's is the host's
CLOCK_MONOTONIC. The recording's wall_offset_ns gives a first guess of the offset between them, but
the two realtime readings may differ by milliseconds, more than a kernel lasts. Both saw the same
runtime calls, though: the trace's `cudaLaunchKernel` on thread T at t is the recorder's uprobe row
of `cudaLaunchKernel` on thread T at t + offset, give or take the probes' few microseconds. So:

1. every pair of same-named calls on the same thread within SEARCH_NS of the guess votes for its
   offset (bucketed by BUCKET_NS); the bucket with most votes wins;
2. each trace call is then matched to the nearest recorded call of its name and thread within
   MATCH_NS of that offset, and the offset is the median of the matched pairs' differences.

The alignment holds when at least MIN_MATCHES calls, and at least MIN_SHARE of the trace's calls
that the recorder could have seen, matched; otherwise nothing is joined and the reason is kept.
"""

from __future__ import annotations

import bisect
import statistics
from collections import Counter
from dataclasses import dataclass

from store.db import Store
from store.traces.chrome import Trace

SEARCH_NS = 10_000_000_000   # realtime clocks of one host agree within 10 s
BUCKET_NS = 50_000           # votes are counted per 50 us of offset
MATCH_NS = 200_000           # a matched pair lies within 200 us of the voted offset
MIN_MATCHES = 5
MIN_SHARE = 0.5
VOTERS = 400                 # trace calls that vote (spread over the trace)


@dataclass
class Alignment:
    offset_ns: int | None        # add to the trace's ts to get the recording's; None: not aligned
    matches: int
    candidates: int              # trace calls of names and threads the recording has
    residual_ns: int | None      # median distance of matched pairs from the offset
    note: str


def align(store: Store, session: dict, trace: Trace) -> Alignment:
    sid = session["id"]
    recorded: dict[tuple[int, int, str], list[int]] = {}
    for r in store.query(
            "SELECT p.pid, t.tid, a.name, c.ts FROM cuda_call c JOIN cuda_api a ON a.id = c.api_id"
            " JOIN thread t ON t.id = c.thread_id LEFT JOIN process p ON p.id = t.process_id"
            " WHERE c.session_id = ? ORDER BY c.ts", (sid,)):
        recorded.setdefault((r["pid"], r["tid"], r["name"]), []).append(r["ts"])
    if not recorded:
        return Alignment(None, 0, 0, None, f"session {sid} recorded no CUDA calls to line the trace's runtime calls "
                                           "up with (record with the cuda layer)")
    calls = [op for op in trace.host if op.kind == "runtime" and (op.pid, op.tid, op.name) in recorded]
    if not calls:
        names = {op.name for op in trace.host if op.kind == "runtime"}
        return Alignment(None, 0, 0, None,
                         "none of the trace's runtime calls is on a process and thread the recording traced with the "
                         f"same name ({len(names)} names in the trace, {len(recorded)} in the recording): another "
                         "process, or pids seen through another pid namespace")
    guess = trace.base_ns - session["wall_offset_ns"]
    votes: Counter[int] = Counter()
    step = max(1, len(calls) // VOTERS)
    for op in calls[::step]:
        times = recorded[(op.pid, op.tid, op.name)]
        at = op.ts + guess
        lo = bisect.bisect_left(times, at - SEARCH_NS)
        hi = bisect.bisect_right(times, at + SEARCH_NS)
        for ts in times[lo:hi]:
            votes[(ts - op.ts - guess) // BUCKET_NS] += 1
    if not votes:
        return Alignment(None, 0, len(calls), None,
                         f"no recorded call lies within {SEARCH_NS // 1_000_000_000} s of the trace's by the realtime "
                         "clocks: the trace and the recording cover different times")
    bucket = votes.most_common(1)[0][0]
    offset = guess + bucket * BUCKET_NS + BUCKET_NS // 2
    diffs = []
    for op in calls:
        times = recorded[(op.pid, op.tid, op.name)]
        at = op.ts + offset
        i = bisect.bisect_left(times, at)
        near = [times[j] for j in (i - 1, i) if 0 <= j < len(times)]
        best = min(near, key=lambda ts: abs(ts - at)) if near else None
        if best is not None and abs(best - at) <= MATCH_NS:
            diffs.append(best - op.ts)
    if len(diffs) < MIN_MATCHES or len(diffs) < MIN_SHARE * len(calls):
        return Alignment(None, len(diffs), len(calls), None,
                         f"only {len(diffs)} of the trace's {len(calls)} runtime calls on recorded threads matched a "
                         "recorded call: the trace is not of this recording's process and time")
    final = int(statistics.median(diffs))
    residual = int(statistics.median(abs(d - final) for d in diffs))
    return Alignment(final, len(diffs), len(calls), residual,
                     f"aligned on {len(diffs)} of {len(calls)} runtime calls (median residual "
                     f"{residual / 1000:.1f} us); trace clock + {final} ns = the recording's")
