"""The workload's metrics, live: per traced rank, what Prometheus needs to name the rank holding its
job back, and why, while the job runs (`--metrics-file`, `--metrics-listen`; docs/flight-recorder.md).

In data-parallel training the collective of every step evens the ranks' step times out, so the step
time of a rank does not find the straggler: the rank that arrived last at the collective is the one
that waited least in it, while its peers waited for it. So each rank exports the seconds it waited
inside its collectives (the call and the stream synchronisation after it, as the report's
nccl_collective_wait view counts them), by communicator and operation; the shipped rules
(packaging/prometheus/) compare the ranks of a job.

Once a second `WorkloadWatch.tick()` reads the rows written since its last look, by row id (no
index on ts while recording; SQLite filters and sums, few rows reach Python):

- step marks (recorder.step): each thread's step times (a histogram), its steps and the stalled
  ones, judged as the flight recorder judges them (the report's stall rule over the steps before);
  a process that marks no steps has them inferred live from the period of its synchronising calls,
  as the flight recorder infers them (recorder/steps_live.py), and judged the same way
  (`workload_steps_inferred` says which a rank's are);
- NCCL collectives and the stream synchronisation that follows each on its thread and stream;
- the off-CPU intervals (view offcpu; a wait for a CPU after a sleep or a sched_yield is left out: a
  polling loop, such as a collective waiting for its peers, makes many, each of a wakeup's usual
  cost), reclaim and dirty-throttle pauses of the threads that mark
  steps or call NCCL (a rank's critical path; its DataLoader workers' idle sleeps are not lost
  time), as seconds lost by cause kind (store/analysis/kinds: the kinds whose `lost_time` is that
  breakdown);
- the CUDA calls (not launches, which are counted, not timed) slow against the calls before them
  of their family and size, by the report's slow-call rule (slow_call_rule), their time past that
  baseline as lost to slow_cuda_call (live, the baseline is the median of the last
  SLOW_BASELINE_S looks' mean durations, which one slow call among many barely moves); a call of
  a family and size with no baseline yet counts whole once it takes ONCE_NS (the first
  allocation that eats a step); a stream synchronisation after a collective is the collective's
  wait, not a slow call;
- the NCCL calls in flight now (entered and not returned, as the session's layers answer them through
  its handle, recorder/core/participant.py): the oldest one's age, per rank (a hang).

Labels: the job identity the recorder read from each process's environment (recorder/core/job.py:
job id, rank, local rank, world size, pod) and the node. Never a step number or a PID. Processes of
the same identity share their series (a rank restarted continues its counters). At most
MAX_RANKS identities and MAX_COLLECTIVES (communicator, operation) pairs per identity: the rest is
folded into `other` and counted (`workload_series_folded_total`).
"""

from __future__ import annotations

import bisect
import sqlite3
import statistics
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from recorder.core.inflight import CallInFlight
from recorder.metrics import Metric
from recorder.steps_live import InferredStepWatch
from store.analysis.kinds import KINDS
from store.analysis.kinds.family import IO_REASONS
from store.db.rules import SlowCallRule, StallRule

NS = 1_000_000_000
MAX_RANKS = 64            # identities (ranks) one recorder exports: a node runs 8 or 16
MAX_COLLECTIVES = 16      # (communicator, operation) pairs per rank
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
PAIR_WAIT_NS = 3 * NS     # a collective's synchronisation is looked for this long after it ended
PENDING_COLLECTIVES = 8192  # collectives per (thread, stream) waiting for their synchronisation
STALL_QUERIES_PER_TICK = 8  # stalled steps whose cause kind is looked up each second (the rest: 'unexplained')
HISTORY_S = 120           # how far back a stalled step's rows are looked for
SLOW_BASELINE_S = 30      # per-second medians a call family's live baseline is taken over
ONCE_NS = 50_000_000      # a call with no baseline of its family and size yet counts whole from this long
IDENTITY = ("job_id", "rank", "local_rank", "world_size", "node", "pod")
OTHER = "other"


def _lost_kind(cause: str, detail: str | None = None) -> str:
    """The cause kind (store/analysis/kinds) whose own lost time is the breakdown row (cause, detail),
    as Kind.lost_time declares it; I/O waits are the generic kind of their family."""
    if cause == "blocked" and detail in IO_REASONS:
        return "blocked_io"
    for kind in KINDS.values():
        if kind.lost_time and kind.lost_time[0] == cause and (kind.lost_time[1] is None or detail in kind.lost_time[1]):
            return kind.name
    return cause if cause in KINDS else ""


# the breakdown (store/views/0008_causes.sql step_cause vocabulary) -> cause kind, from the registry
LOST_KINDS = {
    ("cpu_wait", None): _lost_kind("cpu_wait"),
    ("blocked", "io"): _lost_kind("blocked", "io"),
    ("blocked", "uninterruptible"): _lost_kind("blocked", "uninterruptible"),
    ("blocked", "futex"): _lost_kind("blocked", "futex"),
    ("reclaim", None): _lost_kind("reclaim"),
    ("dirty_throttle", None): _lost_kind("dirty_throttle"),
    ("nccl_wait", None): _lost_kind("nccl_wait"),
}
SLOW_CALL = "slow_cuda_call"
assert SLOW_CALL in KINDS  # its lost time is the excess over the baseline, computed here

# per API and size class of the calls since the last look: their count and mean (SQLite groups them,
# no sort, no join: a job writes thousands a second), for the family's baseline
_CUDA_MEANS = """
SELECT api_id, coalesce(size_class, -1), count(*), avg(dur) FROM cuda_call
WHERE id > ? AND id <= ? AND session_id = ? AND open = 0 GROUP BY 1, 2
"""
# the calls long enough to be slow against any baseline, of the watched threads
_CUDA_LONG = """
SELECT c.thread_id, c.ts, c.dur, a.family, coalesce(c.size_class, -1), c.api_id FROM cuda_call c
JOIN cuda_api a ON a.id = c.api_id
WHERE c.id > ? AND c.id <= ? AND c.session_id = ? AND c.open = 0 AND c.dur >= ? AND c.thread_id IN ({threads})
ORDER BY c.id
"""

_OFFCPU = """
SELECT thread_id, reason, sum(CASE WHEN reason IN ('sleep', 'yield') THEN 0 ELSE runq_dur END),
       sum(dur - runq_dur), max(id) FROM offcpu
WHERE id > ? AND id <= ? AND session_id = ? AND open = 0 AND thread_id IN ({threads}) {during}
GROUP BY thread_id, reason
"""


@dataclass
class Rank:
    """The series of one identity (a rank)."""

    labels: dict[str, str]
    buckets: list[int] = field(default_factory=lambda: [0] * len(STEP_BUCKETS))
    step_sum: float = 0.0
    steps: int = 0
    stalled: int = 0
    wait: dict[tuple[str, str], float] = field(default_factory=dict)     # (comm, op) -> seconds
    collectives: dict[tuple[str, str], int] = field(default_factory=dict)
    lost: dict[str, float] = field(default_factory=dict)                # cause kind -> seconds
    in_flight_s: float = 0.0
    last_stall: tuple[int | None, str, float] | None = None  # (step, None: inferred; cause kind, unix time)
    inferred: bool = False  # its steps are inferred (it marks none)

    def step(self, seconds: float) -> None:
        self.steps += 1
        self.step_sum += seconds
        i = bisect.bisect_left(STEP_BUCKETS, seconds)
        if i < len(STEP_BUCKETS):
            self.buckets[i] += 1


@dataclass
class _Thread:
    thread_id: int
    rank: Rank
    last: tuple[int, int] | None = None          # (ts, step) of its last mark
    durs: deque[int] = field(default_factory=deque)
    collectives: deque[tuple[int, int]] = field(default_factory=lambda: deque(maxlen=4096))  # (ts, wait ns)
    slow: deque[tuple[int, int]] = field(default_factory=lambda: deque(maxlen=4096))  # (ts, excess ns) of slow calls


class WorkloadWatch:
    """Reads what was written since its last look; keeps each rank's series (metrics())."""

    def __init__(self, monitor: sqlite3.Connection, session_id: int, rule: StallRule, node: str,
                 wall_offset_ns: int, in_flight: Callable[[], Iterable[CallInFlight]] | None = None,
                 slow_rule: SlowCallRule | None = None) -> None:
        self.monitor = monitor
        self.session_id = session_id
        self.rule = rule
        self.node = node
        self.wall_offset_ns = wall_offset_ns
        # () -> every NCCL call in flight now (SessionHandle.in_flight('nccl_call'): the layers' answer)
        self.in_flight = in_flight
        self.baseline_steps = max(rule.neighbours, rule.min_baseline_steps)
        self.tables = ("step_mark", "nccl_call", "cuda_call", "offcpu_interval", "reclaim_interval", "dirty_throttle")
        self.last = {t: self._top(t) for t in self.tables}
        self.ranks: dict[tuple[str, ...], Rank] = {}
        self.threads: dict[int, _Thread] = {}
        self.processes: dict[int, Rank | None] = {}  # process id -> its rank (None: identity not read yet)
        self.by_pid: dict[int, Rank] = {}
        self.unknown: set[int] = set()  # threads whose identity is not written yet (this look)
        self.folded = {"rank": 0, "collective": 0}
        self.pending: dict[tuple[int, int], deque[tuple[int, int, str, str]]] = {}  # (thread, stream) -> calls
        self.offcpu_tops: deque[tuple[int, int]] = deque()  # (ts, top id) of each look: a stall's rows
        self.stall_queries = 0
        self.ticks = 0
        self.cost_s = 0.0  # CPU time spent in tick(), for the benchmark and the metrics
        self._sync_ids = self._ids("SELECT id FROM cuda_api WHERE family IN ('cudaStreamSynchronize', "
                                   "'cuStreamSynchronize')")
        self._collective_ids = self._ids("SELECT id FROM nccl_api WHERE kind IN ('collective', 'p2p')")
        self._ops = dict(monitor.execute("SELECT id, name FROM nccl_api").fetchall())
        self._comms: dict[tuple[int, int], str] = {}  # (process id, handle) -> comm hash
        self.slow_rule = slow_rule or SlowCallRule(2.0, 1_000_000, 5)
        self.slow_floor = max(self.slow_rule.min_excess_dur, rule.min_excess_dur)
        # (family, size) -> (mean, calls) of each look: the baseline is the median of the last looks' means
        self.call_history: dict[tuple[str, int], deque[tuple[int, int]]] = {}
        self._families: dict[int, str] = {}  # cuda_api id -> family
        self.collective_threads: set[int] = set()  # their synchronisations are their collectives' waits
        self.marked: set[int] = set()  # threads that mark steps: the others' steps may be inferred
        self._stalls: list[tuple[_Thread, int | None, int, int]] = []  # stalled steps this look: (thread, step, span)
        self.inferred = InferredStepWatch(monitor, session_id, rule, wall_offset_ns, on_step=self._inferred_step)

    # -- reading ----------------------------------------------------------------------------------
    def _ids(self, sql: str) -> str:
        return ",".join(str(i) for (i,) in self.monitor.execute(sql)) or "-1"

    def _top(self, table: str) -> int:
        try:
            return self.monitor.execute(f"SELECT coalesce(max(id), 0) FROM {table}").fetchone()[0]
        except sqlite3.OperationalError:  # a table this recording does not have
            return 0

    def tick(self, now: int) -> None:
        began = time.process_time()
        self.ticks += 1
        tops = {t: self._top(t) for t in self.tables}
        self.stall_queries = 0
        self.unknown.clear()
        self._marks(tops["step_mark"])
        self._collectives(tops["nccl_call"], tops["cuda_call"], now)
        self.inferred.check(now, self.marked)  # the steps of processes that mark none (_inferred_step)
        self._slow_calls(tops["cuda_call"])
        for t, step, start, end in self._stalls:  # judged once this look's waits and slow calls are in
            t.rank.last_stall = (step, self._stall_kind(t.thread_id, t, start, end), (end + self.wall_offset_ns) / NS)
        self._stalls.clear()
        self._lost(tops)
        self.offcpu_tops.append((now, tops["offcpu_interval"]))
        while self.offcpu_tops and now - self.offcpu_tops[0][0] > HISTORY_S * NS:
            self.offcpu_tops.popleft()
        self._in_flight(now)
        self.last = tops
        self.cost_s += time.process_time() - began

    def _thread(self, thread_id: int) -> _Thread | None:
        t = self.threads.get(thread_id)
        if t is not None:
            return t
        if thread_id in self.unknown:
            return None
        row = self.monitor.execute("SELECT process_id FROM thread WHERE id = ?", (thread_id,)).fetchone()
        rank = self._rank(row[0]) if row and row[0] is not None else None
        if rank is None:
            self.unknown.add(thread_id)  # its process's identity is not written yet: the next look
            return None
        t = self.threads[thread_id] = _Thread(thread_id, rank, durs=deque(maxlen=self.baseline_steps))
        return t

    def _rank(self, process_id: int) -> Rank | None:
        if process_id in self.processes and self.processes[process_id] is not None:
            return self.processes[process_id]
        row = self.monitor.execute(
            "SELECT pid, environ_status, job_rank, job_local_rank, job_world_size, coalesce(run_id, slurm_job_id, "
            "master_addr), coalesce(pod_namespace || '/' || pod_name, pod_name, pod_uid) FROM process WHERE id = ?",
            (process_id,)).fetchone()
        if row is None or row[1] is None:
            return None
        pid, _, rank, local, world, job, pod = row
        labels = {"job_id": job or "", "rank": "" if rank is None else str(rank),
                  "local_rank": "" if local is None else str(local), "world_size": "" if world is None else str(world),
                  "node": self.node, "pod": pod or ""}
        key = tuple(labels[k] for k in IDENTITY)
        r = self.ranks.get(key)
        if r is None:
            if len(self.ranks) >= MAX_RANKS:
                self.folded["rank"] += 1
                key = ("", OTHER, "", "", self.node, "")
                r = self.ranks.get(key)
                labels = dict(zip(IDENTITY, key, strict=True))
            if r is None:
                r = self.ranks[key] = Rank(labels)
        self.processes[process_id] = r
        self.by_pid[pid] = r
        return r

    def _marks(self, top: int) -> None:
        rows = self.monitor.execute("SELECT thread_id, ts, step FROM step_mark WHERE id > ? AND id <= ? "
                                    "AND session_id = ? AND inferred = 0 ORDER BY id",
                                    (self.last["step_mark"], top, self.session_id)).fetchall()
        rule = self.rule
        for thread_id, ts, step in rows:
            self.marked.add(thread_id)
            t = self._thread(thread_id)
            if t is None:
                continue
            if t.last is not None:
                prev_ts, prev_step = t.last
                dur = ts - prev_ts
                t.rank.step(dur / NS)
                if len(t.durs) >= self.baseline_steps:
                    median = statistics.median(t.durs)
                    if rule.stalled(dur, median):
                        t.rank.stalled += 1
                        self._stalls.append((t, prev_step, prev_ts, ts))
                t.durs.append(dur)
            t.last = (ts, step)

    def _inferred_step(self, thread_id: int, start: int, dur: int, stalled: bool) -> None:
        """A step of a process that marks none ended (InferredStepWatch, as the flight recorder
        infers them): counted and judged as a marked one; its number is the report's to give."""
        t = self._thread(thread_id)
        if t is None:
            return
        r = t.rank
        r.inferred = True
        r.step(dur / NS)
        if stalled:
            r.stalled += 1
            self._stalls.append((t, None, start, start + dur))

    def _slow_calls(self, top: int) -> None:
        """Time lost in CUDA calls slow against the calls of their family and size before them."""
        last = self.last["cuda_call"]
        if top <= last:
            return
        rule = self.slow_rule
        long = []
        if self.threads:
            threads = ",".join(str(t) for t in self.threads)
            long = self.monitor.execute(_CUDA_LONG.format(threads=threads),
                                        (last, top, self.session_id, self.slow_floor)).fetchall()
        sync_ids = {int(i) for i in self._sync_ids.split(",")}
        for thread_id, ts, dur, family, size_class, api_id in long:
            if api_id in sync_ids and thread_id in self.collective_threads:
                continue  # a collective's wait (nccl_wait)
            past = self.call_history.get((family, size_class))
            calls = sum(n for _, n in past) if past else 0
            if calls >= rule.min_baseline_calls:
                base = int(statistics.median(m for m, _ in past or ()))
                if dur < rule.ratio * base or dur - base < self.slow_floor:
                    continue
                excess = dur - base
            elif dur >= ONCE_NS:
                excess = dur  # no baseline of its own: the first allocation, a checkpoint's sync
            else:
                continue
            t = self.threads[thread_id]
            t.rank.lost[SLOW_CALL] = t.rank.lost.get(SLOW_CALL, 0.0) + excess / NS
            t.slow.append((ts, excess))
        seconds: dict[tuple[str, int], list[float]] = {}  # (family, size) -> [calls, their time]
        for api_id, size_class, n, mean in self.monitor.execute(_CUDA_MEANS, (last, top, self.session_id)):
            family = self._families.get(api_id)
            if family is None:
                self._families = dict(self.monitor.execute("SELECT id, family FROM cuda_api").fetchall())
                family = self._families.get(api_id, "?")
            acc = seconds.setdefault((family, size_class), [0, 0.0])
            acc[0] += n
            acc[1] += n * mean
        for key, (n, total) in seconds.items():
            self.call_history.setdefault(key, deque(maxlen=SLOW_BASELINE_S)).append((int(total / n), int(n)))

    def _collectives(self, top_nccl: int, top_cuda: int, now: int) -> None:
        """Each collective's wait: the call, and the first stream synchronisation after it on its
        thread and stream (NCCL enqueues asynchronously: on a GPU the wait is in that sync)."""
        calls = self.monitor.execute(
            f"SELECT c.thread_id, c.ts, c.dur, c.api_id, c.handle, c.stream, t.process_id FROM nccl_call c "
            f"JOIN thread t ON t.id = c.thread_id WHERE c.id > ? AND c.id <= ? AND c.session_id = ? "
            f"AND c.open = 0 AND c.api_id IN ({self._collective_ids}) ORDER BY c.id",
            (self.last["nccl_call"], top_nccl, self.session_id)).fetchall()
        for thread_id, ts, dur, api_id, handle, stream, process_id in calls:
            if self._thread(thread_id) is None:
                continue
            self.collective_threads.add(thread_id)
            comm = self._comm(process_id, handle)
            waiting = self.pending.setdefault((thread_id, stream or 0), deque())
            if len(waiting) >= PENDING_COLLECTIVES:  # never synchronised: the oldest counts as its call alone
                self._waited(thread_id, *waiting.popleft(), None)
            waiting.append((ts, dur, comm, self._ops.get(api_id, "?")))
        if self.pending:
            threads = ",".join(str(t) for t in {k[0] for k in self.pending})
            syncs = self.monitor.execute(
                f"SELECT thread_id, ts, dur, stream FROM cuda_call WHERE id > ? AND id <= ? AND session_id = ? "
                f"AND open = 0 AND api_id IN ({self._sync_ids}) AND thread_id IN ({threads}) ORDER BY id",
                (self.last["cuda_call"], top_cuda, self.session_id)).fetchall()
            for thread_id, ts, dur, stream in syncs:
                queued = self.pending.get((thread_id, stream or 0))
                while queued and queued[0][0] + queued[0][1] <= ts:
                    c_ts, c_dur, comm, op = queued.popleft()
                    # the first sync after the call is its own; earlier calls with none get none
                    self._waited(thread_id, c_ts, c_dur, comm, op,
                                 (ts, dur) if not queued or queued[0][0] > ts else None)
        # a collective that no synchronisation followed within PAIR_WAIT_NS counts as its call alone
        for key, waiting in list(self.pending.items()):
            while waiting and waiting[0][0] + waiting[0][1] < now - PAIR_WAIT_NS:
                c_ts, c_dur, comm, op = waiting.popleft()
                self._waited(key[0], c_ts, c_dur, comm, op, None)
            if not waiting:
                del self.pending[key]

    def _waited(self, thread_id: int, ts: int, dur: int, comm: str, op: str, sync: tuple[int, int] | None) -> None:
        """A collective returned (at ts, for dur) and the synchronisation after it (ts, dur), if any:
        the rank waited the time in both (as view nccl_collective_wait counts it)."""
        t = self.threads[thread_id]
        wait = dur + (sync[1] if sync else 0)
        r = t.rank
        key = (comm, op)
        if key not in r.wait and len(r.wait) >= MAX_COLLECTIVES:
            self.folded["collective"] += 1
            key = (OTHER, OTHER)
        r.wait[key] = r.wait.get(key, 0.0) + wait / NS
        r.collectives[key] = r.collectives.get(key, 0) + 1
        nccl = LOST_KINDS[("nccl_wait", None)]
        r.lost[nccl] = r.lost.get(nccl, 0.0) + wait / NS
        t.collectives.append((ts, wait))

    def _comm(self, process_id: int, handle: int | None) -> str:
        key = (process_id, handle or 0)
        comm = self._comms.get(key)
        if comm is None:
            row = self.monitor.execute("SELECT comm_hash FROM nccl_comm WHERE process_id = ? AND handle = ? "
                                       "ORDER BY id DESC LIMIT 1", key).fetchone()
            if row is None:
                return "unknown"  # its init is not written yet: looked up again with the next call
            comm = self._comms[key] = f"{row[0] & (2**64 - 1):016x}"
        return comm

    def _lost(self, tops: dict[str, int]) -> None:
        if not self.threads:
            return
        threads = ",".join(str(t) for t in self.threads)
        for thread_id, reason, runq, blocked, _ in self.monitor.execute(
                _OFFCPU.format(threads=threads, during=""),
                (self.last["offcpu_interval"], tops["offcpu_interval"], self.session_id)):
            r = self.threads[thread_id].rank
            for kind, ns in ((LOST_KINDS[("cpu_wait", None)], runq),
                             (LOST_KINDS.get(("blocked", reason), ""), blocked)):
                if kind and ns:
                    r.lost[kind] = r.lost.get(kind, 0.0) + ns / NS
        for table, cause in (("reclaim_interval", "reclaim"), ("dirty_throttle", "dirty_throttle")):
            if tops[table] <= self.last[table]:
                continue
            kind = LOST_KINDS[(cause, None)]
            for thread_id, ns in self.monitor.execute(
                    f"SELECT thread_id, sum(max(dur, 0)) FROM {table} WHERE id > ? AND id <= ? AND session_id = ? "
                    f"AND thread_id IN ({threads}) GROUP BY thread_id",
                    (self.last[table], tops[table], self.session_id)):
                r = self.threads[thread_id].rank
                r.lost[kind] = r.lost.get(kind, 0.0) + (ns or 0) / NS

    def _stall_kind(self, thread_id: int, t: _Thread, start: int, end: int) -> str:
        """The cause kind that lost the stalled step [start, end) the most time on its thread: its
        off-CPU time by reason, and its collectives' waits."""
        lost: dict[str, int] = {}
        nccl = sum(w for ts, w in t.collectives if start <= ts < end)
        if nccl:
            lost[LOST_KINDS[("nccl_wait", None)]] = nccl
        slow = sum(x for ts, x in t.slow if start <= ts < end)
        if slow:
            lost[SLOW_CALL] = slow
        if self.stall_queries < STALL_QUERIES_PER_TICK:
            self.stall_queries += 1
            # the rows of intervals that began in the step were written after the last look before it
            floor = next((top for ts, top in reversed(self.offcpu_tops) if ts < start - 5 * NS), 0)
            for _, reason, runq, blocked, _ in self.monitor.execute(
                    _OFFCPU.format(threads=thread_id, during="AND ts >= ? AND ts < ?"),
                    (floor, 1 << 62, self.session_id, start, end)):
                for kind, ns in ((LOST_KINDS[("cpu_wait", None)], runq),
                                 (LOST_KINDS.get(("blocked", reason), ""), blocked)):
                    if kind and ns:
                        lost[kind] = lost.get(kind, 0) + ns
        return max(lost, key=lambda k: lost[k]) if lost else "unexplained"

    def _in_flight(self, now: int) -> None:
        for r in self.ranks.values():
            r.in_flight_s = 0.0
        if self.in_flight is None:
            return
        for call in self.in_flight():
            pid, ts = call.pid, call.ts
            rank = self.by_pid.get(pid)
            if rank is None:  # a rank with no step nor collective returned yet (a hang in its first call)
                row = self.monitor.execute("SELECT id FROM process WHERE pid = ? AND session_id = ? "
                                           "ORDER BY id DESC LIMIT 1", (pid, self.session_id)).fetchone()
                rank = self._rank(row[0]) if row else None
            if rank is not None and ts:
                rank.in_flight_s = max(rank.in_flight_s, (now - ts) / NS)

    # -- the metrics ------------------------------------------------------------------------------
    def metrics(self) -> list[Metric]:
        hist = Metric("workload_step_seconds", "histogram",
                      "step times of each rank's threads that mark steps (recorder.step), seconds")
        steps = Metric("workload_steps_total", "counter", "steps ended (recorder.step marks), per rank")
        stalled = Metric("workload_stalled_steps_total", "counter",
                         "steps the report's stall rule finds stalled against the steps before, per rank")
        wait = Metric("workload_collective_wait_seconds_total", "counter",
                      "seconds the rank waited inside NCCL collectives (the call and the stream synchronisation "
                      "after it), by communicator (its hash, equal on every rank) and operation: the rank that "
                      "waits least while its peers wait is the late one")
        count = Metric("workload_collectives_total", "counter", "NCCL collectives returned, by communicator and op")
        oldest = Metric("workload_collective_in_flight_oldest_seconds", "gauge",
                        "age of the rank's oldest NCCL call in flight now (0: none): a hang grows it")
        lost = Metric("workload_lost_seconds_total", "counter",
                      "seconds the rank's step and NCCL threads lost, by cause kind (store/analysis/kinds): "
                      "waiting for a CPU (cpu_contention), blocked on I/O (blocked_io), on a futex (gil_wait), "
                      "in reclaim (memory_reclaim), dirty throttling, inside collectives (nccl_wait), in CUDA "
                      "calls past their family's baseline (slow_cuda_call)")
        inferred = Metric("workload_steps_inferred", "gauge",
                          "1 where the rank marks no steps and its steps are inferred from the period of its "
                          "synchronising calls (their numbers are the report's: explain --window at the time), "
                          "0 where it marks them (recorder.step)")
        last_step = Metric("workload_last_stall_step", "gauge", "the step number of the rank's last stalled step")
        last_info = Metric("workload_last_stall_info", "gauge",
                           "the cause kind that lost the rank's last stalled step the most time (value 1)")
        last_when = Metric("workload_last_stall_timestamp_seconds", "gauge",
                           "when the rank's last stalled step ended (Unix time)")
        for r in self.ranks.values():
            labels = r.labels
            cumulative = 0
            for bound, n in zip(STEP_BUCKETS, r.buckets, strict=True):
                cumulative += n
                hist.add_sample("_bucket", cumulative, le=f"{bound:g}", **labels)
            hist.add_sample("_bucket", r.steps, le="+Inf", **labels)
            hist.add_sample("_sum", round(r.step_sum, 6), **labels)
            hist.add_sample("_count", r.steps, **labels)
            steps.add(r.steps, **labels)
            stalled.add(r.stalled, **labels)
            for (comm, op), seconds in sorted(r.wait.items()):
                wait.add(round(seconds, 6), comm=comm, op=op, **labels)
                count.add(r.collectives[(comm, op)], comm=comm, op=op, **labels)
            oldest.add(round(r.in_flight_s, 3), **labels)
            for kind, seconds in sorted(r.lost.items()):
                lost.add(round(seconds, 6), cause_kind=kind, **labels)
            if r.steps:
                inferred.add(int(r.inferred), **labels)
            if r.last_stall:
                step, kind, unix = r.last_stall
                if step is not None:
                    last_step.add(step, **labels)
                last_info.add(1, cause_kind=kind, **labels)
                last_when.add(round(unix, 3), **labels)
        folded = Metric("workload_series_folded_total", "counter",
                        f"processes of ranks past {MAX_RANKS} (what='rank') and collectives of (communicator, op) "
                        f"pairs past {MAX_COLLECTIVES} a rank (what='collective'), counted into series 'other'")
        for what, n in sorted(self.folded.items()):
            folded.add(n, what=what)
        return [hist, steps, stalled, inferred, wait, count, oldest, lost, last_step, last_info, last_when, folded,
                Metric("workload_watch_cpu_seconds_total", "counter",
                       "CPU time the recorder spent computing these workload metrics").add(round(self.cost_s, 4))]
