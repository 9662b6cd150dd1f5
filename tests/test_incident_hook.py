"""--on-incident's command runner (recorder/incident_hook.py) on real processes: arguments and
environment, a shell only when asked, a timeout that kills the command's whole process group, and
a failure said once."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from recorder.incident_hook import HookOptions, IncidentHook
from store.errors import UserError


def test_without_a_shell_nothing_is_expanded_and_the_path_and_summary_come_last(tmp_path):
    out = tmp_path / "out"
    hook = IncidentHook(HookOptions(f"sh -c 'echo \"$@\" > {out}; echo $STALL_RECORDER_INCIDENT >> {out}' x $HOME"))
    hook.run("/r/a.db", "one line; $HOME", {})
    hook.wait()
    assert out.read_text().splitlines() == ["$HOME /r/a.db one line; $HOME", "/r/a.db"]
    assert (hook.runs, hook.failures) == (1, 0)


def test_with_a_shell_the_path_and_summary_are_1_and_2(tmp_path):
    out = tmp_path / "out"
    hook = IncidentHook(HookOptions(f'printf "%s|%s" "$1" "$2" > {out}', shell=True))
    hook.run("/r/b.db", "summary", {})
    hook.wait()
    assert out.read_text() == "/r/b.db|summary"


def test_a_failing_command_is_logged_once_and_counted(capsys):
    hook = IncidentHook(HookOptions("sh -c 'echo no route to pager >&2; exit 3'"))
    for n in range(2):
        hook.run(f"/r/{n}.db", "s", {})
        hook.wait()
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1 and "failed: exit status 3: no route to pager (later failures are counted" in lines[0]
    assert (hook.runs, hook.failures) == (2, 2)


def test_a_command_past_its_timeout_is_killed_with_its_children(tmp_path, capsys):
    pidfile = tmp_path / "child"
    hook = IncidentHook(HookOptions(f"sleep 60 & echo $! > {pidfile}; wait", shell=True, timeout_s=0.5))
    started = time.monotonic()
    hook.run("/r/c.db", "s", {})
    hook.wait()
    assert time.monotonic() - started < 10
    assert hook.failures == 1 and "killed after --on-incident-timeout 0.5 s" in capsys.readouterr().out
    child = int(pidfile.read_text())
    time.sleep(0.1)
    try:  # gone, or a zombie nobody waits for yet
        state = open(f"/proc/{child}/stat").read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        state = "gone"
    assert state in ("gone", "Z"), state


def test_a_child_that_escaped_the_group_and_holds_the_output_cannot_hang_the_wait(tmp_path, capsys):
    """The command starts a child in a session of its own (out of reach of the group kill) that
    keeps the command's output open, then outlives its timeout: the run still ends within the
    timeout and KILL_WAIT_S, failed and said so (it used to wait for the child's end of output)."""
    pidfile = tmp_path / "escaped"
    script = tmp_path / "hook.sh"
    script.write_text(f"#!/bin/sh\nsetsid sleep 60 &\necho $! > {pidfile}\nsleep 60\n")
    script.chmod(0o755)
    hook = IncidentHook(HookOptions(str(script), timeout_s=0.5))
    started = time.monotonic()
    try:
        hook.run("/r/d.db", "s", {})
        hook.wait(timeout_s=10)
        took = time.monotonic() - started
        assert hook.failures == 1 and not any(t.is_alive() for t in hook._threads), "the hook's thread still waits"
        assert took < 8, took  # the timeout, and at most KILL_WAIT_S (5 s) for the killed group's exit
        assert "killed after --on-incident-timeout 0.5 s" in capsys.readouterr().out
    finally:
        if pidfile.exists():
            os.kill(int(pidfile.read_text()), signal.SIGKILL)


def test_a_huge_output_is_read_as_it_comes_and_only_its_tail_kept(tmp_path):
    """A command that prints 300 MB before it fails: the recorder's memory does not grow by it
    (it used to hold all of it), and the failure quotes the output's last characters only."""
    # VmHWM: the peak of this process image's memory (ru_maxrss would carry pytest's from before the exec)
    code = ("import sys\n"
            "from recorder.incident_hook import HookOptions, IncidentHook, OUTPUT_LIMIT\n"
            "hook = IncidentHook(HookOptions(\"sh -c 'yes 0123456789abcdef | head -c 300000000; echo; echo the end;"
            " exit 4'\"))\n"
            "hook.run('/r/e.db', 's', {}); hook.wait()\n"
            "peak = next(l for l in open('/proc/self/status') if l.startswith('VmHWM:')).split()[1]\n"
            "print(hook.failures, peak, file=sys.stderr)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parent.parent)
    failures, max_rss_kib = map(int, done.stderr.split())
    assert failures == 1
    assert max_rss_kib < 150_000, max_rss_kib  # ~40 MB here; 300 MB more when it was all kept
    line, = done.stdout.splitlines()
    assert "failed: exit status 4: " in line and line.count("0123456789abcdef") < 2000 // 16 + 2, line[:300]
    assert "| the end (later failures" in line


def test_the_command_gets_a_minimal_environment_and_what_is_passed_on_purpose(tmp_path, monkeypatch):
    """The recorder's environment holds the object store's keys (--ship); the command sees PATH,
    LANG, the incident's variables and what --on-incident-env names, nothing else."""
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "fake-secret-do-not-leak")
    monkeypatch.setenv("STALL_RECORDER_MCP_TOKEN", "another-secret")
    monkeypatch.setenv("PAGER_TOKEN", "p4g3r")
    monkeypatch.setenv("LANG", "C.UTF-8")
    out = tmp_path / "env"
    script = tmp_path / "hook.sh"
    script.write_text(f"#!/bin/sh\nenv > {out}\n")
    script.chmod(0o755)
    hook = IncidentHook(HookOptions(str(script), env=("PAGER_TOKEN", "TEAM=ml", "NOT_SET_ANYWHERE")))
    hook.run("/r/f.db", "summary", {"STALL_RECORDER_INCIDENT_TRIGGER": "stall"})
    hook.wait()
    env = dict(line.split("=", 1) for line in out.read_text().splitlines())
    assert "fake-secret-do-not-leak" not in out.read_text() and "another-secret" not in out.read_text()
    env.pop("PWD", None)  # the shell's own
    assert env == {"PATH": os.environ["PATH"], "LANG": "C.UTF-8", "PAGER_TOKEN": "p4g3r", "TEAM": "ml",
                   "STALL_RECORDER_INCIDENT": "/r/f.db", "STALL_RECORDER_INCIDENT_SUMMARY": "summary",
                   "STALL_RECORDER_INCIDENT_TRIGGER": "stall"}


def test_a_bad_env_name_is_refused_at_the_start():
    with pytest.raises(UserError, match="--on-incident-env 'A B': give a variable's NAME"):
        HookOptions("/bin/true", env=("A B",)).check()


def test_the_summary_has_no_control_characters_of_a_process_name():
    """The cause names the contending process, which chose its own name: an escape sequence or a
    bell in it never reaches the pager's line."""
    from recorder.flight import incident_summary

    facts = {"stall": True, "step": 7, "cause_kind": "cpu_contention",
             "cause": "CPU contention: evil\x1b]0;pwned\x07\u202ename (pid 9) held the CPU\r\nforged"}
    line = incident_summary("stall", 1_700_000_000 * 10**9, "node1", facts, "detail\x00")
    assert line == ("stall-recorder on node1: stall incident at 2023-11-14T22:13:20Z: step 7 stalled, primary cause "
                    "cpu_contention: CPU contention: evil]0;pwnedname (pid 9) held the CPU forged; detail")


@pytest.mark.parametrize(("args", "message"), [
    (("--keep", "10m", "--on-incident-env", "PAGER_TOKEN"),
     "--on-incident-env passes variables to the --on-incident command: add --on-incident CMD"),
    (("--keep", "10m", "--on-incident", "/bin/true", "--on-incident-env", "2BAD"),
     "--on-incident-env '2BAD': give a variable's NAME (passed from the recorder's environment) or NAME=VALUE, "
     "e.g. --on-incident-env PAGER_TOKEN"),
])
def test_bad_on_incident_env_options_are_one_line_errors(tmp_path, args, message):
    from conftest import run_recorder

    res = run_recorder("record", "--db", str(tmp_path / "f.db"), *args, "--", "true")
    assert res.returncode == 2 and res.stderr.strip() == f"recorder: {message}"
    assert not (tmp_path / "f.db").exists()
