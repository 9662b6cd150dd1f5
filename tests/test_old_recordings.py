"""Recordings made by earlier versions of this project (tests/fixtures/old_recordings, one per schema
generation, written by each version's own code) are read by every read command as they are: from a
read-only file in a read-only folder, as root and as another user, and the file is left byte for byte
and time for time as it was. `recorder upgrade` migrates one in place when asked, and only then."""

from __future__ import annotations

import fcntl
import gzip
import hashlib
import json
import os
import re
import shutil
import sqlite3
import subprocess
import sys
import tempfile
from contextlib import redirect_stderr, redirect_stdout
from io import StringIO
from pathlib import Path

import anyio
import pytest
from conftest import ROOT

from recorder.cli import main
from store.db import SCHEMA_VERSION, lock_path, open_store
from store.errors import StoreError

FIXTURES = ROOT / "tests" / "fixtures" / "old_recordings"
VERSIONS = sorted(int(m.group(1)) for p in FIXTURES.glob("v*-cpu-contention.db.gz")
                  if (m := re.match(r"v(\d+)-", p.name)))
RECORDED = sorted(int(m.group(1)) for p in FIXTURES.glob("v*-record.db.gz") if (m := re.match(r"v(\d+)-", p.name)))
STALL_STEP = 80042  # the demo scenario's stall: ffmpeg takes the training thread's CPU at model.py:57


def unpack(version: int, folder: Path, name: str = "cpu-contention") -> Path:
    db = folder / f"v{version}.db"
    with gzip.open(FIXTURES / f"v{version}-{name}.db.gz") as src, db.open("wb") as out:
        shutil.copyfileobj(src, out)
    return db


def fingerprint(path: Path) -> tuple:
    """What must not change: the bytes, the times, and the files beside it."""
    st = path.stat()
    return (hashlib.sha256(path.read_bytes()).hexdigest(), st.st_mtime_ns, st.st_ctime_ns, st.st_size,
            st.st_mode, sorted(p.name for p in path.parent.iterdir()))


def oracle(db: Path) -> dict:
    """What the recording holds, read from the file by SQLite alone (immutable: nothing written)."""
    conn = sqlite3.connect(f"file:{db}?immutable=1", uri=True)
    try:
        return {"version": conn.execute("PRAGMA user_version").fetchone()[0],
                "steps": [r[0] for r in conn.execute("SELECT step FROM step_mark ORDER BY ts")],
                "cuda_calls": conn.execute("SELECT count(*) FROM cuda_call").fetchone()[0]}
    finally:
        conn.close()


@pytest.fixture(scope="module")
def recordings():
    """Every fixture unpacked into a read-only folder as read-only files (0444 in 0555), root's."""
    top = Path(tempfile.mkdtemp(prefix="stall-old-recordings-"))
    top.chmod(0o755)
    folder = top / "recordings"
    folder.mkdir()
    dbs = {v: unpack(v, folder) for v in VERSIONS}
    for db in dbs.values():
        db.chmod(0o444)
    folder.chmod(0o555)
    yield dbs
    folder.chmod(0o755)
    shutil.rmtree(top)


@pytest.fixture(scope="module", autouse=True)
def private_cache(tmp_path_factory):
    """This module's readers keep their migrated copies in a folder of their own."""
    cache = tmp_path_factory.mktemp("old-recordings-cache") / "stall-recorder"
    old = os.environ.get("STALL_RECORDER_CACHE_DIR")
    os.environ["STALL_RECORDER_CACHE_DIR"] = str(cache)
    yield cache
    if old is None:
        os.environ.pop("STALL_RECORDER_CACHE_DIR", None)
    else:
        os.environ["STALL_RECORDER_CACHE_DIR"] = old


def run(*args: str) -> tuple[int, str, str]:
    out, err = StringIO(), StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = main(list(args))
    return code, out.getvalue(), err.getvalue()


def test_fixtures_cover_each_schema_generation():
    assert VERSIONS == RECORDED == [9, 10, 11, 15, 18, 21, 22, 23]
    assert all(v < SCHEMA_VERSION for v in VERSIONS)
    with tempfile.TemporaryDirectory() as folder:
        for v in VERSIONS:
            assert oracle(unpack(v, Path(folder)))["version"] == v


def check_answers(answers: dict, db: Path, expected: dict, full: bool = True) -> None:
    """The read commands' answers against what the file holds (`oracle`), whoever ran them."""
    report = answers["explain"]
    assert report["step"]["step"] == STALL_STEP
    cause = report["primary_cause"]
    assert (cause["kind"], cause["contender_name"], cause["python"]) == (
        "cpu_contention", "ffmpeg", "Block.forward() at model.py:57"), cause
    assert [s["step"] for s in answers["steps"]["steps"]] == expected["steps"]
    assert [s["step"] for s in answers["steps_slow"]["steps"]] == [STALL_STEP]
    assert [(s["step"], s["cause"]) for s in answers["top"]["worst_stalls"]] == [(STALL_STEP, "cpu_contention")]
    assert answers["cluster"]["step"] == STALL_STEP and answers["cluster"]["stall"] is True
    assert answers["verify"] == []  # the scenario hashed no checkpoint file
    if not full:
        return
    assert answers["perfetto"]["slices"] > 0 and answers["parquet"]["rows"]["step_mark"] == len(expected["steps"])
    assert answers["parquet_schema"] == expected["version"]
    assert f"step {STALL_STEP}" in answers["html"] or str(STALL_STEP) in answers["html"]
    assert answers["datasette_tables"] > 50


# Each read command on recordings (DB OUT all|core ...: core leaves out the exports), in one process (a
# Python start per command would cost more than the commands): prints {db: {name: answer}} as JSON.
# Run as root in process, as nobody in a child.
READER = r"""
import json, sys, tempfile, contextlib, io, pathlib
import pyarrow.parquet as pq
from recorder.cli import main
def j(*args):
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = main(list(args))
    assert code == 0, (args, code)
    return json.loads(buf.getvalue())
def read(db, out, full):
    a = {}
    a["explain"] = j("explain", "--db", db, "--step", "80042", "--json")
    a["steps"] = j("steps", "--db", db, "--json")
    a["steps_slow"] = j("steps", "--db", db, "--slow", "--json")
    a["top"] = j("top", "--db", db, "--json")
    a["cluster"] = j("cluster", "explain", db, "--json")
    a["verify"] = j("verify-checkpoints", "--db", db, "--json")
    if not full:
        return a
    html = j("report", "--db", db, "--html", str(out / "r.html"), "--json")
    a["html"] = pathlib.Path(html["file"]).read_text()
    written = j("export", "--db", db, "--perfetto", str(out / "t.pftrace"), "--datasette-metadata",
                str(out / "m.json"), "--json")
    a["perfetto"] = next(w for w in written if w["format"] == "perfetto")
    meta = json.loads((out / "m.json").read_text())
    a["datasette_tables"] = sum(len(d["tables"]) for d in meta["databases"].values())
    a["datasette_file"] = next(w for w in written if w["format"] == "datasette-metadata")["database_file"]
    a["parquet"] = j("export", "--db", db, "--parquet", str(out / "pq"), "--json")[0]
    a["parquet_schema"] = pq.read_table(out / "pq" / "export_meta").column("recording_schema")[0].as_py()
    return a
args = sys.argv[1:]
print(json.dumps({db: read(db, pathlib.Path(out), full == "all")
                  for db, out, full in zip(args[0::3], args[1::3], args[2::3])}))
"""


def read_all(db: Path, out: Path) -> dict:
    buf = StringIO()
    old = sys.argv
    sys.argv = ["reader", str(db), str(out), "all"]
    try:
        with redirect_stdout(buf):
            exec(compile(READER, "reader", "exec"), {"__name__": "reader"})
    finally:
        sys.argv = old
    return json.loads(buf.getvalue().splitlines()[-1])[str(db)]


@pytest.mark.parametrize("version", VERSIONS)
def test_every_read_command_reads_it_as_root(recordings, version, tmp_path, private_cache):
    db = recordings[version]
    before, expected = fingerprint(db), oracle(db)
    answers = read_all(db, tmp_path)
    check_answers(answers, db, expected)
    assert fingerprint(db) == before
    # Datasette is pointed at the migrated copy kept in the private cache
    copy = Path(answers["datasette_file"])
    assert copy.name == db.name and private_cache in copy.parents
    assert oracle(copy)["version"] == SCHEMA_VERSION and oracle(copy)["steps"] == expected["steps"]


AS_NOBODY = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("runuser") is None,
                               reason="needs root to run the readers as another user (runuser -u nobody)")


def as_nobody(work: Path, env: dict, *args: str) -> subprocess.CompletedProcess:
    env = {"PATH": os.environ["PATH"], "PYTHONPATH": str(ROOT), **env}
    return subprocess.run(["runuser", "-u", "nobody", "--", "env", "-i", *(f"{k}={v}" for k, v in env.items()),
                           sys.executable, *args], capture_output=True, text=True, cwd=ROOT, timeout=300)


@pytest.fixture()
def nobody_folder():
    """A folder of nobody's own, for what it writes (the exports, its cache, its temporary files)."""
    work = Path(tempfile.mkdtemp(prefix="stall-old-nobody-"))
    work.chmod(0o755)
    for name in ("tmp", "out", "cache"):
        (work / name).mkdir()
        shutil.chown(work / name, "nobody")
    yield work
    shutil.rmtree(work)


@AS_NOBODY
def test_every_read_command_reads_them_as_another_user(recordings, nobody_folder):
    """nobody reads root's read-only recordings in a read-only folder, with a cache of its own
    (every version in one process: a start per command would cost more than the commands; the
    exports, whose open path is the same as the other commands', on the oldest generation)."""
    work = nobody_folder
    before = {v: fingerprint(db) for v, db in recordings.items()}
    pairs = []
    for v, db in recordings.items():
        (work / "out" / f"v{v}").mkdir()
        shutil.chown(work / "out" / f"v{v}", "nobody")
        pairs += [str(db), str(work / "out" / f"v{v}"), "all" if v == VERSIONS[0] else "core"]
    res = as_nobody(work, {"HOME": "/nonexistent", "TMPDIR": str(work / "tmp"),
                           "STALL_RECORDER_CACHE_DIR": str(work / "cache" / "stall-recorder")}, "-c", READER, *pairs)
    assert res.returncode == 0, res.stderr
    answers = json.loads(res.stdout.splitlines()[-1])
    for v, db in recordings.items():
        full = v == VERSIONS[0]
        check_answers(answers[str(db)], db, oracle(db), full)
        if full:
            copy = Path(answers[str(db)]["datasette_file"])
            assert copy.name == db.name and work / "cache" in copy.parents and copy.stat().st_uid != 0
        assert fingerprint(db) == before[v], v
    assert (work / "cache" / "stall-recorder").stat().st_mode & 0o777 == 0o700
    assert list((work / "tmp").iterdir()) == []


@AS_NOBODY
def test_without_a_cache_the_copy_is_temporary_and_removed(recordings, nobody_folder):
    """nobody's home does not exist: no copy can be kept, each read copies into a private temporary
    folder, removed after; Datasette is told to use an upgraded copy."""
    work = nobody_folder
    db = recordings[18]
    before = fingerprint(db)
    res = as_nobody(work, {"HOME": "/nonexistent", "TMPDIR": str(work / "tmp")}, "-m", "recorder", "steps",
                    "--db", str(db), "--slow", "--json")
    assert res.returncode == 0, res.stderr
    assert [s["step"] for s in json.loads(res.stdout)["steps"]] == [STALL_STEP]
    res = as_nobody(work, {"HOME": "/nonexistent", "TMPDIR": str(work / "tmp")}, "-m", "recorder", "export",
                    "--db", str(db), "--datasette-metadata", str(work / "out" / "m.json"))
    assert res.returncode == 0, res.stderr
    assert "recorder upgrade --db COPY" in res.stdout
    assert list((work / "tmp").iterdir()) == []
    assert fingerprint(db) == before


def test_the_mcp_tools_answer_on_an_earlier_version(recordings):
    from test_mcp_server import call_all

    from mcp_server.server import build_server

    db = recordings[18]
    before = fingerprint(db)
    calls = [("list_steps", {"limit": 100}), ("explain_stall", {}), ("top_stalls", {}),
             ("run_sql", {"sql": "SELECT count(*) AS n FROM cuda_call"}), ("cluster_explain", {"step": STALL_STEP})]
    _, results, schema, _ = call_all(build_server(db), calls)
    for name, r in results.items():
        assert not r.is_error, (name, r.content)
    assert results["explain_stall"].structured_content["primary_cause"]["kind"] == "cpu_contention"
    assert len(results["list_steps"].structured_content["steps"]) == len(oracle(db)["steps"])
    assert results["run_sql"].structured_content["rows"] == [[oracle(db)["cuda_calls"]]]
    assert fingerprint(db) == before


def test_datasette_serves_the_migrated_copy(recordings, tmp_path):
    from datasette.app import Datasette

    db = recordings[21]
    code, out, _ = run("export", "--db", str(db), "--datasette-metadata", str(tmp_path / "m.json"), "--json")
    assert code == 0
    copy = json.loads(out)[0]["database_file"]
    ds = Datasette([copy], metadata=json.loads((tmp_path / "m.json").read_text()), immutables=[])

    async def go():
        r = await ds.client.get(f"/{db.stem}/stall.json?_shape=array")
        return r.status_code, r.json()
    status, rows = anyio.run(go)
    assert status == 200 and [r["step"] for r in rows] == [STALL_STEP]


def test_a_second_read_uses_the_kept_copy_and_a_changed_file_gets_a_new_one(tmp_path, private_cache):
    db = unpack(18, tmp_path)
    with open_store(db, readonly=True) as store:
        first = store.read_path
        assert store.migrated_from == 18 and first != db
    assert (private_cache / "upgraded").stat().st_mode & 0o777 == 0o700
    made = first.stat().st_mtime_ns
    with open_store(db, readonly=True) as store:
        assert store.read_path == first and first.stat().st_mtime_ns == made  # not made again
    os.utime(db, ns=(db.stat().st_atime_ns, db.stat().st_mtime_ns + 10**9))  # the file changed
    with open_store(db, readonly=True) as store:
        assert store.read_path != first
    assert not first.exists()  # the copy of the earlier file is gone
    assert not [p for p in (private_cache / "upgraded").iterdir() if p.name.startswith(".partial-")]


def test_no_copy_is_kept_when_the_cache_is_off(tmp_path, monkeypatch):
    monkeypatch.setenv("STALL_RECORDER_CACHE_MAX", "0")
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    tempfile.tempdir = None  # TMPDIR is read again
    try:
        db = unpack(22, tmp_path)
        with open_store(db, readonly=True) as store:
            folder = store.read_path.parent
            assert folder.parent == tmp_path / "tmp" and folder.stat().st_mode & 0o777 == 0o700
            assert store.one("SELECT count(*) AS n FROM step_mark")["n"] == len(oracle(db)["steps"])
        assert not folder.exists()
    finally:
        tempfile.tempdir = None


def test_a_damaged_or_foreign_file_gets_one_line(tmp_path):
    db = unpack(15, tmp_path)
    data = bytearray(db.read_bytes())
    page = 4096
    for n in range(2, len(data) // page):  # every page but the first: the header still says v15
        data[n * page:n * page + 64] = b"\xee" * 64
    db.write_bytes(bytes(data))
    code, out, err = run("explain", "--db", str(db))
    assert code == 2 and out == "" and err.count("\n") == 1 and "Traceback" not in err
    assert "cannot be read" in err and "integrity_check" in err
    before = fingerprint(db)
    code, _, err = run("upgrade", "--db", str(db))  # refused, and the file left for .recover
    assert code == 2 and err.count("\n") == 1 and "integrity_check" in err and "Traceback" not in err
    assert fingerprint(db) == before
    foreign = tmp_path / "foreign.db"
    sqlite3.connect(foreign).execute("CREATE TABLE t (x)").connection.commit()
    for command in ("steps", "upgrade"):
        code, _, err = run(command, "--db", str(foreign))
        assert code == 2 and err.count("\n") == 1 and "not written by stall-recorder" in err


def test_upgrade_migrates_in_place_and_reads_the_same(recordings, tmp_path):
    db = tmp_path / "v18.db"
    shutil.copyfile(recordings[18], db)
    code, read_before, _ = run("explain", "--db", str(db), "--json")
    assert code == 0
    code, out, err = run("upgrade", "--db", str(db), "--json")
    assert code == 0, err
    result = json.loads(out)
    assert (result["from_version"], result["to_version"]) == (18, SCHEMA_VERSION)
    assert oracle(db)["version"] == SCHEMA_VERSION and oracle(db)["steps"] == oracle(recordings[18])["steps"]
    assert result["tables"]["step_mark"] == len(oracle(db)["steps"])
    with open_store(db, readonly=True) as store:
        assert store.read_path == db and store.migrated_from is None  # read as it is now
    code, read_after, _ = run("explain", "--db", str(db), "--json")
    assert json.loads(read_after) == json.loads(read_before)
    code, out, _ = run("upgrade", "--db", str(db))
    assert code == 0 and "already has schema" in out
    assert not lock_path(db).exists()


def test_upgrade_refuses_while_a_recorder_holds_the_file_and_when_it_cannot_write(recordings, tmp_path):
    db = tmp_path / "v21.db"
    shutil.copyfile(recordings[21], db)
    before = fingerprint(db)
    with lock_path(db).open("a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        lock.write(str(os.getpid()))
        lock.flush()
        code, _, err = run("upgrade", "--db", str(db))
    assert code == 2 and err.count("\n") == 1 and f"(pid {os.getpid()}) is writing" in err and "recorder stop" in err
    lock_path(db).unlink()
    assert fingerprint(db) == before
    with pytest.raises(StoreError, match="no recording at"):
        from store.db.older import upgrade

        upgrade(tmp_path / "missing.db")
    if os.geteuid() == 0 and shutil.which("runuser"):
        res = subprocess.run(["runuser", "-u", "nobody", "--", sys.executable, "-m", "recorder", "upgrade", "--db",
                              str(recordings[21])], capture_output=True, text=True, cwd=ROOT, timeout=60)
        assert res.returncode == 2 and res.stderr.count("\n") == 1 and "cannot write" in res.stderr


def test_a_reader_does_not_migrate_a_dead_recording_of_an_earlier_version(tmp_path):
    """An earlier version's recorder died mid-session (its session still 'recording'): status and
    explain, run by a user who could write the file, read it and leave it as it is."""
    db = unpack(18, tmp_path)
    conn = sqlite3.connect(db)
    conn.execute("UPDATE session SET status = 'recording', stopped_ts = NULL")
    conn.commit()
    conn.execute("PRAGMA journal_mode = DELETE")
    conn.close()
    before = fingerprint(db)
    code, _, err = run("status", "--db", str(db))
    assert code == 2 and "no recorder is running" in err
    code, out, err = run("explain", "--db", str(db), "--step", str(STALL_STEP))
    assert code == 0, err
    assert "Primary cause: CPU contention" in out
    assert fingerprint(db) == before and oracle(db)["version"] == 18


def test_verify_checkpoints_hashes_an_earlier_versions_checkpoints_and_stores_nothing(tmp_path):
    """Its read part: the files hashed when the (v18) recording was made are hashed again and
    compared; the results are not written into a file of an earlier schema."""
    db = unpack(18, tmp_path)
    good, changed = tmp_path / "step100.pt", tmp_path / "step200.pt"
    good.write_bytes(b"weights" * 1000)
    changed.write_bytes(b"other" * 1000)
    conn = sqlite3.connect(db)
    thread = conn.execute("SELECT min(id) FROM thread").fetchone()[0]
    for n, (path, content) in enumerate(((good, b"weights" * 1000), (changed, b"before" * 1000)), 1):
        conn.execute("INSERT INTO checkpoint_file (id, session_id, ts, dur, thread_id, path, opted_by, ino)"
                     " VALUES (?, 1, 1, 1, ?, ?, 'xattr', ?)", (n, thread, str(path), path.stat().st_ino))
        conn.execute("INSERT INTO checkpoint_verify (session_id, file_id, ts, dur, trigger, method, path, state, ino,"
                     " size_bytes, sha256) VALUES (1, ?, 2, 1, 'completed', 'sha256', ?, 'hashed', ?, ?, ?)",
                     (n, str(path), path.stat().st_ino, len(content), hashlib.sha256(content).hexdigest()))
    conn.commit()
    conn.close()
    before = fingerprint(db)
    code, out, err = run("verify-checkpoints", "--db", str(db), "--json")
    assert code == 1  # one file differs
    assert [(r["path"], r["matches"]) for r in json.loads(out)] == [(str(good), True), (str(changed), False)]
    assert "not stored" in err and "recorder upgrade" in err
    assert fingerprint(db) == before


def test_the_cache_is_held_under_its_bound_least_recently_read_first(tmp_path, monkeypatch):
    monkeypatch.setenv("STALL_RECORDER_CACHE_DIR", str(tmp_path / "cache"))
    a, b, c = unpack(18, tmp_path), unpack(21, tmp_path), unpack(22, tmp_path)
    copies = {}
    for db in (a, b):
        with open_store(db, readonly=True) as store:
            copies[db] = store.read_path
    bound = sum(p.stat().st_size for p in copies.values()) + (512 << 10)  # room for two copies, not three
    monkeypatch.setenv("STALL_RECORDER_CACHE_MAX", str(bound))
    os.utime(copies[a].parent, (1, 1))  # a read long ago
    with open_store(c, readonly=True) as store:
        assert store.one("SELECT count(*) AS n FROM step_mark")["n"] == len(oracle(c)["steps"])
        copies[c] = store.read_path
    assert not copies[a].exists() and copies[b].exists() and copies[c].exists()



@pytest.mark.parametrize("version", RECORDED)
def test_a_real_recording_of_each_version_is_explained(version, tmp_path):
    """Recorded with BPF by that version's own `recorder record -- python train.py`: step 30 slept
    300 ms at train.py:12, and every step the file holds is listed."""
    db = unpack(version, tmp_path, "record")
    db.chmod(0o444)
    before, expected = fingerprint(db), oracle(db)
    code, out, err = run("explain", "--db", str(db), "--step", "30", "--json")  # a busy host may add a stall
    assert code == 0, err
    report = json.loads(out)
    cause = report["primary_cause"]
    assert report["step"]["step"] == 30 and cause["kind"] == "blocked", cause
    assert "clock_nanosleep" in cause["summary"] and cause["python"].endswith("train.py:12"), cause
    code, out, err = run("steps", "--db", str(db), "--json")
    assert code == 0, err
    assert [s["step"] for s in json.loads(out)["steps"]] == sorted(set(expected["steps"]))
    assert fingerprint(db) == before


@AS_NOBODY
def test_the_mcp_server_serves_an_earlier_version_to_another_user(recordings, nobody_folder):
    """`recorder mcp` run by nobody over stdio, on root's read-only v15 recording, no cache of its own:
    each call reads a private temporary copy, removed after it."""
    from mcp import Client, StdioServerParameters

    db = recordings[15]
    before = fingerprint(db)
    env = {"PATH": os.environ["PATH"], "PYTHONPATH": str(ROOT), "HOME": "/nonexistent",
           "TMPDIR": str(nobody_folder / "tmp")}
    params = StdioServerParameters(command="runuser", args=["-u", "nobody", "--", "env", "-i",
                                                            *(f"{k}={v}" for k, v in env.items()), sys.executable,
                                                            "-m", "recorder", "mcp", "--db", str(db)], cwd=str(ROOT))

    async def go() -> list:
        async with Client(params) as c:
            return [await c.call_tool(name, args) for name, args in
                    (("explain_stall", {"worst": True}), ("run_sql", {"sql": "SELECT count(*) FROM step_mark"}))]

    explained, counted = anyio.run(go)
    assert not explained.is_error and not counted.is_error, (explained.content, counted.content)
    assert explained.structured_content["primary_cause"]["kind"] == "cpu_contention"
    assert counted.structured_content["rows"] == [[len(oracle(db)["steps"])]]
    assert list((nobody_folder / "tmp").iterdir()) == []
    assert fingerprint(db) == before
