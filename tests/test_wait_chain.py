"""The wait-chain views on a recording written row by row (no BPF needed): wait_hop picks the waker's
wait that overlapped the wait most, wait_chain follows the hops to wait_chain_rule.max_depth, a sleep
is never followed, causal_link has a 'woken_after' row per hop, and store.analysis.waits.chain() (what a
report uses) gives the view's rows. tests/test_waits_bpf.py makes the same chains on real BPF."""

from __future__ import annotations

from pathlib import Path

from conftest import q

from recorder.demo import MS, T0, Synth
from store.analysis import waits
from store.db import open_store


def _session(db: Path) -> dict[str, int]:
    """main (pid 100) reads a pipe 500 ms, woken by feeder (tid 201 of pid 200), itself woken from a
    futex by worker (pid 200), which read a disk; main later sleeps, 'woken' by worker's timer tick."""
    ids: dict[str, int] = {}
    with open_store(db, create=True) as store:
        s = Synth(store, "wait-chain")
        a, b = s.process(100, "train", "python train.py"), s.process(200, "loader", "python train.py")
        main, feeder, worker = s.thread(a, 100, "train"), s.thread(b, 201, "feeder"), s.thread(b, 200, "loader")
        kworker = s.thread(None, 9, "kworker/0:1", traced=0)
        t = T0 + 1000 * MS
        s.offcpu(worker, t - 50 * MS, 520 * MS, 2, "read", wakeup_ts=t + 460 * MS, waker=kworker,
                 stack=[("/job/loader.py", "load", 80, 88)])
        s.offcpu(worker, t - 200 * MS, 2 * MS, 1, "futex", wakeup_ts=t - 199 * MS, waker=main)  # short, earlier
        s.offcpu(feeder, t - 100 * MS, 580 * MS, 1, "futex", wakeup_ts=t + 470 * MS, waker=worker)
        s.offcpu(feeder, t + 10 * MS, 1 * MS, 1, "futex", wakeup_ts=t + 10 * MS + 100, waker=worker)  # overlap < 1 ms
        s.offcpu(main, t, 500 * MS, 1, "read", wakeup_ts=t + 490 * MS, waker=feeder,
                 stack=[("/job/train.py", "step", 30, 40)])
        s.offcpu(main, t + 600 * MS, 300 * MS, 1, None, wakeup_ts=t + 900 * MS, waker=worker)
        s.rows["offcpu_interval"][-1]["syscall"] = 230  # clock_nanosleep
        s.add("block_request", ts=t - 40 * MS, dur=490 * MS, thread_id=worker, submitter_kind="target_deferred",
              dev_major=7, dev_minor=0, sector=8, size_bytes=1 << 20, op="read", rwbs="R", sync=1, metadata=0,
              fua=0, readahead=0, preflush=0, bio_queue_ts=t + 400 * MS, issue_ts=t + 400 * MS,
              complete_ts=t + 450 * MS, queued_dur=440 * MS, device_dur=50 * MS, error=0, requeues=0, merges=0,
              device="loop0")
        s.finish(t + 2000 * MS)
        ids.update(main=main, feeder=feeder, worker=worker)
        for name, thread in (("root", main), ("hop1", feeder), ("hop2", worker)):
            ids[name] = store.one("SELECT id FROM offcpu_interval WHERE thread_id = ? ORDER BY dur DESC LIMIT 1",
                                  (thread,))["id"]
        ids["sleep"] = store.one("SELECT id FROM offcpu_interval WHERE thread_id = ? AND syscall = 230",
                                 (main,))["id"]
    return ids


def test_the_chain_follows_the_longest_overlapping_waits_to_the_disk(tmp_path: Path) -> None:
    db = tmp_path / "w.db"
    ids = _session(db)
    rows = q(db, "SELECT depth, offcpu_id, woke_offcpu_id, tid, pid, reason, device, queued_dur, python"
                 " FROM wait_chain WHERE root_offcpu_id = ? ORDER BY depth", (ids["root"],))
    assert [r[:5] for r in rows] == [(0, ids["root"], None, 100, 100), (1, ids["hop1"], ids["root"], 201, 200),
                                     (2, ids["hop2"], ids["hop1"], 200, 200)]
    assert rows[2][5:] == ("io", "loop0", 440 * MS, "load() at loader.py:88"), rows[2]
    assert rows[0][8] == "step() at train.py:40"
    with open_store(db, readonly=True) as store:
        hops = waits.chain(store, ids["root"])
        assert [(h["depth"], h["offcpu_id"], h["woke_offcpu_id"]) for h in hops] == [r[:3] for r in rows]
        summary = waits.chain_summary(hops, 500 * MS)
    assert summary.startswith("loader (pid 200) blocked on I/O on loop0 (read queued 440 ms in blk-throttle"), summary
    assert "in load() at loader.py:88" in summary and "via the read() in step() at train.py:40" in summary
    links = q(db, "SELECT from_id, to_id FROM causal_link WHERE relation = 'woken_after' ORDER BY from_id")
    assert (ids["root"], ids["hop1"]) in links and (ids["hop1"], ids["hop2"]) in links


def test_a_sleep_is_not_followed_and_the_depth_is_a_rule(tmp_path: Path) -> None:
    db = tmp_path / "w.db"
    ids = _session(db)
    # the sleep's "waker" was only the task its timer interrupted
    assert q(db, "SELECT count(*) FROM wait_chain WHERE root_offcpu_id = ?", (ids["sleep"],)) == [(0,)]
    with open_store(db, readonly=True) as store:
        assert waits.chain(store, ids["sleep"]) == []
    with open_store(db) as store:
        store.conn.execute("UPDATE wait_chain_rule SET max_depth = 1")
        store.conn.commit()
        assert [h["depth"] for h in waits.chain(store, ids["root"])] == [0, 1]
    assert q(db, "SELECT max(depth) FROM wait_chain WHERE root_offcpu_id = ?", (ids["root"],)) == [(1,)]
