"""`--on-incident CMD`: a command run for every incident the flight recorder saves, so that someone
hears of it (a page, a chat post, an upload).

The command gets the incident recording's path and a one-line summary as its last two arguments
and in the environment (STALL_RECORDER_INCIDENT, STALL_RECORDER_INCIDENT_SUMMARY, with the trigger,
the primary cause kind and the flight recording's database). It runs without a shell (CMD is split
as a shell would split it, nothing expanded) unless `--on-incident-shell` asks for /bin/sh, in a
thread and a process group of its own, so it never holds up the recording; past
`--on-incident-timeout` its process group is killed. A failure is logged in one line, once: later
ones are counted (`stall_recorder_hook_failures_total`).
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import threading
from dataclasses import dataclass

from store.errors import UserError

OUTPUT_LIMIT = 2000  # characters of the command's output quoted when it fails


@dataclass(frozen=True)
class HookOptions:
    command: str
    shell: bool = False
    timeout_s: float = 60.0

    def argv(self, path: str, summary: str) -> list[str]:
        if self.shell:  # $1 is the path, $2 the summary
            return ["/bin/sh", "-c", self.command, "on-incident", path, summary]
        return [*shlex.split(self.command), path, summary]

    def check(self) -> None:
        """Refuse, at the start, a command that cannot run."""
        if self.timeout_s <= 0:
            raise UserError("--on-incident-timeout must be more than 0: pass e.g. --on-incident-timeout 60s")
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
        full_env = {**os.environ, **env, "STALL_RECORDER_INCIDENT": path, "STALL_RECORDER_INCIDENT_SUMMARY": summary}
        with self._lock:
            self.runs += 1
        try:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    env=full_env, start_new_session=True)
        except OSError as e:
            self._failed(f"could not start ({e.strerror})")
            return
        try:
            out, _ = proc.communicate(timeout=self.options.timeout_s)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.communicate()
            self._failed(f"killed after --on-incident-timeout {self.options.timeout_s:g} s")
            return
        if proc.returncode != 0:
            text = out.decode(errors="replace").strip().replace("\n", " | ")[-OUTPUT_LIMIT:]
            self._failed(f"exit status {proc.returncode}" + (f": {text}" if text else ""))

    def _failed(self, why: str) -> None:
        with self._lock:
            self.failures += 1
            first = not self._logged
            self._logged = True
        if first:
            print(f"recorder: flight recorder: --on-incident {self.options.command!r} failed: {why} (later "
                  "failures are counted in the metrics and the status, not logged)", flush=True)
