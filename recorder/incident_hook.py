"""`--on-incident CMD`: a command run for every incident the flight recorder saves, so that someone
hears of it (a page, a chat post, an upload).

The command gets the incident recording's path and a one-line summary as its last two arguments
and in the environment (STALL_RECORDER_INCIDENT, STALL_RECORDER_INCIDENT_SUMMARY, with the trigger,
the primary cause kind and the flight recording's database). It runs without a shell (CMD is split
as a shell would split it, nothing expanded) unless `--on-incident-shell` asks for /bin/sh, in a
thread and a process group of its own, so it never holds up the recording; past
`--on-incident-timeout` its process group is killed. A failure is logged in one line, once: later
ones are counted (`stall_recorder_hook_failures_total`).

The recorder runs as root with the node's secrets in its environment (an object store's keys for
--ship, tokens); the command gets none of that: only PATH, LANG, the STALL_RECORDER_* variables of
the incident, and the variables named with `--on-incident-env NAME` (or set there, NAME=VALUE).
Its output is read as it comes and only its last OUTPUT_LIMIT characters kept, and every wait on it
is bounded: a command that leaves a child holding its output open (one that escaped its process
group) cannot hold up the thread past the timeout and KILL_WAIT_S.
"""

from __future__ import annotations

import os
import re
import selectors
import shlex
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from store.errors import UserError
from store.text import printable

OUTPUT_LIMIT = 2000  # characters of the command's output quoted when it fails (only its tail is kept)
KILL_WAIT_S = 5.0  # after the process group is killed, how long its exit (and its output's end) is awaited
PASSED_ALWAYS = ("PATH", "LANG")  # of the recorder's environment, what every command gets
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")


def hook_environment(passed: tuple[str, ...], incident: dict[str, str],
                     recorder_env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The command's whole environment: PATH and LANG of the recorder's, each of `passed` (NAME: the
    recorder's value, when it has one; NAME=VALUE: that value), then the incident's."""
    source: Mapping[str, str] = os.environ if recorder_env is None else recorder_env
    env = {name: source[name] for name in PASSED_ALWAYS if name in source}
    for item in passed:
        name, sep, value = item.partition("=")
        if sep:
            env[name] = value
        elif name in source:
            env[name] = source[name]
    return {**env, **incident}


@dataclass(frozen=True)
class HookOptions:
    command: str
    shell: bool = False
    timeout_s: float = 60.0
    env: tuple[str, ...] = field(default=())  # --on-incident-env: NAME or NAME=VALUE, passed on purpose

    def argv(self, path: str, summary: str) -> list[str]:
        if self.shell:  # $1 is the path, $2 the summary
            return ["/bin/sh", "-c", self.command, "on-incident", path, summary]
        return [*shlex.split(self.command), path, summary]

    def check(self) -> None:
        """Refuse, at the start, a command that cannot run."""
        if self.timeout_s <= 0:
            raise UserError("--on-incident-timeout must be more than 0: pass e.g. --on-incident-timeout 60s")
        for item in self.env:
            if not _ENV_NAME.fullmatch(item.partition("=")[0]):
                raise UserError(f"--on-incident-env {item!r}: give a variable's NAME (passed from the recorder's "
                                "environment) or NAME=VALUE, e.g. --on-incident-env PAGER_TOKEN")
        if self.shell:
            if not self.command.strip():
                raise UserError("--on-incident is empty: pass a command, e.g. --on-incident /usr/local/bin/page-me")
            return
        try:
            words = shlex.split(self.command)
        except ValueError as e:
            raise UserError(f"cannot split --on-incident {self.command!r} ({e}): quote it as a shell would") from None
        if not words:
            raise UserError("--on-incident is empty: pass a command, e.g. --on-incident /usr/local/bin/page-me")
        if shutil.which(words[0]) is None:
            raise UserError(f"--on-incident: {words[0]} is not an executable file or a command on PATH: pass its "
                            "full path (add --on-incident-shell to run a shell command line)")


class IncidentHook:
    """Runs the command for each incident, each run in a thread of its own."""

    def __init__(self, options: HookOptions) -> None:
        self.options = options
        self.runs = 0
        self.failures = 0
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._logged = False

    def run(self, path: str, summary: str, env: dict[str, str]) -> None:
        """Start the command for one incident and return at once."""
        t = threading.Thread(target=self._run, args=(path, summary, env), name="stall-on-incident", daemon=True)
        with self._lock:
            self._threads = [x for x in self._threads if x.is_alive()] + [t]
        t.start()

    def wait(self, timeout_s: float | None = None) -> None:
        """At stop: give the commands still running their time (bounded by their timeout)."""
        with self._lock:
            threads = list(self._threads)
        for t in threads:
            t.join(timeout_s if timeout_s is not None else self.options.timeout_s + 5)

    def _run(self, path: str, summary: str, env: dict[str, str]) -> None:
        argv = self.options.argv(path, summary)
        full_env = hook_environment(self.options.env, {**env, "STALL_RECORDER_INCIDENT": path,
                                                       "STALL_RECORDER_INCIDENT_SUMMARY": summary})
        with self._lock:
            self.runs += 1
        try:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    env=full_env, start_new_session=True)
        except OSError as e:
            self._failed(f"could not start ({e.strerror})")
            return
        assert proc.stdout is not None  # stdout=PIPE
        with proc.stdout:
            out, done = _read_tail(proc, time.monotonic() + self.options.timeout_s)
            if not done:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                try:
                    proc.wait(KILL_WAIT_S)
                except subprocess.TimeoutExpired:
                    pass
                # no wait for the output's end: a child that left the group may hold it open for ever
                self._failed(f"killed after --on-incident-timeout {self.options.timeout_s:g} s")
                return
        if proc.returncode != 0:
            text = printable(out.decode(errors="replace").strip().replace("\n", " | ")[-OUTPUT_LIMIT:])
            self._failed(f"exit status {proc.returncode}" + (f": {text}" if text else ""))

    def _failed(self, why: str) -> None:
        with self._lock:
            self.failures += 1
            first = not self._logged
            self._logged = True
        if first:
            print(f"recorder: flight recorder: --on-incident {self.options.command!r} failed: {why} (later "
                  "failures are counted in the metrics and the status, not logged)", flush=True)


def _read_tail(proc: subprocess.Popen, deadline: float, out: bytearray | None = None) -> tuple[bytearray, bool]:
    """Read the command's output until it ends and the command exits, or until `deadline`
    (CLOCK_MONOTONIC s), keeping its last OUTPUT_LIMIT * 4 bytes: (output, whether it exited)."""
    out = bytearray() if out is None else out
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    os.set_blocking(fd, False)
    with selectors.DefaultSelector() as sel:
        sel.register(fd, selectors.EVENT_READ)
        while (left := deadline - time.monotonic()) > 0:
            if not sel.select(left):
                continue
            try:
                chunk = os.read(fd, 1 << 16)
            except BlockingIOError:
                continue
            if not chunk:
                break
            out += chunk
            del out[: -OUTPUT_LIMIT * 4]
    try:  # the output ended: its command exits now, or it closed its output and goes on
        proc.wait(max(deadline - time.monotonic(), 0))
    except subprocess.TimeoutExpired:
        return out, False
    return out, True
