"""Running a session in the background (`recorder start`) or around a command (`recorder record`)."""

from __future__ import annotations

import json
import os
import signal
import socket
import sqlite3
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from recorder.errors import UserError
from recorder.recording_files import already_recording, give_back_reserve, log_path, status_path
from store.db import check_regular, lock_holder, open_store
from store.errors import StoreError

if TYPE_CHECKING:  # the recorder proper is imported where it records: a stop needs none of it
    from recorder.core.loader import TargetSpec
    from recorder.flight import FlightOptions
    from recorder.metrics_http import ListenOptions


def check_db_path(db: Path) -> None:
    """Fail early, before forking, when the database's folder cannot take our files."""
    if db.is_dir():
        raise UserError(f"{db} is a directory: pass a database file path with --db")
    check_regular(db)  # /dev/null, a FIFO: nothing is written beside it
    try:
        with open(log_path(db), "a"):
            pass
    except OSError as e:
        raise UserError(f"cannot write {db} ({e.strerror}): pass a writable --db path") from None


def check_not_recording(db: Path) -> None:
    """Refuse a second recorder on `db`; a session a dead recorder left 'recording' is finalized
    first (as incomplete, with why and when), so the new recorder's lock never makes it read as live."""
    holder = lock_holder(db)
    if holder:
        raise already_recording(db, holder)
    if db.exists():
        try:
            finalize_dead(db)
        except (StoreError, sqlite3.Error):
            pass  # not ours to mark (another user's, a full disk): readers say the same from the row


def start_background(db: Path, target: TargetSpec, cuda_libs: tuple[str, ...], command: str,
                     flight: FlightOptions | None = None, metrics_file: Path | None = None,
                     metrics_listen: ListenOptions | None = None) -> dict:
    """Fork a detached recorder; return its attach summary once the probes are attached."""
    check_db_path(db)
    check_not_recording(db)
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid:
        os.close(write_fd)
        with os.fdopen(read_fd) as r:
            text = r.read()
        os.waitpid(pid, 0)
        if not text:
            raise UserError(f"the recorder exited before attaching: see {log_path(db)}")
        reply = json.loads(text)
        if "error" in reply:
            raise UserError(reply["error"])
        return reply
    # first child: new session, then a grandchild that is the daemon
    os.close(read_fd)
    os.setsid()
    if os.fork():
        os._exit(0)
    log = os.open(log_path(db), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    status = 0
    try:
        from recorder.session import Session, install_stop_signals

        session = Session(db, target, cuda_libs, command, flight=flight, metrics_file=metrics_file,
                          metrics_listen=metrics_listen)
        install_stop_signals(session)
        summary = session.begin()
        os.write(write_fd, json.dumps(summary).encode())
        os.close(write_fd)
        session.run(lambda: False)
        summary = session.finish()
        try:
            print(json.dumps(summary), flush=True)
        except OSError:  # the log's disk is full: the recording says why it stopped
            pass
    except UserError as e:
        _reply_error(write_fd, str(e))
        status = 2
    except BaseException as e:  # the parent must hear of any failure, not hang
        give_back_reserve(db)  # a full disk still takes the traceback
        _reply_error(write_fd, f"recorder failed: {type(e).__name__}: {e} (see {log_path(db)})")
        import traceback

        traceback.print_exc()
        status = 1
    finally:
        sys.stdout.flush()
        os._exit(status)


def run_foreground(db: Path, target: TargetSpec, cuda_libs: tuple[str, ...], command: str,
                   flight: FlightOptions | None = None, metrics_file: Path | None = None,
                   metrics_listen: ListenOptions | None = None,
                   on_started: Callable[[dict], None] | None = None) -> dict:
    """Record in this process until SIGTERM or SIGINT (`recorder stop` sends the first): for a
    service manager that supervises the process itself (systemd, a container). Returns the session
    summary. Under systemd's Type=notify, READY=1 is sent once the probes are attached."""
    check_db_path(db)
    check_not_recording(db)
    from recorder.session import Session, install_stop_signals

    session = Session(db, target, cuda_libs, command, flight=flight, metrics_file=metrics_file,
                      metrics_listen=metrics_listen)
    install_stop_signals(session)
    summary = session.begin()
    if on_started:
        on_started(summary)
    notify_service_manager("READY=1\nSTATUS=recording")
    session.run(lambda: False)
    notify_service_manager("STOPPING=1")
    return session.finish()


def notify_service_manager(state: str) -> None:
    """sd_notify(3) without libsystemd: one datagram to $NOTIFY_SOCKET, when set."""
    path = os.environ.get("NOTIFY_SOCKET")
    if not path:
        return
    if path.startswith("@"):  # an abstract socket
        path = "\0" + path[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
            s.connect(path)
            s.sendall(state.encode())
    except OSError:
        pass  # no service manager listening: nothing to tell


def _reply_error(fd: int, message: str) -> None:
    try:
        os.write(fd, json.dumps({"error": message}).encode())
        os.close(fd)
    except OSError:
        pass


def not_running(db: Path, base: str | None = None) -> UserError:
    """Why no recorder is running on `db`, as an error: one that stopped by itself (a full disk)
    or died (kill -9, a crash; its session is finalized here) is said, with what it left. `base`
    replaces the opening words ('no recorder is running on DB')."""
    from store.report.build import recording_end

    base = base or f"no recorder is running on {db}"
    if not db.exists():
        return UserError(f"{base}: start one with 'recorder start --db {db}'")
    try:
        finalize_dead(db)
    except (StoreError, sqlite3.Error):
        pass  # no room to write it (a full disk): readers say the same from the row as it is
    try:
        with open_store(db, readonly=True) as store:
            row = store.one("SELECT * FROM session ORDER BY id DESC LIMIT 1")
            ended = recording_end(store, row) if row else None
    except (StoreError, sqlite3.Error) as e:
        return UserError(f"{base} ({e})")
    if ended and row:
        return UserError(f"{base}: session {row['id']} {ended}; what it wrote is readable with 'recorder explain "
                         f"--db {db}'; start a new one with 'recorder start --db {db}'")
    return UserError(f"{base}: start one with 'recorder start --db {db}'")


def finalize_dead(db: Path) -> int | None:
    """A session still 'recording' whose recorder holds no lock died without a stop: mark it
    incomplete, ending at the last second it committed. Returns its id, or None (nothing to do,
    or the file is not ours to write: readers then say the same from the row as it is)."""
    if lock_holder(db) or not os.access(db, os.W_OK):
        return None
    give_back_reserve(db)  # the room a dead recorder held
    with open_store(db, readonly=True) as store:  # opening for writing writes (views): only if needed
        # an earlier version's recording is not migrated in place by a reader: 'recorder upgrade' does that
        if store.migrated_from is not None or store.one(
                "SELECT 1 AS x FROM session WHERE status = 'recording'") is None:
            return None
    with open_store(db) as store:
        row = store.one("SELECT id, recorder_pid FROM session WHERE status = 'recording' ORDER BY id DESC LIMIT 1")
        if row is None:
            return None
        from store.report.build import session_end

        end = session_end(store, store.row("SELECT * FROM session WHERE id = ?", (row["id"],)))
        store.conn.execute("UPDATE session SET status = 'incomplete', stopped_ts = ?, stop_reason = ? "
                           "WHERE id = ? AND status = 'recording'",
                           (end, f"the recorder (pid {row['recorder_pid']}) died without a stop", row["id"]))
        store.conn.commit()
        return row["id"]


def stop_background(db: Path, timeout_s: float = 60.0) -> dict:
    """Signal the recorder on `db` to stop and wait until it has released the database."""
    holder = lock_holder(db)
    if not holder:
        raise not_running(db)
    os.kill(holder, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while lock_holder(db):
        if time.monotonic() > deadline:
            raise UserError(f"recorder pid {holder} did not stop within {timeout_s:.0f} s: see {log_path(db)}")
        time.sleep(0.05)
    from recorder.recording_files import session_summary

    with open_store(db, readonly=True) as store:  # what the recorder wrote is only read here
        unfinished = store.one("SELECT 1 AS x FROM session WHERE status = 'recording'") is not None
        if not unfinished:
            return session_summary(store, store.row("SELECT max(id) AS id FROM session")["id"])
    # the lock went with a recorder that never finished its session: one killed (SIGKILL, the OOM
    # killer) holds the lock while the kernel detaches its probes, and the signal met it dying
    raise not_running(db, f"the recorder (pid {holder}) on {db} ended without finishing its session")


def read_status(db: Path) -> dict:
    holder = lock_holder(db)
    if not holder:
        raise not_running(db)
    try:
        status = json.loads(status_path(db).read_text())
    except (OSError, ValueError):
        status = {"recorder_pid": holder, "note": "starting"}
    status["age_s"] = round(time.time() - status.get("updated_unix", time.time()), 1)
    return status


def record_command(db: Path, argv: list[str], cuda_libs: tuple[str, ...], command: str,
                   on_started: Callable[[int], None] | None = None,
                   flight: FlightOptions | None = None, metrics_file: Path | None = None,
                   metrics_listen: ListenOptions | None = None) -> tuple[int, dict]:
    """Run argv under recording (children included); return (its exit status, session summary).

    `on_started(pid)` is called once the probes are attached and the command runs.
    """
    check_db_path(db)
    check_not_recording(db)
    go_r, go_w = os.pipe()
    child = os.fork()
    if child == 0:
        os.close(go_w)
        ok = os.read(go_r, 1)
        if ok != b"1":
            os._exit(127)
        try:
            os.execvp(argv[0], argv)
        except OSError as e:
            print(f"recorder: cannot run {argv[0]}: {e.strerror}", file=sys.stderr)
            os._exit(127)
    os.close(go_r)
    from recorder.core.loader import TargetSpec
    from recorder.session import Session, install_dump_signal

    session = Session(db, TargetSpec(pids=(child,)), cuda_libs, command,
                      described_target="command " + " ".join(argv), flight=flight, metrics_file=metrics_file,
                      metrics_listen=metrics_listen)
    try:
        session.begin()
    except BaseException:
        os.close(go_w)
        os.waitpid(child, 0)
        raise
    # Ctrl-C reaches the command (same process group); the recorder keeps recording until it exits.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda *_: os.kill(child, signal.SIGTERM))
    install_dump_signal(session)
    os.write(go_w, b"1")
    os.close(go_w)
    if on_started:
        on_started(child)
    exit_status: list[int] = []

    def child_done() -> bool:
        if not exit_status:
            pid, st = os.waitpid(child, os.WNOHANG)
            if pid:
                exit_status.append(os.waitstatus_to_exitcode(st))
        return bool(exit_status)

    session.run(child_done)
    summary = session.finish()
    if not exit_status:  # the recording stopped before the command ended: it runs on, unrecorded
        print(f"recorder: {argv[0]} (pid {child}) runs on unrecorded; waiting for it to exit", file=sys.stderr,
              flush=True)
        _, st = os.waitpid(child, 0)
        exit_status.append(os.waitstatus_to_exitcode(st))
    code = exit_status[0]
    return (128 - code if code < 0 else code), summary
