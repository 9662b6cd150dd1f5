"""The flight recorder's store side on real SQLite files: the window kept (rows written before the
cutoff deleted in bounded batches, identities kept, the file's size flat), and incident recordings
cut out of a recording (`recorder dump`) that `recorder explain` reads like any other."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import q, run_recorder

from recorder.demo import write_scenario
from recorder.flight import vacuum_statements
from store.db import Writer, WriterLimits, open_store
from store.flight import Retention, SizeBound, event_tables, save_window

S = 1_000_000_000
OFFCPU = ("session_id", "ts", "dur", "thread_id", "cpu", "state", "cgroup_id")


def _recording(path: Path) -> tuple:
    store = open_store(path, create=True)
    sid = store.db["session"].insert({
        "started_ts": 0, "wall_offset_ns": 0, "status": "recording", "recorder_pid": 1, "hostname": "h",
        "kernel_release": "k", "boot_id": "b", "cpu_count": 1, "target": "t", "command": "c",
        "tool_version": "0"}).last_pk
    store.conn.execute("INSERT INTO thread (id, session_id, tid, name, first_ts) VALUES (1, ?, 100, 'w', 0)", (sid,))
    store.conn.execute("INSERT INTO capability (session_id, layer, probe, status, ts) "
                       "VALUES (?, 'sched', 'sched:sched_switch', 'attached', 0)", (sid,))
    store.conn.commit()
    writer = Writer(store)
    writer.table("offcpu_interval", OFFCPU)
    writer.table("loss", ("session_id", "ts", "probe", "dropped"))
    retention = Retention(event_tables(store.conn))
    for sql in retention.setup:
        writer.execute(sql)
    writer.flush()
    return store, writer, retention, sid


def _second(writer: Writer, retention: Retention, sid: int, t: int, keep: int, per_second: int = 2000) -> None:
    """One recorded second: rows of events that ended by t, then the tick's statements."""
    base = (t - 1) * S
    writer.extend("offcpu_interval", [(sid, base + i * (S // per_second), 1000, 1, 0, 1, 7)
                                      for i in range(per_second)])
    writer.add("loss", (sid, base, "sched", 1))
    for sql, params, _ in retention.statements(t * S, t * S - keep):
        writer.execute(sql, params)
    writer.flush()


def test_a_new_recording_can_give_pages_back(tmp_path):
    open_store(tmp_path / "n.db", create=True).close()
    assert q(tmp_path / "n.db", "PRAGMA auto_vacuum") == [(2,)]  # INCREMENTAL, set before any table


def test_rows_written_before_the_window_go_and_identities_stay(tmp_path):
    store, writer, retention, sid = _recording(tmp_path / "w.db")
    keep = 10 * S
    for t in range(1, 41):
        _second(writer, retention, sid, t, keep)
    lo, hi, n = store.conn.execute("SELECT min(ts), max(ts), count(*) FROM offcpu_interval").fetchone()
    assert hi == 39 * S + (S - S // 2000)
    # what was written by t=30 s (every event over by then) is gone, what came after is all there
    assert 29 * S <= lo <= 30 * S, lo / S
    assert n == 2000 * round((hi - lo) / S), n
    assert store.conn.execute("SELECT min(ts) FROM loss").fetchone()[0] >= 29 * S
    assert store.conn.execute("SELECT count(*) FROM thread").fetchone()[0] == 1
    assert store.conn.execute("SELECT count(*) FROM capability").fetchone()[0] == 1
    store.close()


def test_an_earlier_session_in_the_file_is_never_deleted(tmp_path):
    store, writer, retention, sid = _recording(tmp_path / "two.db")
    for t in range(1, 6):  # an earlier recording, not a flight one
        writer.extend("offcpu_interval", [(sid, (t - 1) * S + i, 1000, 1, 0, 1, 7) for i in range(100)])
    writer.flush()
    floors = {t: store.conn.execute(f"SELECT coalesce(max(id), 0) FROM {t}").fetchone()[0] for t in retention.tables}
    later = store.db["session"].insert({**store.one("SELECT * FROM session WHERE id = ?", (sid,)), "id": None}).last_pk
    retention = Retention(retention.tables, floors=floors)
    for t in range(100, 140):
        _second(writer, retention, later, t, keep=10 * S)
    assert store.conn.execute("SELECT count(*) FROM offcpu_interval WHERE session_id = ?", (sid,)).fetchone() == (500,)
    assert store.conn.execute("SELECT min(ts) FROM offcpu_interval WHERE session_id = ?", (later,)).fetchone()[0] \
        >= 128 * S
    store.close()


def test_free_pages_are_given_back_through_the_writer(tmp_path):
    path = tmp_path / "v.db"
    store, writer, retention, sid = _recording(path)
    for t in range(1, 21):
        _second(writer, retention, sid, t, keep=100 * S, per_second=5000)
    for sql, params, _ in retention.statements(21 * S, 21 * S):  # all 100,000 rows in one tick
        writer.execute(sql, params)
    writer.flush()
    assert store.conn.execute("SELECT count(*) FROM offcpu_interval").fetchone() == (0,)
    free = store.conn.execute("PRAGMA freelist_count").fetchone()[0]
    assert free > 800
    for sql in vacuum_statements(free):  # as the flight recorder does after a burst
        writer.execute(sql)
    writer.flush()
    assert store.conn.execute("PRAGMA freelist_count").fetchone()[0] == 0
    store.conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    assert path.stat().st_size < free * 4096 / 2
    store.close()


def test_the_file_stays_flat_once_the_window_is_full(tmp_path):
    path = tmp_path / "flat.db"
    store, writer, retention, sid = _recording(path)
    keep = 10 * S
    sizes = {}
    for t in range(1, 81):
        _second(writer, retention, sid, t, keep, per_second=5000)
        if t % 20 == 0:
            store.conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            sizes[t] = path.stat().st_size
    # the window is full after 10 s; from then on freed pages are reused
    assert sizes[80] <= sizes[20] * 1.1, sizes
    store.close()


def test_max_size_cuts_the_window_to_what_fits_and_lets_it_grow_back():
    keep, cap = 600 * S, 100_000_000
    bound = SizeBound(cap, keep)
    room = bound.room(0)
    assert room == cap - cap // 4  # the log's limit, and as much again for what runs over it
    # 30 s recorded, the pages in use at 95% of the room: the window is cut to what fits, at once
    now = bound.next_keep(keep, 30 * S, int(room * 0.95), 0, S // 10)
    assert now == pytest.approx(30 * S * 0.75 / 0.95, rel=1e-6)
    assert bound.next_keep(now, 30 * S, int(room * 0.7), 0, S // 10) == now  # between 60% and 85%: held
    for _ in range(2000):  # well under: back to --keep, never beyond
        now = bound.next_keep(now, 30 * S, room // 2, 0, S // 10)
    assert now == keep
    assert bound.next_keep(2 * S, 2 * S, cap * 4, 0, S // 10) == S // 2  # never under half a second
    # a second of rows on its way to the database takes room too
    assert bound.next_keep(keep, 30 * S, int(room * 0.8), 0, S // 10, lag_ns=2 * S) == pytest.approx(
        30 * S * 0.75 / 0.8 - 2 * S, rel=1e-6)
    # a log a reader held back beyond that takes its room from the database
    assert bound.room(cap // 3) == cap - cap // 3


def test_the_writer_makes_room_before_a_burst_it_cannot_hold(tmp_path):
    """The backstop of --max-size: whatever the window, the rows a piece brings never take the
    pages in use past the room; the oldest marks' rows go first, then halves of a burst newer
    than every mark; the losses of rows kept stay."""
    path = tmp_path / "burst.db"
    store, writer, retention, sid = _recording(path)
    for t in range(1, 11):  # ten seconds, a mark each, nothing out of the two minutes kept
        _second(writer, retention, sid, t, keep=120 * S, per_second=5000)
    page = store.conn.execute("PRAGMA page_size").fetchone()[0]

    def used() -> int:
        return (store.conn.execute("PRAGMA page_count").fetchone()[0]
                - store.conn.execute("PRAGMA freelist_count").fetchone()[0]) * page

    before = used()
    assert retention.make_room(store.conn, before * 2, 0) is None  # room enough: nothing goes
    room = before // 2
    cut = retention.make_room(store.conn, room, 100 * 160)
    assert cut is not None and used() + 100 * 160 <= room
    lo, hi = store.conn.execute("SELECT min(ts), max(ts) FROM offcpu_interval").fetchone()
    assert cut == lo and 4 * S <= lo <= 8 * S and hi == 10 * S - S // 5000  # the oldest marks went
    assert store.conn.execute("SELECT min(ts) FROM loss").fetchone()[0] >= lo - S
    # a burst newer than every mark: halves of it go, its newest rows stay
    writer.extend("offcpu_interval", [(sid, 11 * S + i, 1000, 1, 0, 1, 7) for i in range(100_000)])
    writer.flush()
    assert retention.make_room(store.conn, room, 0) is not None and used() <= room
    assert store.conn.execute("SELECT max(ts) FROM offcpu_interval").fetchone()[0] == 11 * S + 99_999
    # through a writer made with the backstop, before each piece it inserts
    bounded = Writer(store, limits=WriterLimits(txn_rows=2000, make_room=lambda conn, rows: retention.make_room(
        conn, room, rows * 160)))
    bounded.table("offcpu_interval", OFFCPU)
    bounded.extend("offcpu_interval", [(sid, 12 * S + i, 1000, 1, 0, 1, 7) for i in range(100_000)])
    bounded.flush()
    assert used() <= room
    store.close()


def _largest_log_appended(path: Path, chunk_rows: int | None) -> int:
    """Ten seconds of 10,000 rows kept, then all of them cut in one tick through a writer under a
    1 MB log limit: the largest log a commit of that cut left, before it was checkpointed."""
    store, writer, retention, sid = _recording(path)
    for t in range(1, 11):
        _second(writer, retention, sid, t, keep=100 * S, per_second=10_000)
    writer = Writer(store, limits=WriterLimits(wal_limit=1 << 20))  # the cut, through a writer made with the limit
    if chunk_rows:
        retention.chunk_rows = chunk_rows
    store.conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    sizes = []
    committed = writer._committed

    def seen(rows: int) -> None:
        sizes.append(Path(f"{path}-wal").stat().st_size)
        committed(rows)

    writer._committed = seen  # type: ignore[method-assign]
    for sql, params, until_done in retention.statements(11 * S, 11 * S):
        writer.execute_first(sql, params, until_done=until_done)
    writer.flush()
    assert store.conn.execute("SELECT count(*) FROM offcpu_interval").fetchone() == (0,)
    store.close()
    return max(sizes)


def test_a_cut_is_deleted_in_pieces_the_log_limit_holds(tmp_path):
    """A deletion writes the pages it frees to the write-ahead log (distributions build SQLite with
    secure deletion on; freed leaves are written in any mode): cutting 100,000 rows at once appends
    several megabytes in one commit. Under a size bound the cut goes chunk_rows at a time, each its
    own transaction, and the log is truncated once a commit takes it past its limit: it never holds
    more than the limit and one piece."""
    whole = _largest_log_appended(tmp_path / "whole.db", None)
    pieces = _largest_log_appended(tmp_path / "pieces.db", 2000)
    assert whole > 3 << 20, whole  # what the bound has to hold: one commit of the whole cut
    assert pieces <= (1 << 20) * 5 // 4, (pieces, whole)


@pytest.fixture()
def demo_db(tmp_path) -> Path:
    db = tmp_path / "demo.db"
    write_scenario("nvme-timeout-checkpoint", db)
    return db


def _explain(db: Path) -> dict:
    res = run_recorder("explain", "--db", str(db), "--json", check=True)
    return json.loads(res.stdout)


def test_a_dump_is_a_recording_explain_reads_with_the_same_stall(demo_db, tmp_path):
    whole = _explain(demo_db)
    out = tmp_path / "cut.db"
    res = run_recorder("dump", "--db", str(demo_db), "-o", str(out), "--json", check=True)
    row = json.loads(res.stdout)
    assert row["file"] == str(out) and row["trigger"] == "dump" and row["rows"] > 100
    cut = _explain(out)
    assert cut["session"]["incident"].startswith("saved on request (dump)")
    assert cut["step"]["step"] == whole["step"]["step"]
    assert cut["primary_cause"]["kind"] == whole["primary_cause"]["kind"]
    text = run_recorder("explain", "--db", str(out), check=True).stdout
    assert "Incident: saved on request (dump)" in text
    assert "Incident:" not in run_recorder("explain", "--db", str(demo_db), check=True).stdout
    assert q(out, "SELECT count(*) FROM session") == [(1,)]
    assert q(out, "SELECT status FROM session") == [("complete",)]
    assert not Path(f"{out}-wal").exists() and not Path(f"{out}.partial").exists()


def test_a_dump_of_the_last_seconds_keeps_only_the_rows_in_them(demo_db, tmp_path):
    out = tmp_path / "last.db"
    run_recorder("dump", "--db", str(demo_db), "-o", str(out), "--last", "2s", check=True)
    (start, end), = q(out, "SELECT start_ts, end_ts FROM incident")
    assert end - start == 2 * S
    assert q(out, "SELECT count(*) FROM offcpu_interval WHERE ts > ? OR ts + dur < ?", (end, start)) == [(0,)]
    whole = q(demo_db, "SELECT count(*) FROM offcpu_interval")[0][0]
    kept = q(out, "SELECT count(*) FROM offcpu_interval")[0][0]
    assert 0 < kept < whole
    # every thread and stack the kept rows refer to is there
    assert q(out, "SELECT count(*) FROM offcpu_interval o LEFT JOIN thread t ON t.id = o.thread_id "
                  "WHERE t.id IS NULL") == [(0,)]
    assert q(out, "SELECT count(*) FROM cuda_call c LEFT JOIN python_stack p ON p.id = c.python_stack_id "
                  "WHERE c.python_stack_id IS NOT NULL AND p.id IS NULL") == [(0,)]


def test_a_dump_goes_into_the_incidents_folder_by_default_and_never_overwrites(demo_db, tmp_path):
    res = run_recorder("dump", "--db", str(demo_db), "--json", check=True)
    out = Path(json.loads(res.stdout)["file"])
    assert out.parent == tmp_path / "demo.db.incidents" and out.name.endswith("-dump.db")
    again = run_recorder("dump", "--db", str(demo_db), "-o", str(out))
    assert again.returncode == 2
    assert again.stderr.strip() == f"recorder: {out} exists: pass another -o FILE (a dump never overwrites a recording)"


def test_save_window_of_an_unknown_session_is_refused(demo_db, tmp_path):
    from store.errors import UserError

    with pytest.raises(UserError, match="no session 9"):
        save_window(demo_db, tmp_path / "x.db", 9, 0, 1, trigger="dump", detail="", ts=0)
    assert not (tmp_path / "x.db").exists() and not (tmp_path / "x.db.partial").exists()


@pytest.mark.parametrize(("args", "message"), [
    (("--max-size", "1GB"), "--max-size bounds a flight recording: add --keep DURATION (e.g. --keep 10m)"),
    (("--keep", "5s"), "--keep must be at least 10s: pass e.g. --keep 10m"),
    (("--keep", "60s"), "--keep 60s is shorter than an incident (--before 60s + --after 30s + 5s): keep more or "
                        "save less"),
    (("--keep", "10m", "--max-size", "lots"), "cannot read size 'lots': write e.g. 500MB, 2GB or 1GiB"),
    (("--keep", "10m", "--max-size", "1MB"), "--max-size must be at least 16MB: pass e.g. --max-size 2GB"),
    (("--keep", "10m", "--triggers", "stall,moon"),
     "no trigger moon: choose from stall, hung-call, nvme, io-error, xid, aer, oom"),
    (("--keep", "ten"), "cannot read duration 'ten': write e.g. 30s, 5m, 1h or 500ms"),
    (("--on-incident", "/bin/true"), "--on-incident runs for the incidents of a flight recording: add --keep "
                                     "DURATION (e.g. --keep 10m)"),
    (("--keep", "10m", "--on-incident", "/no/such/pager --now"),
     "--on-incident: /no/such/pager is not an executable file or a command on PATH: pass its full path (add "
     "--on-incident-shell to run a shell command line)"),
    (("--keep", "10m", "--on-incident", "page 'me"),
     "cannot split --on-incident \"page 'me\" (No closing quotation): quote it as a shell would"),
    (("--metrics-file", "/no/such/folder/r.prom"),
     "--metrics-file: folder /no/such/folder does not exist: create it or pass another path"),
])
def test_bad_flight_options_are_one_line_errors(tmp_path, args, message):
    res = run_recorder("record", "--db", str(tmp_path / "f.db"), *args, "--", "true")
    assert res.returncode == 2
    assert res.stderr.strip() == f"recorder: {message}"
    assert not (tmp_path / "f.db").exists()


def test_every_row_written_before_the_cutoff_goes_at_any_rate(tmp_path):
    """120,000 rows a second (more than a row budget of the past took): the window is the window,
    and the losses kept are those of every second a row kept is of."""
    store, writer, retention, sid = _recording(tmp_path / "l.db")
    for t in range(1, 21):
        _second(writer, retention, sid, t, keep=5 * S, per_second=120_000)
    lo, n = store.conn.execute("SELECT min(ts), count(*) FROM offcpu_interval").fetchone()
    assert 14 * S <= lo <= 15 * S, lo / S
    assert n == 120_000 * (20 - lo // S)
    kept = [r[0] for r in store.conn.execute("SELECT ts FROM loss ORDER BY ts")]
    assert kept == [s * S for s in range(lo // S, 20)], (lo / S, [k / S for k in kept])
    store.close()


def test_an_interval_that_began_before_the_window_keeps_the_losses_of_its_time(tmp_path):
    store, writer, retention, sid = _recording(tmp_path / "i.db")
    for t in range(1, 23):
        if t == 16:  # a wait from 5 s to 15 s, written when it ended
            writer.add("offcpu_interval", (sid, 5 * S, 10 * S, 1, 0, 1, 7))
        _second(writer, retention, sid, t, keep=10 * S, per_second=100)
    # the rows written by 11 s are gone, the wait is kept and so is every second's loss it spans
    assert store.conn.execute("SELECT min(ts) FROM offcpu_interval").fetchone()[0] == 5 * S
    assert store.conn.execute("SELECT count(*) FROM offcpu_interval WHERE ts < 10 * ?", (S,)).fetchone()[0] == 1
    kept = [r[0] // S for r in store.conn.execute("SELECT ts FROM loss ORDER BY ts")]
    assert kept == list(range(5, 22)), kept
    for t in range(23, 30):  # once the wait's own second is out of the window, its losses go too
        _second(writer, retention, sid, t, keep=10 * S, per_second=100)
    assert store.conn.execute("SELECT min(ts) FROM loss").fetchone()[0] >= 17 * S
    store.close()


def test_a_dump_takes_the_losses_of_every_second_its_rows_are_of(tmp_path):
    store, writer, retention, sid = _recording(tmp_path / "d.db")
    writer.add("offcpu_interval", (sid, 2 * S, 6 * S, 1, 0, 1, 7))  # 2 s to 8 s
    for t in range(1, 11):
        writer.add("loss", (sid, (t - 1) * S, "sched:offcpu ring buffer", t))
    writer.flush()
    store.close()
    row = save_window(tmp_path / "d.db", tmp_path / "out.db", sid, 5 * S, 9 * S, trigger="dump", detail="",
                      ts=9 * S)
    assert row["rows"] > 0
    assert [r[0] // S for r in q(tmp_path / "out.db", "SELECT ts FROM loss ORDER BY ts")] == list(range(2, 10))


def test_the_stall_trigger_infers_the_steps_of_a_process_that_marks_none(tmp_path, monkeypatch):
    """The live trigger on steps inferred from synchronising calls (recorder/steps_live.py), fed a
    second of rows at a time: the stalled step of a process that marks none is named once, by its
    start and thread, when the next step begins; a steady process and one that marks its steps (its
    marks are watched instead) fire nothing; the pattern is searched a few times, not every second."""
    from recorder import steps_live
    from recorder.steps_live import InferredStepWatch
    from store.db.rules import stall_rule
    from store.units import utc

    store, writer, _, sid = _recording(tmp_path / "inf.db")
    conn = store.conn
    conn.execute("UPDATE session SET wall_offset_ns = ?", (1_700_000_000 * S,))
    conn.executemany("INSERT INTO cuda_api (id, name, family, library, arguments) VALUES (?, ?, ?, 'runtime', '')",
                     [(1, "cudaStreamSynchronize", "cudaStreamSynchronize"), (2, "cudaMalloc", "cudaMalloc")])
    for pid in (10, 20, 30):  # 10 stalls once, 20 is steady, 30 stalls too but marks its steps
        conn.execute("INSERT INTO process (id, session_id, pid, first_ts) VALUES (?, ?, ?, 0)", (pid, sid, pid))
        conn.execute("INSERT INTO thread (id, session_id, tid, process_id, first_ts) VALUES (?, ?, ?, ?, 0)",
                     (pid, sid, pid, pid))
    conn.commit()
    searches = []
    real = steps_live.find_pattern
    monkeypatch.setattr(steps_live, "find_pattern", lambda calls: searches.append(len(calls)) or real(calls))
    watch = InferredStepWatch(conn, sid, stall_rule(store), 1_700_000_000 * S)
    ms = 1_000_000
    clock = {10: 0, 20: 0, 30: 0}
    starts: dict[int, list[int]] = {10: [], 20: [], 30: []}
    fired = []
    for second in range(1, 16):
        rows = []
        for thread in clock:
            while clock[thread] < second * S:
                step = len(starts[thread])
                ts = clock[thread]
                starts[thread].append(ts)
                rows.append((sid, ts, 2 * ms, thread, 2, 0, 7))  # cudaMalloc
                rows.append((sid, ts + 3 * ms, 40 * ms, thread, 1, 0, 7))  # the step's synchronisation
                clock[thread] += (100 + (step * 7) % 5) * ms + (500 * ms if step == 60 and thread != 20 else 0)
        conn.executemany("INSERT INTO cuda_call (session_id, ts, dur, thread_id, api_id, ret, cgroup_id)"
                         " VALUES (?, ?, ?, ?, ?, ?, ?)", sorted(rows, key=lambda r: r[1]))
        conn.commit()
        fired += watch.check(second * S, marked_threads=[30] if second > 2 else [])
    assert len(fired) == 1, fired
    ts, detail = fired[0]
    assert ts == starts[10][61] + 3 * ms  # judged when the next step began
    start = utc(starts[10][60] + 3 * ms + 1_700_000_000 * S)
    assert detail.startswith(f"inferred step at {start} on thread 10 took 60"), detail
    assert "x the median of the 10 steps before (10" in detail and "a stall is 1.5x the rolling median" in detail
    assert detail.endswith("the process marks no steps: one begins at every cudaStreamSynchronize of the thread)")
    assert watch.stepping() == {10, 20}
    assert len(searches) <= 6, searches  # found once per thread, checked again every 30 s at most
