"""The systemd unit and the Kubernetes DaemonSet in packaging/: systemd accepts the unit, and the
command line each runs parses with the real CLI into a foreground flight recording of every
process, kept on local disk, with its metrics file; the DaemonSet has what BPF needs from the node.
Both keep the recordings to root and the stall-recorder group: a real recorder run with the unit's
group, umask and folder mode writes a recording a member of the group reads and another user cannot
(throwaway users and group, removed again), and the DaemonSet's start-up script leaves its folder so."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import pytest
from conftest import RECORDER, ROOT, needs_bpf

from recorder.cli import _flight_options, build_parser
from recorder.core.settings import Settings

UNIT = ROOT / "packaging" / "stall-recorder.service"
SYSUSERS = ROOT / "packaging" / "stall-recorder.sysusers"
DAEMONSET = ROOT / "packaging" / "stall-recorder-daemonset.yaml"
BUNDLE_RECORDER = "/opt/stall-recorder/bin/recorder"


def _unit() -> dict[str, dict[str, str]]:
    sections: dict[str, dict[str, str]] = {}
    current = None
    for line in UNIT.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("["):
            current = sections.setdefault(line.strip("[]"), {})
            continue
        key, _, value = line.partition("=")
        assert current is not None and key not in current, line
        current[key] = value
    return sections


def _check_command(argv: list[str], metrics_dir: str):
    """The recorder's arguments as the real CLI reads them."""
    assert argv[0] == BUNDLE_RECORDER
    args = build_parser(Settings()).parse_args(argv[1:])
    assert args.command == "start" and args.all and args.foreground
    flight = _flight_options(args)
    assert flight is not None and flight.keep_ns == 600 * 10**9 and flight.max_bytes == 2 * 10**9
    assert args.db == Path("/var/lib/stall-recorder/flight.db")
    assert args.metrics_file.parent == Path(metrics_dir) and args.metrics_file.suffix == ".prom"
    return args


def test_the_units_command_is_a_foreground_flight_recording():
    service = _unit()["Service"]
    _check_command(shlex.split(service["ExecStart"]), "/var/lib/stall-recorder/metrics")
    assert service["Type"] == "notify"  # READY=1 once attached (recorder/daemon.py)
    assert service["Restart"] == "on-failure"
    # the folders the command writes are made by systemd
    assert set(service["StateDirectory"].split()) == {"stall-recorder", "stall-recorder/metrics"}


def test_the_unit_keeps_recordings_to_root_and_the_stall_recorder_group():
    service = _unit()["Service"]
    assert service.get("User", "root") == "root" and service["Group"] == "stall-recorder"
    # nothing it creates is writable by the group, or anything at all to others
    assert int(service["UMask"], 8) & 0o027 == 0o027
    for key in ("StateDirectoryMode", "CacheDirectoryMode"):
        assert int(service[key], 8) & 0o027 == 0, key
    # the group is made where the unit is installed
    assert SYSUSERS.read_text().split("\n").count("g stall-recorder -") == 1


@pytest.mark.skipif(shutil.which("systemd-sysusers") is None, reason="no systemd-sysusers on this machine")
def test_sysusers_makes_the_group(tmp_path):
    (tmp_path / "etc").mkdir()
    res = subprocess.run(["systemd-sysusers", f"--root={tmp_path}", str(SYSUSERS)], capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 0, res.stderr
    groups = [line.split(":") for line in (tmp_path / "etc/group").read_text().splitlines()]
    [(name, _, gid, members)] = [g for g in groups if g[0] == "stall-recorder"]
    assert int(gid) < 1000 and members == ""  # a system group, nobody in it until the operator adds a reader


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="no systemd-analyze on this machine")
def test_systemd_accepts_the_unit(tmp_path):
    """systemd-analyze verify in a root of its own, with the bundle's recorder there as a stub (it
    checks that ExecStart is executable) and the system's units (After=, WantedBy=)."""
    root = tmp_path / "root"
    stub = root / BUNDLE_RECORDER.lstrip("/")
    stub.parent.mkdir(parents=True)
    stub.write_text("#!/bin/sh\n")
    stub.chmod(0o755)
    (root / "etc/systemd/system").mkdir(parents=True)
    shutil.copy(UNIT, root / "etc/systemd/system" / UNIT.name)
    shutil.copytree("/usr/lib/systemd/system", root / "usr/lib/systemd/system", symlinks=True)
    res = subprocess.run(["systemd-analyze", "verify", f"--root={root}", f"/etc/systemd/system/{UNIT.name}"],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and res.stderr.strip() == "" and res.stdout.strip() == "", res


def test_the_daemonset_runs_the_bundle_from_the_node_with_what_bpf_needs():
    yaml = pytest.importorskip("yaml")
    ds = yaml.safe_load(DAEMONSET.read_text())
    assert ds["kind"] == "DaemonSet" and ds["apiVersion"] == "apps/v1"
    pod = ds["spec"]["template"]["spec"]
    assert ds["spec"]["selector"]["matchLabels"].items() <= ds["spec"]["template"]["metadata"]["labels"].items()
    assert pod["hostPID"] is True
    (container,) = pod["containers"]
    assert container["securityContext"]["privileged"] is True
    shell, dash_c, _script, _argv0 = container["command"]
    assert (shell, dash_c) == ("/bin/sh", "-c")
    _check_command(container["args"], "/var/lib/node_exporter/textfile_collector")
    volumes = {v["name"]: v["hostPath"]["path"] for v in pod["volumes"]}
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    for path in ("/opt/stall-recorder", "/var/lib/stall-recorder", "/var/lib/node_exporter/textfile_collector",
                 "/sys/kernel/debug", "/sys/kernel/tracing", "/sys/fs/bpf", "/sys/kernel/btf"):
        assert path in mounts, path
        assert volumes[mounts[path]["name"]] == path  # the node's own folder, at the same place
    assert mounts["/opt/stall-recorder"].get("readOnly") is True
    assert mounts["/host/etc/group"].get("readOnly") is True and volumes["groups"] == "/etc/group"
    assert pod["terminationGracePeriodSeconds"] >= 60  # the stop builds indexes


def _daemonset_script() -> str:
    yaml = pytest.importorskip("yaml")
    (container,) = yaml.safe_load(DAEMONSET.read_text())["spec"]["template"]["spec"]["containers"]
    return container["command"][2]


@pytest.fixture
def throwaway_accounts():
    """A group standing in for stall-recorder, a user in it and a user outside it, removed again."""
    if os.geteuid() != 0 or not (shutil.which("useradd") and shutil.which("runuser")):
        pytest.skip("needs root, useradd and runuser to make throwaway users and read as them")
    tag = uuid.uuid4().hex[:8]
    group, member, other = f"srgrp{tag}", f"srmem{tag}", f"srout{tag}"
    made: list[list[str]] = []
    try:
        for cmd, undo in ((["groupadd", "--system", group], ["groupdel", group]),
                          (["useradd", "--system", "--no-create-home", "-G", group, member], ["userdel", member]),
                          (["useradd", "--system", "--no-create-home", other], ["userdel", other])):
            subprocess.run(cmd, check=True, capture_output=True, timeout=60)
            made.append(undo)
        import grp

        yield grp.getgrnam(group).gr_gid, member, other
    finally:
        for undo in reversed(made):
            subprocess.run(undo, capture_output=True, timeout=60)


def _as(user: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["runuser", "-u", user, "--", *args], capture_output=True, text=True, cwd=ROOT, timeout=120)


@needs_bpf
def test_a_recording_made_as_the_unit_runs_is_read_by_the_group_and_by_no_one_else(throwaway_accounts):
    """The unit's folder (StateDirectoryMode, owner root:Group), umask and group given to a real
    recorder; a member of the group reads the recording with `recorder explain`, another user
    cannot open any of its files."""
    gid, member, other = throwaway_accounts
    service = _unit()["Service"]
    base = Path(tempfile.mkdtemp(prefix="stall-recorder-unit-"))
    try:
        base.chmod(0o755)  # /var/lib
        state = base / "stall-recorder"
        for folder in (state, state / "metrics"):  # as systemd makes StateDirectory=
            folder.mkdir()
            os.chown(folder, 0, gid)
            folder.chmod(int(service["StateDirectoryMode"], 8))
        db = state / "flight.db"
        workload = "import time\nfor _ in range(20):\n    sum(range(100000)); time.sleep(0.01)\n"
        recorded = subprocess.run(
            [*RECORDER, "record", "--db", str(db), "--metrics-file", str(state / "metrics/stall_recorder.prom"), "--",
             "/usr/bin/python3", "-c", workload],
            cwd=ROOT, capture_output=True, text=True, timeout=300,
            user=0, group=gid, extra_groups=[], umask=int(service["UMask"], 8))
        assert recorded.returncode == 0, recorded.stdout + recorded.stderr
        files = [p for p in state.rglob("*") if p.is_file()]
        assert db in files and state / "metrics/stall_recorder.prom" in files, files
        metrics = state / "metrics/stall_recorder.prom"
        for p in [state, *state.rglob("*")]:
            st = p.lstat()
            # the metrics file holds no process's data and is written 0644 for node_exporter's user;
            # its folder (0750) is what keeps it from other users, as the reads below check
            denied = 0o022 if p == metrics else 0o027
            assert st.st_uid == 0 and st.st_gid == gid and st.st_mode & denied == 0, (p, oct(st.st_mode))
        explained = _as(member, sys.executable, "-m", "recorder", "explain", "--db", str(db))
        assert explained.returncode == 0, explained.stderr
        assert any(line.startswith("Observed: ") for line in explained.stdout.splitlines()), explained.stdout
        refused = _as(other, sys.executable, "-m", "recorder", "explain", "--db", str(db))
        assert refused.returncode != 0 and str(db) not in refused.stdout, refused.stdout
        for p in files:
            read = ("dd", f"if={p}", "of=/dev/null", "count=1", "status=none")
            assert _as(other, *read).returncode != 0, p
            assert _as(member, *read).returncode == 0, p
    finally:
        shutil.rmtree(base)


def test_the_daemonsets_start_up_leaves_the_recordings_to_root_and_the_group(throwaway_accounts, tmp_path):
    """The pod's script run for real on a folder holding a recording of an earlier, looser start
    (0644 and 0755), with the node's group file holding the group; then without the group."""
    gid, _, _ = throwaway_accounts
    script = _daemonset_script()
    state, groups = tmp_path / "state", tmp_path / "group"
    assert script.count("/var/lib/stall-recorder") == 1 and script.count("/host/etc/group") == 1
    script = script.replace("/var/lib/stall-recorder", str(state)).replace("/host/etc/group", str(groups))
    (state / "flight.db.incidents").mkdir(parents=True, mode=0o755)
    (state / "flight.db").write_text("")
    (state / "flight.db").chmod(0o644)
    report = 'umask; touch "$0/new"; stat -c "%a %g" "$0" "$0/new"'

    def start(group_line: str) -> list[str]:
        groups.write_text(f"root:x:0:\n{group_line}\n")
        r = subprocess.run(["sh", "-c", script, "stall-recorder", "sh", "-c", report, str(state)],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        (state / "new").unlink()
        return r.stdout.split("\n")[:3]

    assert start(f"stall-recorder:x:{gid}:") == ["0027", f"2750 {gid}", f"640 {gid}"]
    for p in (state / "flight.db", state / "flight.db.incidents"):
        assert p.stat().st_gid == gid and p.stat().st_mode & 0o027 == 0, p
    assert oct((state / "flight.db.incidents").stat().st_mode & 0o7777) == "0o2750"  # what is saved there: the group's
    # a node without the group: root's alone
    assert start("users:x:100:") == ["0027", "700 0", "640 0"]
    assert all(p.stat().st_mode & 0o077 == 0 for p in state.rglob("*"))
