"""Surrogate keys for processes and threads, read from /proc when first seen.

A thread row is (session, tid, first seen); when a thread exits its key is retired, so a reused tid
gets a new row and two threads are never merged. Ids are allocated here and rows are queued on the
writer, so resolving a new thread costs no database round trip.
"""

from __future__ import annotations

from recorder.core.job import JOB_COLUMNS, JobIdentity, read_job_identity
from store.db import Store, Writer
from store.text import printable

PROCESS_COLUMNS = ("id", "session_id", "pid", "start_ticks", "parent_pid", "name", "cmdline", "first_ts",
                   *JOB_COLUMNS)
CMDLINE_MAX = 1024  # bytes of a command line kept
NAME_MAX = 64  # characters of a thread or process name kept (the kernel's comm is 16 bytes)
THREAD_COLUMNS = ("id", "session_id", "tid", "process_id", "name", "first_ts", "traced")
THREAD_NAME_COLUMNS = ("session_id", "thread_id", "ts", "name")


def task_name(name: str | bytes) -> str:
    """A comm as the kernel gives it (NUL-padded bytes) or as text, made printable: a task names
    itself, and a newline or an escape sequence in its name must not reach a report as such."""
    if isinstance(name, bytes):
        name = name.split(b"\0", 1)[0].decode("utf-8", "replace")
    return printable(name, NAME_MAX)


def read_proc_stat(pid: int) -> tuple[str, int, int] | None:
    """(comm, ppid, starttime ticks) of a task, or None if it is gone (or its stat unreadable)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read(4096)
        close = data.rfind(b")")
        comm = task_name(data[data.find(b"(") + 1 : close])
        fields = data[close + 2 :].split()
        return comm, int(fields[1]), int(fields[19])
    except (OSError, ValueError, IndexError):
        return None


def read_cmdline(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            raw = f.read(CMDLINE_MAX)  # capped: a command line can carry a whole environment as arguments
    except OSError:
        return None
    text = printable(raw.rstrip(b"\0").replace(b"\0", b" ").decode("utf-8", "replace"))
    return text or None


def read_tgid(tid: int) -> int | None:
    try:
        with open(f"/proc/{tid}/status", "rb") as f:
            for line in f.read(8192).splitlines():
                if line.startswith(b"Tgid:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def safe_job_identity(pid: int) -> JobIdentity:
    """read_job_identity(), and whatever it could not read said in environ_status instead of
    ending the recorder: it reads files another user's process controls."""
    try:
        return read_job_identity(pid)
    except Exception as e:  # noqa: BLE001 - one process's identity never ends the recording
        return JobIdentity(printable(f"unreadable: {type(e).__name__}: {e}", 200))


DEPARTED_NS = 2_000_000_000  # an exited thread's identity still answers for events this long after
DEPARTED_MAX = 4096  # exited threads remembered before the old ones are dropped


class Identity:
    def __init__(self, store: Store, writer: Writer, session_id: int) -> None:
        self.session_id = session_id
        self.writer = writer
        writer.table("process", PROCESS_COLUMNS)
        writer.table("thread", THREAD_COLUMNS)
        writer.table("thread_name", THREAD_NAME_COLUMNS)
        self._next_process = (store.row("SELECT max(id) AS m FROM process")["m"] or 0) + 1
        self._next_thread = (store.row("SELECT max(id) AS m FROM thread")["m"] or 0) + 1
        self.processes: dict[int, int] = {}  # pid -> process.id
        self.threads: dict[int, int] = {}  # tid -> thread.id, threads of the targets
        self.others: dict[int, int] = {}  # tid -> thread.id, tasks seen as preemptors or wakers
        self.exited: list[tuple] = []  # (change, id, ts[, name]) to apply after a flush
        # tid -> (thread.id, exit ts) of threads that exited: rows read after the exit (their records
        # came through another ring, or name the thread as a waker, or as what ran while it finished
        # exiting) still find it. A tid used again is a new thread: a fork says so at once, and
        # without one, an event more than DEPARTED_NS after the exit.
        self.departed: dict[int, tuple[int, int]] = {}

    def process(self, pid: int, ts: int) -> int:
        pid_id = self.processes.get(pid)
        if pid_id is not None:
            return pid_id
        pid_id = self._next_process
        self._next_process += 1
        stat = read_proc_stat(pid)
        comm, ppid, start = stat if stat else (None, None, None)
        # the job identity once per process image: a fork inherits its parent's environment, an exec
        # gets a new row (process_exec) and so is read again
        self.writer.add(
            "process", (pid_id, self.session_id, pid, start, ppid, comm, read_cmdline(pid), ts,
                        *safe_job_identity(pid).row())
        )
        self.processes[pid] = pid_id
        return pid_id

    def thread(self, tid: int, pid: int | None, name: str | bytes | None, ts: int,
               traced: bool = True) -> int:
        """The thread row for tid, creating it (and its process) when first seen."""
        tid_id = self.threads.get(tid)
        if tid_id is not None:
            return tid_id
        gone = self.departed.get(tid)
        if gone is not None and ts <= gone[1] + DEPARTED_NS:
            return gone[0]
        tid_id = self.others.get(tid)
        if tid_id is not None:
            if not traced:
                return tid_id
            # first seen as another thread's preemptor or waker, now as a target's own thread
            del self.others[tid]
            self.threads[tid] = tid_id
            self.exited.append(("traced", tid_id, 0))
            return tid_id
        if pid is None:
            pid = read_tgid(tid)
        process_id = self.process(pid, ts) if pid else None
        name = task_name(name) if name else None
        if not name:
            stat = read_proc_stat(tid)
            name = stat[0] if stat else None
        tid_id = self._next_thread
        self._next_thread += 1
        self.writer.add(
            "thread", (tid_id, self.session_id, tid, process_id, name, ts, 1 if traced else 0)
        )
        (self.threads if traced else self.others)[tid] = tid_id
        return tid_id

    def thread_forked(self, tid: int, pid: int, ts: int, parent_comm: bytes | None = None) -> int:
        """A new thread (fork or clone): a new identity, whatever thread had its tid before. Named by
        its comm when /proc still has it, else by its parent's (what it started with: a thread
        that never set a name of its own, and exited before it was read, keeps it)."""
        self.departed.pop(tid, None)
        stat = read_proc_stat(tid)
        return self.thread(tid, pid, stat[0] if stat else parent_comm, ts)

    def thread_exited(self, tid: int, pid: int, ts: int) -> None:
        tid_id = self.threads.pop(tid, None) or self.others.pop(tid, None)
        if tid_id is not None:
            self.exited.append(("thread", tid_id, ts))
            if len(self.departed) >= DEPARTED_MAX:
                self.departed = {t: v for t, v in self.departed.items() if v[1] + DEPARTED_NS >= ts}
            self.departed[tid] = (tid_id, ts)
        if tid == pid:
            pid_id = self.processes.pop(pid, None)
            if pid_id is not None:
                self.exited.append(("process", pid_id, ts))

    def thread_renamed(self, tid: int, pid: int, name: bytes, ts: int) -> None:
        """A thread took a new name: kept with its time in thread_name, and thread.name (and, for a
        process's main thread, process.name) become it."""
        tid_id = self.threads.get(tid) or self.others.get(tid)
        if tid_id is None:  # not seen yet: it is named by its comm when it is
            return
        text = task_name(name)
        self.writer.add("thread_name", (self.session_id, tid_id, ts, text))
        self.exited.append(("rename", tid_id, ts, text))
        if tid == pid and pid in self.processes:
            self.exited.append(("rename-process", self.processes[pid], ts, text))

    def process_exec(self, pid: int, ts: int) -> None:
        """After exec the process has a new name and command line: start a new process row."""
        old = self.processes.pop(pid, None)
        if old is not None:
            self.exited.append(("process-exec", old, ts))
        self.threads.pop(pid, None)
        self.process(pid, ts)

    def flush_exits(self) -> None:
        """Queue the updates for exits, execs and promotions on the writer, after its rows."""
        conn = self.writer
        for table, row_id, ts, *name in self.exited:
            if table == "rename":
                conn.execute("UPDATE thread SET name = ? WHERE id = ?", (name[0], row_id))
            elif table == "rename-process":
                conn.execute("UPDATE process SET name = ? WHERE id = ?", (name[0], row_id))
            elif table == "traced":
                conn.execute("UPDATE thread SET traced = 1 WHERE id = ?", (row_id,))
            elif table == "process-exec":
                conn.execute("UPDATE process SET exit_ts = ? WHERE id = ?", (ts, row_id))
            else:
                conn.execute(f"UPDATE {table} SET exit_ts = ? WHERE id = ?", (ts, row_id))
        self.exited.clear()
