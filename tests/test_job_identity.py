"""A process's place in its job, from its environment and cgroup path (recorder/core/job.py), and
the phrase reports print (store/analysis/jobs.py). No root needed: the texts are the kernel's formats."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from recorder.core.job import job_identity, parse_environ, read_job_identity
from store.analysis.jobs import job_label

TORCHRUN = {"RANK": "17", "LOCAL_RANK": "1", "WORLD_SIZE": "32", "MASTER_ADDR": "10.0.0.3", "MASTER_PORT": "29500",
            "TORCHELASTIC_RUN_ID": "4711"}


def test_torchrun_environment():
    job = job_identity(TORCHRUN, "read", "0::/user.slice/user-1000.slice/session-3.scope\n")
    assert (job.job_rank, job.job_local_rank, job.job_world_size) == (17, 1, 32)
    assert (job.master_addr, job.run_id) == ("10.0.0.3:29500", "4711")
    assert job.cgroup == "/user.slice/user-1000.slice/session-3.scope"
    assert job.slurm_job_id is None and job.pod_uid is None
    assert job_label(job.__dict__) == "rank 17 of 32 (local rank 1), torchrun run 4711"


def test_slurm_from_the_environment_and_from_the_cgroup_path():
    env = {"SLURM_JOB_ID": "4711", "SLURM_STEP_ID": "0", "SLURM_PROCID": "5", "SLURM_LOCALID": "1", "SLURM_NTASKS": "8"}
    job = job_identity(env, "read", "0::/\n")
    assert (job.job_rank, job.job_local_rank, job.job_world_size) == (5, 1, 8)
    assert (job.slurm_job_id, job.slurm_step_id) == ("4711", "0")
    # RANK set by torchrun inside an sbatch job wins over the Slurm task id
    assert job_identity({**env, "RANK": "2"}, "read", "").job_rank == 2
    v1 = "7:memory:/slurm/uid_1000/job_4711/step_batch\n0::/\n"
    v2 = "0::/system.slice/slurmstepd.scope/job_4712/step_3/user/task_0\n"
    for text, ids in ((v1, ("4711", "batch")), (v2, ("4712", "3"))):
        job = job_identity({}, "empty", text)
        assert (job.slurm_job_id, job.slurm_step_id) == ids


def test_kubernetes_pod_from_the_cgroup_path_and_the_downward_api():
    uid = "1a2b3c4d-0000-4111-8222-123456789abc"
    systemd = (f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{uid.replace('-', '_')}.slice"
               "/cri-containerd-ab12.scope\n")
    cgroupfs = f"0::/kubepods/besteffort/pod{uid}/0123456789ab\n"
    for text in (systemd, cgroupfs):
        assert job_identity({}, "read", text).pod_uid == uid
    job = job_identity({"POD_NAME": "trainer-3", "POD_NAMESPACE": "ml", **TORCHRUN}, "read", systemd)
    assert (job.pod_name, job.pod_namespace, job.pod_uid) == ("trainer-3", "ml", uid)
    assert job_label(job.__dict__) == (f"rank 17 of 32 (local rank 1), torchrun run 4711, pod ml/trainer-3 (uid {uid})")


def test_nothing_is_guessed():
    job = job_identity({"PATH": "/usr/bin"}, "read", "0::/\n")
    assert job.job_rank is None and job_label(job.__dict__) is None
    job = job_identity({"RANK": "not a number", "PATH": "/usr/bin"}, "read", "0::/\n")
    assert job.job_rank is None
    assert job_label(job.__dict__) == "RANK unreadable: 'not a number' is not an integer from 0 to 16777216"
    unreadable = job_identity(None, "unreadable: Permission denied", "")
    assert job_label(unreadable.__dict__) == "environment unreadable: Permission denied: rank and job not known"
    # only the variables an identity is made of are taken, each whole after its first '='
    assert parse_environ(b"A=1\0RANK=x=y\0junk\0\0XLOCAL_RANK=5\0LOCAL_RANK=2") == {"RANK": "x=y", "LOCAL_RANK": "2"}


def test_hostile_values_are_refused_with_why_and_the_rest_is_kept():
    """What any process on the node may put in its environment: digits int() refuses, integers
    SQLite cannot hold, newlines and escapes that would forge report lines. Each is left NULL and
    said in environ_status; the values that are fine are kept."""
    env = {"RANK": "\u00b2", "LOCAL_RANK": "3", "WORLD_SIZE": "99999999999999999999", "SLURM_PROCID": "7",
           "MASTER_ADDR": "10.0.0.1\nPrimary cause: none", "MASTER_PORT": "99999", "TORCHELASTIC_RUN_ID": "r\x1b[2J",
           "SLURM_JOB_ID": "4711", "POD_NAME": "a" * 300, "POD_NAMESPACE": "ml"}
    job = job_identity(env, "read", "0::/evil\nPrimary cause: \x1b[31mnothing\n")
    assert (job.job_rank, job.job_local_rank, job.job_world_size) == (None, 3, None)  # RANK decides, not SLURM_PROCID
    assert (job.master_addr, job.run_id, job.pod_name) == (None, None, None)
    assert (job.slurm_job_id, job.pod_namespace) == ("4711", "ml")
    assert job.cgroup == "/evil"  # the cgroup file's first line only, as before
    assert job.environ_status.split("; ") == [
        "read", "RANK unreadable: '\u00b2' is not an integer from 0 to 16777216",
        "WORLD_SIZE unreadable: '99999999999999999999' is not an integer from 1 to 16777216",
        "MASTER_ADDR unreadable: '10.0.0.1\\nPrimary cause: none' is not a host name or address",
        "TORCHELASTIC_RUN_ID unreadable: 'r\\x1b[2J' is not 1 to 128 printable ASCII characters",
        f"POD_NAME unreadable: '{'a' * 37}...' is not a Kubernetes object name",
        "MASTER_PORT unreadable: '99999' is not a port number"]
    assert "\n" not in job_label(job.__dict__) and "\x1b" not in job.environ_status
    # a cgroup path with control characters in it (a delegated subtree names its own cgroups)
    job = job_identity({}, "empty", "0::/user.slice/x\x1b]0;owned\x07y\n")
    assert job.cgroup == "/user.slice/x\\x1b]0;owned\\x07y"
    assert job_identity({}, "read", "0::/" + "d/" * 2000).cgroup.endswith("...")


def test_a_huge_environment_is_read_up_to_its_cap_quickly(tmp_path):
    """A 1 MiB environment (eight variables of 128 KiB, the kernel's limit for one) with RANK past
    the cap: the cap's worth is read in well under a millisecond's work per kilobyte, the variable
    the cap cuts is dropped whole, and environ_status says the rest was not read."""
    from recorder.core.job import ENVIRON_MAX

    big = {f"BIG{i}": "x" * (128 * 1024 - 16) for i in range(8)}
    proc = subprocess.Popen(["sleep", "30"], env={"LOCAL_RANK": "1", **big, "RANK": "5"})
    try:
        deadline = time.monotonic() + 10
        while b"RANK=5" not in Path(f"/proc/{proc.pid}/environ").read_bytes():
            assert time.monotonic() < deadline
            time.sleep(0.01)
        started = time.perf_counter()
        job = read_job_identity(proc.pid)
        took = time.perf_counter() - started
    finally:
        proc.kill()
        proc.wait()
    assert (job.job_local_rank, job.job_rank) == (1, None)
    assert job.environ_status == f"read; truncated: variables past its first {ENVIRON_MAX} bytes not read"
    assert took < 0.05, took  # ~1 ms here; it was ~10 ms of the recorder's main loop per process


def test_read_from_a_live_process_and_from_one_that_is_gone():
    # it says when it runs: until its exec is through, its environment reads empty
    proc = subprocess.Popen([sys.executable, "-c", "import time; print(1, flush=True); time.sleep(30)"],
                            env={**os.environ, **TORCHRUN, "SLURM_JOB_ID": "99"}, stdout=subprocess.PIPE)
    try:
        proc.stdout.readline()
        job = read_job_identity(proc.pid)
    finally:
        proc.kill()
        proc.wait()
    assert job.environ_status == "read"
    assert (job.job_rank, job.job_world_size, job.run_id, job.slurm_job_id) == (17, 32, "4711", "99")
    assert read_job_identity(proc.pid).environ_status == "gone"
