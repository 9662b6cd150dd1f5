"""--on-incident's command runner (recorder/incident_hook.py) on real processes: arguments and
environment, a shell only when asked, a timeout that kills the command's whole process group, and
a failure said once."""

from __future__ import annotations

import time

from recorder.incident_hook import HookOptions, IncidentHook


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
