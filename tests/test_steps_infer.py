"""The step heuristic (recorder/steps_infer.py) on synthetic call sequences whose steps are known,
and on a real SQLite file: one thread per process, markers win, idempotent. The same heuristic on
real BPF recordings is in tests/test_steps_infer_bpf.py."""

from __future__ import annotations

import random
import time
from pathlib import Path

from recorder import steps_infer
from recorder.steps_infer import SyncCall, step_starts
from store.db import open_store

MS = 1_000_000
T0 = 10**12


def trace(template: list[tuple[str, float, float]], lengths: list[float]) -> tuple[list[SyncCall], list[int]]:
    """(calls, step start ts) of steps of the given lengths (ms), each making the template's calls
    (key, ms after the step start, ms long) in order."""
    calls, starts = [], []
    ts = T0
    for length in lengths:
        starts.append(ts)
        calls += [SyncCall(ts + int(at * MS), int(dur * MS), key) for key, at, dur in template]
        ts += int(length * MS)
    return calls, starts


def first_calls(calls: list[SyncCall], starts: list[int]) -> list[int]:
    """ts of the first call at or after each step start."""
    stamps = sorted(c.ts for c in calls)
    return [next(t for t in stamps if t >= s) for s in starts]


def with_noise(calls: list[SyncCall], key: str, every: int, rng: random.Random) -> list[SyncCall]:
    """calls plus a `key` call at a random time inside every `every`-th gap between calls."""
    out = list(calls)
    for i in range(0, len(calls) - 1, every):
        a, b = calls[i], calls[i + 1]
        lo = a.ts + a.dur + 1
        if b.ts - lo > 10:
            out.append(SyncCall(rng.randrange(lo, b.ts - 5), 2, key))
    return sorted(out, key=lambda c: c.ts)


SYNC = [("cudaStreamSynchronize", 0.7, 4.0)]


def test_one_synchronisation_per_step():
    """train_steps.py's shape: malloc, launches, one stream synchronisation, host work."""
    calls, starts = trace(SYNC, [12.0] * 40)
    assert step_starts(calls) == [c.ts for c in calls]
    assert len(step_starts(calls)) == 40


def test_step_starts_at_its_first_wait_after_the_loops_idle_time():
    """nccl_ranks.py's shape: synchronise, all-reduce, synchronise. The first synchronisation of a
    step follows the loop's own work (the longest idle time), so steps start there, not at the
    all-reduce (the only call that occurs once per step) or at the second synchronisation. The
    recording began during step 0's all-reduce, so the trace starts with a second synchronisation."""
    template = [("cudaStreamSynchronize", 0.05, 4.0), ("ncclAllReduce", 4.06, 0.2),
                ("cudaStreamSynchronize", 4.27, 4.0)]
    calls, starts = trace(template, [8.3] * 30)
    calls = calls[2:]
    assert step_starts(calls) == first_calls(calls, starts[1:])


def test_slow_and_irregular_steps_do_not_break_it():
    rng = random.Random(5)
    lengths = [rng.uniform(9.0, 15.0) for _ in range(60)]
    lengths[30] = 400.0  # a stall in the middle
    lengths[31] = 90.0
    calls, starts = trace(SYNC, lengths)
    assert step_starts(calls) == first_calls(calls, starts)


def test_noise_calls_and_a_logging_sync_every_ten_steps():
    """A device->host copy at a random time in every 12th gap (one step in six) and a logging
    synchronisation (its own call site) every 10 steps: still one step per real step."""
    rng = random.Random(7)
    template = [("cudaStreamSynchronize@1", 0.5, 3.0), ("ncclAllReduce", 3.6, 0.3)]
    calls, starts = trace(template, [rng.uniform(10.0, 11.0) for _ in range(80)])
    calls = with_noise(calls, "cudaMemcpy@9", 12, rng)
    calls += [SyncCall(s + 8 * MS, MS // 10, "cudaStreamSynchronize@2") for s in starts[::10]]
    calls.sort(key=lambda c: c.ts)
    found = step_starts(calls)
    assert len(found) == 80
    assert all(abs(f - s) < 4 * MS for f, s in zip(found, starts, strict=True))


def test_gradient_all_reduces_are_not_steps():
    """A data-parallel step: 25 bucket all-reduces in the backward pass, one loss synchronisation.
    The all-reduces are regular among themselves; the forward pass (the long gap between the last
    all-reduce of a step and the first of the next) shows they divide a longer cycle."""
    template = [("cudaStreamSynchronize@3", 40.0, 1.0)] + [("ncclAllReduce", 45.0 + 2.0 * i, 0.5)
                                                            for i in range(25)]
    calls, starts = trace(template, [100.0] * 20)
    assert step_starts(calls) == [c.ts for c in calls if c.key.startswith("cudaStream")]
    # a thread with the all-reduces alone (the autograd thread) shows no steps at all
    assert step_starts([c for c in calls if c.key == "ncclAllReduce"]) == []


def test_two_identical_waits_per_step_need_a_stride():
    """No call occurs once per step: every second synchronisation begins a step."""
    template = [("cudaDeviceSynchronize", 1.0, 2.0), ("cudaDeviceSynchronize", 3.5, 1.0)]
    calls, starts = trace(template, [10.0] * 25)
    assert step_starts(calls) == first_calls(calls, starts)


def test_no_periodicity_gives_nothing():
    rng = random.Random(11)
    keys = ["cudaStreamSynchronize", "ncclAllReduce", "cudaMemcpy", "cuCtxSynchronize"]
    ts, random_keys, random_times = T0, [], []
    for _ in range(300):
        ts += int(rng.expovariate(1 / (5 * MS)))
        random_keys.append(SyncCall(ts, MS // 10, rng.choice(keys)))
        random_times.append(SyncCall(ts, MS // 10, "cudaStreamSynchronize"))
    assert step_starts(random_keys) == []
    assert step_starts(random_times) == []  # one kind of call, but at random times
    assert step_starts([]) == []


def test_too_few_repetitions_give_nothing():
    calls, _ = trace(SYNC, [12.0] * steps_infer.MIN_STEPS)  # MIN_STEPS anchors: one step short
    assert step_starts(calls) == []
    calls, _ = trace(SYNC, [12.0] * (steps_infer.MIN_STEPS + 1))
    assert len(step_starts(calls)) == steps_infer.MIN_STEPS + 1


# -- on a database ----------------------------------------------------------------------------------
def _db(path: Path):
    s = open_store(path, create=True)
    s.db["session"].insert({
        "started_ts": T0, "stopped_ts": T0 + 10**10, "wall_offset_ns": 0, "status": "complete",
        "recorder_pid": 1, "hostname": "h", "kernel_release": "k", "boot_id": "b", "cpu_count": 2,
        "target": "synthetic", "command": "test", "tool_version": "test"})
    s.conn.executemany("INSERT INTO cuda_api (id, name, family, library, arguments) VALUES (?, ?, ?, 'runtime', ?)",
                       [(0, "cudaStreamSynchronize", "cudaStreamSynchronize", "stream"),
                        (1, "cudaLaunchKernel", "cudaLaunchKernel", "launch_rt"),
                        (2, "cudaMemcpy", "cudaMemcpy", "memcpy")])
    s.conn.execute("INSERT INTO nccl_api (id, name, kind) VALUES (0, 'ncclAllReduce', 'collective')")
    s.conn.executemany("INSERT INTO process (id, session_id, pid, first_ts) VALUES (?, 1, ?, 0)",
                       [(1, 100), (2, 200), (3, 300)])
    # process 1: a training thread and a helper thread; 2: marked by its script; 3: no sync calls
    s.conn.executemany("INSERT INTO thread (id, session_id, tid, process_id, first_ts) VALUES (?, 1, ?, ?, 0)",
                       [(1, 100, 1), (2, 101, 1), (3, 200, 2), (4, 300, 3)])
    return s


def _calls(s, thread_id: int, api_id: int, starts: list[int], kind: int | None = None) -> None:
    s.conn.executemany("INSERT INTO cuda_call (session_id, ts, dur, thread_id, api_id, ret, memcpy_kind,"
                       " cgroup_id) VALUES (1, ?, ?, ?, ?, 0, ?, 0)",
                       [(ts, MS, thread_id, api_id, kind) for ts in starts])


def test_one_thread_per_process_markers_win_and_idempotent(tmp_path):
    s = _db(tmp_path / "r.db")
    steps = [T0 + i * 12 * MS for i in range(30)]
    _calls(s, 1, 0, steps)                                   # the training loop: 30 steps
    _calls(s, 2, 2, [T0 + i * 100 * MS for i in range(8)], kind=2)  # a helper copying every 100 ms
    _calls(s, 1, 1, [t + MS // 2 for t in steps])             # launches are not synchronising
    _calls(s, 3, 0, steps)                                   # process 2 marks its own steps
    s.conn.execute("INSERT INTO step_mark (session_id, ts, thread_id, step) VALUES (1, ?, 3, 0)", (T0 - MS,))
    s.conn.executemany("INSERT INTO nccl_call (session_id, ts, dur, thread_id, api_id, ret, cgroup_id)"
                       " VALUES (1, ?, 100, 4, 0, 0, 0)", [(T0 + i * 7919,) for i in range(3)])
    s.conn.commit()
    assert steps_infer.infer_steps(s, 1) == 30
    rows = s.conn.execute("SELECT thread_id, step, ts FROM step_mark WHERE inferred = 1 ORDER BY ts").fetchall()
    assert rows == [(1, i, ts) for i, ts in enumerate(steps)]
    assert steps_infer.infer_steps(s, 1) == 30  # again: the same rows, not twice as many
    again = s.conn.execute("SELECT thread_id, step, ts FROM step_mark WHERE inferred = 1 ORDER BY ts").fetchall()
    assert again == rows
    # the marked process's steps come from its markers; checked against them, the heuristic agrees
    assert s.conn.execute("SELECT count(*) FROM step_mark WHERE thread_id = 3").fetchone()[0] == 1
    unmarked = steps_infer.inferred_steps(s, 1, skip_marked=False)
    assert [ts for tid, ts, _ in unmarked if tid == 3] == steps
    # the step view shows them as inferred
    view = s.conn.execute("SELECT count(*), min(inferred) FROM step WHERE process_id = 1").fetchone()
    assert view == (30, 1)
    s.close()


def test_a_long_session_is_inferred_quickly():
    """50,000 steps of three synchronising calls (150,000 calls): seconds at session stop."""
    calls, _ = trace([("cudaStreamSynchronize", 0.1, 0.5), ("ncclAllReduce", 0.7, 0.2),
                      ("cudaStreamSynchronize", 1.0, 0.5)], [2.0] * 50_000)
    t = time.perf_counter()
    assert len(step_starts(calls)) == 50_000
    assert time.perf_counter() - t < 10
