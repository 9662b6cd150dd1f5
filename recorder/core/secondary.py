"""A BPF object of the session compiled after its start, off the start's path: the on-CPU profile's.

BCC compiles a session's C in one go, and the compile is most of a start's time (docs/benchmarks.md,
"Start-up"). Programs that need not run from the first moment of a recording are compiled here
instead, once the session is recording: in a child forked from the recorder, at a lower priority,
while the session goes on. The child inherits the session's BPF object, so its compile finds the
session's maps (bpf/common.h SESSION_TABLE: "extern" in this object's C) and its programs use those
very maps; it loads the programs, wires its program arrays, hands the file descriptors of what the
session needs (programs to attach, its own maps to read) back over a socket, and exits. Nothing is
compiled in the recorder's own process, so a stop that comes first only ends the child: a session
never waits for this compile.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import signal
import socket
import stat
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CFLAGS = ["-Wno-macro-redefined", "-Wno-unused-function", "-g0"]
CHILD_NICE = 10  # the compile yields to the job and to the session's own loop
_MAX_FDS = 64
_MAP_ID = re.compile(r"^map_id:\s*(\d+)", re.M)


@dataclass(frozen=True)
class Wanted:
    """What the child hands back: programs by name (their BCC program type) and maps by name;
    `arrays`: program array -> its programs, slot by slot (wired in the child, loaded as `array_type`)."""

    programs: dict[str, int]
    maps: tuple[str, ...]
    arrays: dict[str, tuple[str, ...]]
    array_type: int
    shared: str = "targets"  # a map of the session's the child checks it refers to


def _close_files(keep: int) -> None:
    """Close the regular files the child inherited (the recording, its log, its lock: a lock held
    through a shared open file stays held while any copy is open, so a recorder killed while this
    child compiles would otherwise leave its lock held until the compile ends). Its BPF maps and
    programs, the channel and stdio stay."""
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd <= 2 or fd == keep:
            continue
        try:
            if stat.S_ISREG(os.fstat(fd).st_mode):
                os.close(fd)
        except OSError:  # the listing's own descriptor, closed since
            continue


def map_id(fd: int) -> int | None:
    try:
        found = _MAP_ID.search(Path(f"/proc/self/fdinfo/{fd}").read_text())
    except OSError:
        return None
    return int(found.group(1)) if found else None


class Secondary:
    """One background compile: `start()`, then `poll()` at the session's pace until it returns the
    file descriptors (name -> fd) or `error` says why not; `cancel()` ends a compile still running.
    The descriptors returned are the caller's to close."""

    def __init__(self, session_bpf: Any, text: str, wanted: Wanted) -> None:
        self.session_bpf = session_bpf
        self.text = text
        self.wanted = wanted
        self.pid: int | None = None
        self.started = 0.0
        self.elapsed: float | None = None  # seconds from start() to the programs' return
        self.error: str | None = None
        self.cpu_s: float | None = None  # the compile's CPU seconds (the child's), once it ended
        self.fds: dict[str, int] | None = None
        self._sock: socket.socket | None = None

    def start(self) -> None:
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.started = time.monotonic()
        pid = os.fork()
        if pid == 0:  # the child: never returns
            parent.close()
            self._child(child)
        child.close()
        parent.setblocking(False)
        self.pid, self._sock = pid, parent

    def _child(self, sock: socket.socket) -> None:
        status = 1
        try:
            _close_files(keep=sock.fileno())
            os.nice(CHILD_NICE)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # a ^C stops the session, which ends this
            fds = self._compile()
            names = list(fds)
            socket.send_fds(sock, [json.dumps({"names": names}).encode()], [fds[n] for n in names])
            status = 0
        except BaseException as e:  # the session says why; its recording goes on without these programs
            try:
                sock.send(json.dumps({"error": f"{type(e).__name__}: {e}"}).encode())
            except OSError:
                pass
        finally:
            # no interpreter exit: its atexit handlers would detach the session's probes (BCC's
            # cleanup of the inherited object), and buffered output would be written twice
            os._exit(status)

    def _compile(self) -> dict[str, int]:
        from bcc import BPF

        w = self.wanted
        obj = BPF(text=self.text, cflags=CFLAGS)
        mine, theirs = map_id(obj[w.shared].map_fd), map_id(self.session_bpf[w.shared].map_fd)
        if mine is None or mine != theirs:  # another session's BPF object in this process
            raise RuntimeError(f"its map {w.shared} is not the session's ({mine} != {theirs})")
        fds = {name: obj.load_func(name, kind).fd for name, kind in w.programs.items()}
        for array, names in w.arrays.items():
            table = obj.get_table(array)
            for slot, name in enumerate(names):
                table[ctypes.c_int(slot)] = ctypes.c_int(obj.load_func(name, w.array_type).fd)
            fds[array] = table.map_fd  # held by the session: the array keeps its programs while it is open
        for name in w.maps:
            fds[name] = obj[name].map_fd
        return fds

    def poll(self) -> dict[str, int] | None:
        """The descriptors once the child sent them (then again at every call), else None; after a
        failure None with `error` set."""
        if self.fds is not None or self.error is not None or self._sock is None:
            return self.fds
        try:
            data, fds, _flags, _addr = socket.recv_fds(self._sock, 4096, _MAX_FDS)
        except BlockingIOError:
            return None
        except OSError as e:
            data, fds = b"", []
            self.error = f"no answer from the compile: {e}"
        self.elapsed = time.monotonic() - self.started
        self._close_channel()
        try:
            message = json.loads(data) if data else {}
        except ValueError:
            message = {}
        names: Sequence[str] = message.get("names", ())
        if len(names) == len(fds) and names:
            self.fds = dict(zip(names, fds, strict=True))
            return self.fds
        for fd in fds:
            os.close(fd)
        self.error = message.get("error") or self.error or "the compile ended without its programs"
        return None

    def cancel(self) -> None:
        """End a compile still running (nothing of it was attached); a finished one is left as it is."""
        if self.pid is not None and self.fds is None and self.error is None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.error = "cancelled"
        self._close_channel()

    def _close_channel(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        if self.pid is not None:
            try:
                _pid, _status, usage = os.wait4(self.pid, 0)  # it has sent its answer, or was killed: it is ending
                self.cpu_s = usage.ru_utime + usage.ru_stime
            except ChildProcessError:
                pass
            self.pid = None
