"""The systemd unit and the Kubernetes DaemonSet in packaging/: systemd accepts the unit, and the
command line each runs parses with the real CLI into a foreground flight recording of every
process, kept on local disk, with its metrics file; the DaemonSet has what BPF needs from the node."""

from __future__ import annotations

import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import ROOT

from recorder.cli import _flight_options, build_parser
from recorder.core.settings import Settings

UNIT = ROOT / "packaging" / "stall-recorder.service"
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
    _check_command(container["command"], "/var/lib/node_exporter/textfile_collector")
    volumes = {v["name"]: v["hostPath"]["path"] for v in pod["volumes"]}
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    for path in ("/opt/stall-recorder", "/var/lib/stall-recorder", "/var/lib/node_exporter/textfile_collector",
                 "/sys/kernel/debug", "/sys/kernel/tracing", "/sys/fs/bpf", "/sys/kernel/btf"):
        assert path in mounts, path
        assert volumes[mounts[path]["name"]] == path  # the node's own folder, at the same place
    assert mounts["/opt/stall-recorder"].get("readOnly") is True
    assert pod["terminationGracePeriodSeconds"] >= 60  # the stop builds indexes
