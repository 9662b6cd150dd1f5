"""The cost of reading a large recording made by an earlier version (docs/benchmarks.md).

A recording of schema v18 (tests/fixtures/old_recordings/v18-cpu-contention.db.gz, written by that
version's own code) is grown to about --mb MB with plain SQL at its own schema (its off-CPU intervals,
CUDA calls and block requests copied later in time), made read-only, and then:
  - the first read (`recorder steps`): copy into the private cache, migrate the copy, index it, read;
    the copy, the migration and the indexing also timed alone, in process;
  - the second read (the kept copy), and `recorder explain --step` on it;
  - `recorder upgrade` of a writable copy, for comparison.
The file's page cache is warm (it was just written): a cold read adds the disk's read of the file.

    .venv/bin/python benchmarks/bench_old_recording.py --mb 400
"""

from __future__ import annotations

import argparse
import gzip
import os
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from store.db import SCHEMA_VERSION  # noqa: E402
from store.db.older import _migrate_copy, copy_file  # noqa: E402

FIXTURE = ROOT / "tests" / "fixtures" / "old_recordings" / "v18-cpu-contention.db.gz"
GROWN = ("offcpu_interval", "cuda_call", "block_request")


def grow(db: Path, mb: int) -> dict[str, int]:
    conn = sqlite3.connect(db)
    rows = {}
    while db.stat().st_size < mb << 20:
        for table in GROWN:
            cols = [r[1] for r in conn.execute(f"PRAGMA table_info({table})") if r[1] != "id"]
            lo, hi = conn.execute(f"SELECT min(ts), max(ts) FROM {table}").fetchone()
            shift = hi - lo + 1
            listed = ", ".join(cols)
            picked = ", ".join(f"ts + {shift}" if c == "ts" else c for c in cols)
            conn.execute(f"INSERT INTO {table} ({listed}) SELECT {picked} FROM {table}")
            conn.commit()
    for table in GROWN:
        rows[table] = conn.execute(f"SELECT count(*) FROM {table}").fetchone()[0]
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    conn.execute("PRAGMA journal_mode = DELETE")
    conn.close()
    return rows


def timed(*args: str, env: dict) -> float:
    t = time.perf_counter()
    subprocess.run([sys.executable, "-m", "recorder", *args], check=True, stdout=subprocess.DEVNULL, env=env, cwd=ROOT)
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=int, default=400, help="grow the recording to about this size (MB)")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="stall-bench-old-"))
    try:
        db = work / "v18-big.db"
        with gzip.open(FIXTURE) as src, db.open("wb") as out:
            shutil.copyfileobj(src, out)
        rows = grow(db, args.mb)
        db.chmod(0o444)
        size = db.stat().st_size
        print(f"recording: schema v18, {size / 1e6:.0f} MB, rows {rows}")

        t = time.perf_counter()
        copy_file(db, work / "copy.db")
        copied = time.perf_counter() - t
        t = time.perf_counter()
        _migrate_copy(work / "copy.db", db, 18)
        migrated = time.perf_counter() - t
        print(f"in process: copy {copied:.2f} s, migrate v18 -> v{SCHEMA_VERSION} and index {migrated:.2f} s")
        (work / "copy.db").unlink()

        env = {**os.environ, "STALL_RECORDER_CACHE_DIR": str(work / "cache")}
        first = timed("steps", "--db", str(db), "--slow", env=env)
        second = timed("steps", "--db", str(db), "--slow", env=env)
        explain = timed("explain", "--db", str(db), "--step", "80042", env=env)
        writable = work / "upgrade.db"
        shutil.copyfile(db, writable)
        writable.chmod(0o644)
        upgrade = timed("upgrade", "--db", str(writable), env=env)
        current = timed("steps", "--db", str(writable), "--slow", env=env)
        explain_upgraded = timed("explain", "--db", str(writable), "--step", "80042", env=env)
        print(f"recorder steps --slow: first read {first:.2f} s, second {second:.2f} s; explain --step "
              f"{explain:.2f} s (kept copy); recorder upgrade {upgrade:.2f} s, then steps {current:.2f} s, "
              f"explain --step {explain_upgraded:.2f} s")
    finally:
        shutil.rmtree(work)


if __name__ == "__main__":
    main()
