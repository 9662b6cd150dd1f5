"""A process's place in its job, from its environment and cgroup path (recorder/core/job.py), and
the phrase reports print (store/analysis/jobs.py). No root needed: the texts are the kernel's formats."""

from __future__ import annotations

import os
import subprocess
import sys

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
    job = job_identity({"RANK": "not a number", "PATH": "/usr/bin"}, "read", "0::/\n")
    assert job.job_rank is None and job_label(job.__dict__) is None
    unreadable = job_identity(None, "unreadable: Permission denied", "")
    assert job_label(unreadable.__dict__) == "environment unreadable: Permission denied: rank and job not known"
    assert parse_environ(b"A=1\0B=x=y\0junk\0\0") == {"A": "1", "B": "x=y"}


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
