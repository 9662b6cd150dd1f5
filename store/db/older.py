"""Reading a recording made by an earlier version: through a migrated copy, never the file itself.

A reader (explain, steps, report, export, the MCP server, cluster explain) may not write the
recording: it is read-only, another user's, an archived incident. So a recording of an older schema
is copied into a private cache folder (0700, the reader's own), the copy is migrated with the same
store/migrations/*.sql a writer applies, and the copy is read. The file itself is not opened for
writing, and its bytes and times stay as they were.

The copy is kept, named by the file's identity (device, inode), modification time and size and the
schema it was migrated to, so the next read of the same recording opens it at once; a change to the
file, or a newer tool, makes another. Copies of other versions of the same file are removed when a
new one is made, and the folder is kept under its size bound (least recently read first).

The folder: $STALL_RECORDER_CACHE_DIR, else $XDG_CACHE_HOME/stall-recorder, else
~/.cache/stall-recorder; its `upgraded/` holds the copies. When none of them can be made private to
this user, the copy goes to a private temporary folder removed when the reader closes it. The size
bound is $STALL_RECORDER_CACHE_MAX (bytes; 0 keeps no copy after the read), default 8 GiB.

`recorder upgrade --db FILE` migrates the file itself instead, for those who may and want to.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import shutil
import sqlite3
import stat
import tempfile
from pathlib import Path

from store.errors import StoreError

DEFAULT_CACHE_MAX = 8 << 30
FICLONE = 0x40049409  # ioctl: share the file's extents (btrfs, XFS): a copy that costs no data


def cache_root() -> Path:
    """The cache folder this user's readers use (not yet made)."""
    explicit = os.environ.get("STALL_RECORDER_CACHE_DIR")
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg) if xdg and os.path.isabs(xdg) else Path(os.path.expanduser("~")) / ".cache"
    return base / "stall-recorder"


def cache_max() -> int:
    text = os.environ.get("STALL_RECORDER_CACHE_MAX", "")
    return int(text) if text.isdigit() else DEFAULT_CACHE_MAX


def _private_dir(path: Path) -> bool:
    """Make `path` (and its parents) if needed; whether it is a real folder owned by this user that
    no one else may enter (made 0700; an existing one must be so already)."""
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = os.lstat(path)
    except OSError:
        return False
    return (stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid()
            and not st.st_mode & (stat.S_IRWXG | stat.S_IRWXO))


def upgraded_dir() -> Path | None:
    """The private folder the migrated copies live in, or None when it cannot be private."""
    root = cache_root()
    if cache_max() == 0 or not _private_dir(root) or not _private_dir(root / "upgraded"):
        return None
    return root / "upgraded"


def copy_file(src: Path, dst: Path) -> None:
    """Copy `src` to a new file `dst`: shared extents where the file system offers them, else
    an in-kernel copy (shutil.copyfile's sendfile)."""
    with open(src, "rb") as fin, open(dst, "xb") as fout:
        try:
            fcntl.ioctl(fout.fileno(), FICLONE, fin.fileno())
            return
        except OSError as e:
            if e.errno not in (errno.EOPNOTSUPP, errno.EXDEV, errno.EINVAL, errno.ENOTTY, errno.EPERM,
                               errno.EBADF):
                raise
    shutil.copyfile(src, dst)


def _key(st: os.stat_result, version: int) -> str:
    return f"{st.st_dev:x}-{st.st_ino:x}-{st.st_mtime_ns:x}-{st.st_size:x}-v{version}"


def _migrate_copy(copy: Path, source: Path, version: int) -> None:
    """Migrate the copy to this tool's schema, and leave it one quiet file (no log), readable immutably."""
    from store.db import damaged, damaged_message, index_sql, migrate

    conn = sqlite3.connect(copy)
    try:
        conn.execute("PRAGMA foreign_keys = OFF")
        indexed = conn.execute("SELECT 1 FROM sqlite_master WHERE name = 'sqlite_stat1'").fetchone()
        migrate(conn, version, name=source)
        if indexed:
            # a recording indexed at its stop gets the indexes this version builds at a stop, and
            # statistics for those it lacked; the others keep the statistics of its stop (the views'
            # plans are chosen on them: sampled ones for all made explain --step 10x slower)
            had = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'index'")}
            for text in index_sql():
                conn.executescript(text)
            for (name,) in conn.execute("SELECT name FROM sqlite_master WHERE type = 'index'").fetchall():
                if name not in had and not name.startswith("sqlite_autoindex"):
                    conn.execute(f'ANALYZE "{name}"')
            conn.commit()
        conn.execute("PRAGMA journal_mode = DELETE").fetchall()  # folds the log into the file
    except sqlite3.DatabaseError as e:
        if damaged(e):
            raise StoreError(damaged_message(source, e)) from None
        raise StoreError(f"{source} could not be migrated to read it ({e}): pass another --db") from None
    finally:
        conn.close()


def _evict(folder: Path, keep: str, st: os.stat_result) -> None:
    """Remove copies of earlier versions of the same file, then the least recently read copies
    while the folder is over its bound (never the one just made)."""
    same_file = f"{st.st_dev:x}-{st.st_ino:x}-"
    entries = []
    for entry in folder.iterdir():
        if entry.name == keep:
            continue
        if entry.name.startswith(".partial-") or entry.name.startswith(same_file):
            if entry.name.startswith(same_file) or _stale_partial(entry):
                shutil.rmtree(entry, ignore_errors=True)
            continue
        entries.append(entry)
    limit = cache_max()
    sizes = {}
    for entry in [*entries, folder / keep]:
        with contextlib.suppress(OSError):
            sizes[entry] = sum(f.stat().st_size for f in entry.iterdir())
    total = sum(sizes.values())
    for entry in sorted(entries, key=_last_read):
        if total <= limit:
            break
        shutil.rmtree(entry, ignore_errors=True)
        total -= sizes.get(entry, 0)


def _stale_partial(entry: Path) -> bool:
    """A copy being made by a reader that is gone (its pid, in the name, runs no more)."""
    pid = entry.name.rsplit("-", 1)[-1]
    if not pid.isdigit():
        return True
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def _last_read(entry: Path) -> float:
    try:
        return entry.stat().st_mtime
    except OSError:
        return 0.0


def readable_copy(path: Path, version: int, target: int) -> tuple[Path, tempfile.TemporaryDirectory | None]:
    """A copy of the recording at `path` (schema `version`) migrated to schema `target`, and the
    temporary folder to remove when done with it (None when the copy is kept in the cache).
    A cached copy is made once per file version; a recording still being written (a log with
    pages, or a lock held) is copied with its log into a temporary folder each time."""
    from store.db import _has_pending_log, being_written

    try:
        before = os.stat(path)
    except OSError as e:
        raise StoreError(f"cannot read {path} ({e.strerror}): run as a user that can, or pass another --db") from None
    live = being_written(path) or _has_pending_log(path) or os.path.exists(f"{path}-shm")
    folder = None if live else upgraded_dir()
    if folder is not None:
        key = _key(before, target)
        cached = folder / key / path.name
        if cached.is_file():
            with contextlib.suppress(OSError):
                os.utime(folder / key)  # read now: the last to be evicted
            return cached, None
    # a private folder (mkdtemp makes it 0700) in the cache, renamed into place once the copy is whole
    work = tempfile.TemporaryDirectory(prefix=".partial-" if folder else "stall-recorder-",
                                       suffix=f"-{os.getpid()}" if folder else "", dir=folder,
                                       ignore_cleanup_errors=True)
    try:
        copy = Path(work.name) / path.name
        try:
            copy_file(path, copy)
            if live:
                for suffix in ("-wal", "-journal"):
                    if os.path.exists(f"{path}{suffix}"):
                        shutil.copyfile(f"{path}{suffix}", f"{copy}{suffix}")
        except OSError as e:
            raise StoreError(
                f"cannot copy {path} to read it ({e.strerror}): free space in {Path(work.name).parent} or set "
                f"STALL_RECORDER_CACHE_DIR to another folder, or upgrade it in place with "
                f"'recorder upgrade --db {path}'") from None
        _migrate_copy(copy, path, version)
        if folder is None:
            return copy, work
        after = os.stat(path)
        if _key(after, target) != key:  # written to while copied: read this copy once, keep none
            return copy, work
        final = folder / key
        try:
            os.rename(work.name, final)
        except OSError:  # another reader made it first: read theirs
            work.cleanup()
        _evict(folder, key, after)
        return final / path.name, None
    except BaseException:
        work.cleanup()
        raise


def _table_rows(conn: sqlite3.Connection) -> dict[str, int]:
    names = [r[0] for r in conn.execute(
        "SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%'")]
    return {name: conn.execute(f'SELECT count(*) FROM "{name}"').fetchone()[0] for name in names}


def upgrade(path: str | os.PathLike) -> dict:
    """Migrate the recording at `path` to this tool's schema, in place (`recorder upgrade`).

    Refused (StoreError, one line) for a file that is missing, not a recording, newer, damaged,
    not writable by this user, or held by a recorder; the recorder's lock is held meanwhile, so no
    recording starts into it. Each migration is one transaction: a failure leaves the file at the
    last version it reached, every row kept. Returns what was done: file, from and to versions,
    and the row count of each table before, checked against the same tables after."""
    from store.db import (
        APPLICATION_ID,
        SCHEMA_VERSION,
        _check_file,
        _connect_readonly,
        damaged,
        damaged_message,
        lock_holder,
        lock_path,
        open_store,
    )

    path = Path(path)
    _check_file(path)
    if not path.is_file():
        raise StoreError(f"no recording at {path}: pass the file to upgrade with --db")
    holder = lock_holder(path)
    if holder is not None:
        raise StoreError(f"a recorder{'' if holder < 0 else f' (pid {holder})'} is writing {path}: stop it "
                         f"('recorder stop --db {path}') and upgrade then")
    try:
        conn, snapshot = _connect_readonly(path)
        try:
            app_id, version = (conn.execute("PRAGMA application_id").fetchone()[0],
                               conn.execute("PRAGMA user_version").fetchone()[0])
            bad = conn.execute("PRAGMA quick_check").fetchone()[0] if app_id == APPLICATION_ID else "ok"
            before = _table_rows(conn) if app_id == APPLICATION_ID and bad == "ok" else {}
        finally:
            conn.close()
            if snapshot is not None:
                snapshot.cleanup()
    except sqlite3.DatabaseError as e:
        if damaged(e):
            raise StoreError(damaged_message(path, e)) from None
        raise StoreError(f"{path} is not a usable SQLite database ({e}): pass another --db") from None
    if app_id != APPLICATION_ID:
        raise StoreError(f"{path} was not written by stall-recorder: pass a recording made by 'recorder' with --db")
    if bad != "ok":
        raise StoreError(f"{path} is damaged ({bad}), so it is not upgraded: check it with "
                         f"'sqlite3 {path} \"PRAGMA integrity_check\"'; 'sqlite3 {path} .recover' saves the rows "
                         "that are intact")
    if version > SCHEMA_VERSION:
        raise StoreError(f"{path} has schema v{version}, newer than this recorder's v{SCHEMA_VERSION}: "
                         "upgrade stall-recorder to read it")
    result = {"file": str(path), "from_version": version, "to_version": SCHEMA_VERSION, "tables": before}
    if version == SCHEMA_VERSION:
        return result
    if not os.access(path, os.W_OK) or not os.access(path.parent if str(path.parent) else ".", os.W_OK):
        raise StoreError(f"cannot write {path} or its folder: upgrade it as a user who can (read commands "
                         "read it as it is, without an upgrade)")
    lock = lock_path(path)
    made = not lock.exists()
    try:
        f = lock.open("a+")
    except OSError as e:
        raise StoreError(f"cannot create {lock} ({e.strerror}): upgrade as a user who can write its folder") from None
    with f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise StoreError(f"a recorder started writing {path}: stop it ('recorder stop --db {path}') "
                             "and upgrade then") from None
        try:
            with open_store(path) as store:  # a writer's open: migrates, each step in its transaction
                after = _table_rows(store.conn)
                store.conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()
        finally:
            if made:
                lock.unlink(missing_ok=True)
    lost = {name: (n, after.get(name)) for name, n in before.items() if name in after and after[name] < n}
    if lost:  # the migrations only add: a table with fewer rows is a bug to report, said, not hidden
        name, (n, m) = next(iter(lost.items()))
        raise StoreError(f"{path} was upgraded to v{SCHEMA_VERSION} but {name} holds {m} rows, {n} before: "
                         "report this as a bug")
    return result
