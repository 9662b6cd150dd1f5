"""Waits followed across threads and processes, on real BPF: a queue fed by a worker process whose
read a cgroup throttles, a thread holding the GIL (on every supported CPython), a client waiting for
its peer behind TCP retransmissions (in poll() and in recvfrom()), and the clean runs that must not
produce these causes. The report's words and the rows of wait_chain, offcpu_wait and causal_link are
checked against what each workload says it did."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import RECORDER, ROOT, needs_bpf, q, run_recorder, workload_output
from test_io_bpf import ext4_loop, throttled  # noqa: F401 - fixtures

sys.path.insert(0, str(ROOT / "tests" / "pyframes"))  # not a package
import harness  # noqa: E402

pytestmark = [needs_bpf, pytest.mark.bpf]
WORKLOAD = str(ROOT / "tests" / "workloads" / "waits.py")


def record(db: Path, *cmd: str, python: str = sys.executable, prefix: tuple[str, ...] = ()) -> dict:
    res = subprocess.run([*RECORDER, "record", "--db", str(db), "--", *prefix, python, WORKLOAD, *cmd],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    return workload_output(res.stdout)


def explain_worst(db: Path, first: int, last: int) -> dict:
    """The report of the worst stalled step in [first, last]."""
    stalled = json.loads(run_recorder("steps", "--db", str(db), "--slow", "--json", check=True).stdout)["steps"]
    steps = [s for s in stalled if first <= s["step"] <= last]
    assert steps, stalled
    step = max(steps, key=lambda s: s["dur_ns"])["step"]
    return json.loads(run_recorder("explain", "--db", str(db), "--step", str(step), "--json", check=True).stdout)


def _chain_rows(db: Path, root: int) -> list[tuple]:
    return q(db, "SELECT depth, offcpu_id, tid, pid FROM wait_chain WHERE root_offcpu_id = ? ORDER BY depth", (root,))


def _plain(value):
    """An MCP result with its text values unwrapped (the server marks them as untrusted data)."""
    if isinstance(value, dict):
        return value["untrusted_text"] if set(value) == {"untrusted_text"} else {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def _mcp_explain(db: Path, step: int) -> dict:
    import anyio
    from mcp import Client

    from mcp_server.server import build_server

    async def go() -> dict:
        async with Client(build_server(db)) as client:
            result = await client.call_tool("explain_stall", {"step": step})
            assert not result.is_error, result.content
            return result.structured_content

    return anyio.run(go)


# -- a queue fed by a throttled worker ----------------------------------------------------------------
def _data_file(mnt: Path) -> Path:
    data = mnt / "batches.bin"
    with open(data, "wb") as f:
        f.write(os.urandom(4 << 20))
        os.fsync(f.fileno())
    return data


def test_queue_wait_is_explained_by_the_workers_throttled_read(tmp_path, throttled):  # noqa: F811
    mnt, _majmin, disk, cg = throttled
    data = _data_file(mnt)
    db = tmp_path / "chain.db"
    truth = record(db, "chain", "--file", str(data), "--cgroup-procs", str(cg / "cgroup.procs"))
    report = explain_worst(db, 24, 27)
    cause = report["primary_cause"]
    assert report["stall"] and cause["kind"] == "wait_chain", json.dumps(cause, indent=1)
    hops = cause["chain"]
    # it starts at the main thread's queue read and ends at the worker's throttled read
    assert hops[0]["thread"]["tid"] == truth["tid"] and hops[0]["depth"] == 0
    assert hops[0]["reason"] == "io" and hops[0]["syscall"] == "read", hops[0]
    end = hops[-1]
    assert end["thread"]["pid"] == truth["worker_pid"] and end["thread"]["name"] == "loader-worker", end
    assert end["device"] == disk and end["queued_dur_ns"] > end["device_dur_ns"], end
    assert end["python"].endswith(f"waits.py:{truth['read_line']}"), end
    assert len(hops) >= 2 and all(h["thread"]["tid"] != truth["tid"] for h in hops[1:])
    assert cause["waited_for"] == "loader-worker"
    assert cause["summary"].startswith(f"loader-worker (pid {truth['worker_pid']}) blocked on I/O on {disk}"), \
        cause["summary"]
    assert "blk-throttle" in cause["summary"] and f"waits.py:{truth['read_line']}" in cause["summary"]
    assert cause["python"].endswith(f"waits.py:{truth['read_line']}")
    assert any("blkio.throttle" in a for a in cause["next_actions"]), cause["next_actions"]
    # the view gives the same hops, and causal_link has one 'woken_after' row per hop
    root = hops[0]["offcpu_id"]
    assert _chain_rows(db, root) == [(h["depth"], h["offcpu_id"], h["thread"]["tid"], h["thread"]["pid"])
                                     for h in hops]
    for a, b in zip(hops, hops[1:], strict=False):
        assert q(db, "SELECT count(*) FROM causal_link WHERE from_table = 'offcpu_interval' AND from_id = ?"
                     " AND relation = 'woken_after' AND to_id = ?", (a["offcpu_id"], b["offcpu_id"]))[0][0] == 1
    # the root is the step's own wait (step -> off_cpu -> woken_after ...)
    assert q(db, "SELECT count(*) FROM causal_link WHERE from_table = 'step_mark' AND relation = 'off_cpu'"
                 " AND to_id = ?", (root,))[0][0] == 1
    # MCP's explain_stall, through a real client, gives the same chain
    mcp = _mcp_explain(db, report["step"]["step"])
    assert _plain(mcp["primary_cause"]["kind"]) == "wait_chain" and _plain(mcp["primary_cause"]["chain"]) == hops
    text = run_recorder("explain", "--db", str(db), "--step", str(report["step"]["step"]), check=True).stdout
    assert f"Primary cause: loader-worker (pid {truth['worker_pid']}) blocked on I/O on {disk}" in text, text
    assert "Kernel path: read() -> woken by" in text, text


def test_clean_queue_run_has_no_throttled_chain(tmp_path, throttled):  # noqa: F811
    mnt, _majmin, disk, cg = throttled
    data = _data_file(mnt)
    db = tmp_path / "clean.db"
    record(db, "chain", "--file", str(data), "--cgroup-procs", str(cg / "cgroup.procs"), "--big", "4096")
    # the worker's small reads are never queued long, so no wait ends at one
    assert q(db, "SELECT count(*) FROM wait_chain WHERE device = ? AND queued_dur > 100000000", (disk,))[0][0] == 0
    report = json.loads(run_recorder("explain", "--db", str(db), "--json", check=True).stdout)
    cause = report.get("primary_cause") or {}
    assert not (cause.get("kind") == "wait_chain" and cause["chain"][-1]["device"] == disk
                and cause["chain"][-1]["queued_dur_ns"] > 100e6), cause


# -- the GIL -----------------------------------------------------------------------------------------
def test_gil_wait_names_the_holder_and_its_line(tmp_path):
    db = tmp_path / "gil.db"
    truth = record(db, "gil")
    # the steps while the hog ran (30-39); on a loaded machine a step may be explained by CPU
    # contention from other tasks instead, so most, not all, must be GIL waits
    causes = [json.loads(run_recorder("explain", "--db", str(db), "--step", str(n), "--json", check=True).stdout)
              ["primary_cause"] for n in range(31, 40)]
    gil = [c for c in causes if c and c["kind"] == "gil_wait"]
    assert len(gil) >= 5, [c and c["summary"] for c in causes]
    hog_at = [f"hog() at waits.py:{n}" for n in truth["hog_lines"]]  # the while (where it checks), or its body
    # every GIL-wait step names the hog: through the waits it handed over (it woke them) and through
    # the waits that timed out while it ran (the only other Python thread of the process awake)
    for cause in gil:
        holder = cause["holder"]
        assert holder, cause["summary"]
        assert holder["tid"] == truth["hog_tid"] and holder["name"] == "gil-hog", holder
        assert holder["pid"] == truth["pid"]
        # its line is where it last blocked (it drops the GIL and waits to take it back): a hog that
        # never blocked in the recording has none, and a line is never another's
        assert holder["python"] is None or any(holder["python"].endswith(at) for at in hog_at), holder
        assert cause["gil_waits"] >= 5 and holder["waits"] >= 5, cause
        # the step's waits are ~50 ms behind a loop that never blocks: awake through nearly all of them
        assert holder["held_dur_ns"] >= 0.8 * cause["dur_ns"], cause
        assert cause["summary"].startswith("waiting for the GIL: the thread waited"), cause["summary"]
        assert f"held by gil-hog (tid {truth['hog_tid']})" in cause["summary"]
        assert (holder["python"] or "") in cause["summary"] and "waited; " in cause["summary"], cause["summary"]
        assert any("switch interval" in a for a in cause["next_actions"]), cause["next_actions"]
    # the switch interval ends most waits by its timer, yet they are the hog's too
    assert sum(c["holder"]["timed_out_waits"] for c in gil) >= 3 * len(gil), [c["summary"] for c in gil]
    # per wait, in sqlite3: every timed-out GIL wait of the hog's steps names it, none names another thread
    rows = q(db, "SELECT gil_holder_tid, gil_holder_how, count(*) FROM offcpu_wait w"
                 " JOIN offcpu_interval o ON o.id = w.offcpu_id WHERE w.tid = ? AND w.gil = 1 AND w.ts >= ?"
                 " AND w.ts < ? AND o.waker_context = 'timer' GROUP BY 1, 2",
             (truth["tid"], truth["hog_start"], truth["hog_end"]))
    named = {(tid, how): n for tid, how, n in rows}
    assert all(tid in (truth["hog_tid"], None) for tid, _ in named), rows
    timed_out = sum(named.values())
    assert timed_out >= 20 and named.get((truth["hog_tid"], "awake"), 0) >= 0.9 * timed_out, rows
    # outside the hog's steps no step is a GIL wait
    for n in (10, 20, 45, 55):
        other = json.loads(run_recorder("explain", "--db", str(db), "--step", str(n), "--json",
                                        check=True).stdout)["primary_cause"]
        assert (other or {}).get("kind") != "gil_wait", other
    # the Event wait at the end is a futex wait on a lock, not on the GIL: woken by the setter
    event = q(db, "SELECT gil, blocked_dur, waker_tid FROM offcpu_wait WHERE tid = ? AND reason = 'futex'"
                  " AND ts >= ? AND ts < ? ORDER BY blocked_dur DESC LIMIT 1",
              (truth["tid"], truth["event_wait_start"], truth["event_wait_end"]))
    assert event and event[0][0] == 0 and event[0][1] >= 40_000_000 and event[0][2] != truth["hog_tid"], event


def test_a_thread_awake_without_the_gil_is_never_named_its_holder(tmp_path):
    """A third thread hashes a large buffer with the GIL released: awake beside the hog, it makes a
    timed-out wait ambiguous (two threads awake, one of them without the lock), and such a wait
    names no one. The cruncher may hold the lock between two hashes: named for a timed-out wait
    only when the hog slept through most of it (a thread asleep does not hold the GIL)."""
    db = tmp_path / "gil-crunch.db"
    truth = record(db, "gil", "--cruncher")
    main, hog, crunch = truth["tid"], truth["hog_tid"], truth["cruncher_tid"]
    awake = ("(SELECT s.awake_dur * 2 >= s.wait_dur FROM gil_wait_sibling s JOIN thread t"
             " ON t.id = s.sibling_thread_id WHERE s.offcpu_id = w.offcpu_id AND t.tid = ?)")  # through half of it
    waits = q(db, f"SELECT w.offcpu_id, w.gil_holder_tid, w.gil_holder_how, {awake}, {awake}"
                  " FROM offcpu_wait w JOIN offcpu_interval o ON o.id = w.offcpu_id"
                  " WHERE w.tid = ? AND w.gil = 1 AND o.waker_context IS NOT NULL AND w.ts >= ? AND w.ts < ?",
              (hog, crunch, main, truth["hog_start"], truth["hog_end"]))
    assert len(waits) >= 10, waits  # the main thread's waits the switch interval ended
    both = [w for w in waits if w[3] and w[4]]
    assert both and all(w[1] is None for w in both), both  # ambiguous: no holder named
    for _, holder, how, hog_awake, crunch_awake in waits:
        assert holder in (hog, crunch, None) and how in ("awake", None)
        if holder == crunch:
            assert crunch_awake and not hog_awake
        if holder == hog:
            assert hog_awake and not crunch_awake
    # the hog is still named where it alone was awake
    assert any(w[1] == hog for w in waits) or not any(w[3] and not w[4] for w in waits), waits


def test_clean_run_without_a_gil_holder(tmp_path):
    db = tmp_path / "gil-clean.db"
    truth = record(db, "gil", "--hog-steps", "0")
    # one Python thread through the steps: it never waits for the GIL
    assert q(db, "SELECT count(*) FROM offcpu_wait WHERE tid = ? AND gil = 1 AND ts < ?",
             (truth["tid"], truth["steps_end"]))[0][0] == 0
    report = json.loads(run_recorder("explain", "--db", str(db), "--json", check=True).stdout)
    assert (report.get("primary_cause") or {}).get("kind") != "gil_wait", report.get("primary_cause")


def _interpreter(version: str) -> str:
    return harness.find_cpython(version) or ""


@pytest.mark.parametrize("version", harness.version_params())
def test_gil_waits_are_recognised_on_every_supported_cpython(tmp_path, version):
    """Without markers (the marker extension is built for one interpreter): the rows of offcpu_wait."""
    db = tmp_path / "gil.db"
    truth = record(db, "gil", "--no-markers", "--steps", "40", "--hog-step", "10", "--hog-steps", "20",
                   python=_interpreter(version))
    assert [v.rsplit(".", 1)[0] for (v,) in q(db, "SELECT version FROM python_gil WHERE pid = ?",
                                              (truth["pid"],))] == [version]
    main, hog = truth["tid"], truth["hog_tid"]
    # 200 re-acquisitions behind a pure-Python loop: the waits that timed out (every switch interval)
    # are woken by whatever task the timer found running, the last one of each by the hog dropping it
    waits = q(db, "SELECT count(*), coalesce(sum(blocked_dur), 0), coalesce(sum(gil_holder_tid = ?), 0),"
                  " coalesce(sum(gil_holder_tid != ?), 0), coalesce(sum(gil_holder_how = 'awake'), 0) FROM offcpu_wait"
                  " WHERE tid = ? AND gil = 1 AND ts >= ? AND ts < ?",
              (hog, hog, main, truth["hog_start"], truth["hog_end"]))
    n, dur, by_hog, by_other, timed_out = waits[0]
    # the hog holds the lock through every wait: handed over by it, or timed out while it ran. Never
    # another thread; no holder (NULL) where the recording cannot tell, e.g. a wait during which the
    # hog itself blocked for more than half of it (it waited for the GIL the main thread took briefly)
    assert n >= 20 and dur >= 20_000_000 and by_hog >= 0.75 * n and by_other == 0, waits
    assert timed_out >= 5, waits  # the switch interval's timeouts are named too
    assert q(db, "SELECT count(*) FROM offcpu_wait WHERE tid = ? AND gil = 1 AND ts < ?",
             (main, truth["hog_start"]))[0][0] == 0
    # the holder's line: where it blocked right after it dropped the GIL (the loop's), if it blocked
    lines = q(db, "SELECT s.text, count(*) AS n FROM offcpu_interval o JOIN thread t ON t.id = o.thread_id"
                  " JOIN python_call_site s ON s.stack_id = o.python_stack_id WHERE t.tid = ?"
                  " GROUP BY s.text ORDER BY n DESC LIMIT 1", (hog,))
    assert not lines or any(lines[0][0].endswith(f"hog() at waits.py:{n}") for n in truth["hog_lines"]), lines
    event = q(db, "SELECT gil FROM offcpu_wait WHERE tid = ? AND reason = 'futex' AND ts >= ? AND ts < ?"
                  " ORDER BY blocked_dur DESC LIMIT 1", (main, truth["event_wait_start"], truth["event_wait_end"]))
    assert event == [(0,)], event


# -- TCP retransmissions ------------------------------------------------------------------------------
def _net(db: Path, mode: str) -> dict:
    if not shutil.which("unshare") or not shutil.which("tc"):
        pytest.skip("needs unshare and tc (a network namespace with its own qdisc on lo)")
    return record(db, "net", "--mode", mode, prefix=("unshare", "-n"))


@pytest.mark.parametrize("mode,syscall", [("poll", "poll"), ("recv", "recvfrom")])
def test_retransmits_explain_the_wait_in_poll_and_in_recv(tmp_path, mode, syscall):
    """A socket with a timeout waits in poll(), one without in recvfrom(): both are explained by the
    retransmissions on their own connection (the task running at the retransmit is not the client)."""
    db = tmp_path / f"{mode}.db"
    truth = _net(db, mode)
    report = explain_worst(db, 25, 26)
    cause = report["primary_cause"]
    assert report["stall"] and cause["kind"] == "tcp_retransmit", json.dumps(cause, indent=1)
    peers = {f"127.0.0.1:{truth['server_port']}", f"127.0.0.1:{truth['client'][1]}"}  # the request or the echo
    assert cause["retransmits"] >= 1 and cause["peer"] in peers, cause
    assert cause["summary"].startswith(f"TCP retransmits: {cause['retransmits']} retransmit"), cause["summary"]
    assert f"in {syscall}" in cause["summary"], cause["summary"]
    # the retransmits of the connection (the request, or the echo) belong to its two ends: the client
    # and the server, whatever task was running when they fired
    ends = {truth["client"][1]: truth["pid"], truth["server_port"]: truth["server_pid"]}
    rows = q(db, "SELECT e.sport, e.dport, p.pid, r.pid FROM tcp_retransmit e JOIN process p ON p.id = e.process_id"
                 " JOIN process r ON r.id = e.peer_process_id")
    assert rows and all(ends[sport] == owner and ends[dport] == peer for sport, dport, owner, peer in rows), rows


def test_a_slow_peer_is_not_blamed_on_another_process_retransmits(tmp_path):
    """The client waits for a server that sleeps, while another process's connections retransmit: the
    cause is the server's sleep (through the wait chain), not the retransmits."""
    db = tmp_path / "slow-server.db"
    truth = _net(db, "slow-server")
    report = explain_worst(db, 25, 26)
    cause = report["primary_cause"]
    assert report["stall"] and cause["kind"] == "wait_chain", json.dumps(cause, indent=1)
    end = cause["chain"][-1]
    assert end["thread"]["pid"] == truth["server_pid"] and end["reason"] == "sleep", end
    assert end["python"].endswith(f"waits.py:{truth['server_line']}"), end
    assert end["retransmits"] == 0 and cause["chain"][0]["retransmits"] == 0
    assert cause["summary"].startswith(f"echo-server (pid {truth['server_pid']}) blocked (sleep"), cause["summary"]
    # the other process's retransmits were recorded, and are its own
    noise = q(db, "SELECT count(*), count(DISTINCT e.process_id), min(p.pid) FROM tcp_retransmit e"
                  " LEFT JOIN process p ON p.id = e.process_id")
    assert noise[0][0] >= 1 and noise[0][1] == 1 and noise[0][2] == truth["noise_pid"], noise
