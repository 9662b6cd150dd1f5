"""A process's place in its job, read once when the recorder first sees it: rank, local rank, world
size, rendezvous, run id, Slurm job and step, Kubernetes pod. They come from the process's initial
environment (/proc/PID/environ, what the launcher gave it: torchrun, srun, the kubelet's downward
API) and its cgroup path (kubepods-...-pod<UID>.slice, .../job_<ID>/step_<ID>). A value the process
does not carry is NULL, never guessed; an environment that could not be read is said so in
`environ_status`.
"""

from __future__ import annotations

import re
from dataclasses import astuple, dataclass

ENVIRON_MAX = 1 << 20  # bytes of /proc/PID/environ read (a process may carry a huge one)

# column <- the variables that give it, the first present wins: torchrun's, then Slurm's
_INTEGERS = {
    "job_rank": ("RANK", "SLURM_PROCID"),
    "job_local_rank": ("LOCAL_RANK", "SLURM_LOCALID"),
    "job_world_size": ("WORLD_SIZE", "SLURM_NTASKS"),
}
# Kubernetes sets none of these by itself: a pod spec exposes them through the downward API under
# names of its choosing; these are the usual ones
_POD_NAME = ("POD_NAME", "MY_POD_NAME", "K8S_POD_NAME", "KUBERNETES_POD_NAME")
_POD_NAMESPACE = ("POD_NAMESPACE", "MY_POD_NAMESPACE", "K8S_POD_NAMESPACE", "KUBERNETES_NAMESPACE")
_POD_UID = ("POD_UID", "MY_POD_UID", "K8S_POD_UID")
# kubepods-burstable-pod1a2b3c4d_....slice (systemd driver), /kubepods/burstable/pod1a2b3c4d-.../ (cgroupfs)
_KUBEPODS_UID = re.compile(r"kubepods.*?pod([0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12})")
# /slurm/uid_1000/job_4711/step_0 (cgroup v1), /system.slice/slurmstepd.scope/job_4711/step_batch (v2)
_SLURM = re.compile(r"/job_(\d+)(?:/step_([\w.]+))?")

JOB_COLUMNS = ("environ_status", "job_rank", "job_local_rank", "job_world_size", "master_addr", "run_id",
               "slurm_job_id", "slurm_step_id", "pod_uid", "pod_namespace", "pod_name", "cgroup")


@dataclass(frozen=True)
class JobIdentity:
    """The columns JOB_COLUMNS of a `process` row (store/migrations/0020_process_job.sql)."""

    environ_status: str  # 'read', 'empty', or why it was not: 'unreadable: Permission denied', 'gone'
    job_rank: int | None = None  # not `rank`: nccl_comm.rank is the communicator's
    job_local_rank: int | None = None
    job_world_size: int | None = None
    master_addr: str | None = None  # MASTER_ADDR:MASTER_PORT (or the address alone)
    run_id: str | None = None  # TORCHELASTIC_RUN_ID
    slurm_job_id: str | None = None
    slurm_step_id: str | None = None
    pod_uid: str | None = None
    pod_namespace: str | None = None
    pod_name: str | None = None
    cgroup: str | None = None  # the cgroup v2 path ("0::" line of /proc/PID/cgroup)

    def row(self) -> tuple:
        return astuple(self)


def parse_environ(raw: bytes) -> dict[str, str]:
    out = {}
    for item in raw.split(b"\0"):
        name, sep, value = item.partition(b"=")
        if sep and name:
            out[name.decode("utf-8", "replace")] = value.decode("utf-8", "replace")
    return out


def _first(env: dict[str, str], names: tuple[str, ...]) -> str | None:
    for name in names:
        value = env.get(name, "").strip()
        if value:
            return value
    return None


def _integer(env: dict[str, str], names: tuple[str, ...]) -> int | None:
    value = _first(env, names)
    return int(value) if value is not None and value.isdigit() else None


def job_identity(env: dict[str, str] | None, environ_status: str, cgroup_text: str) -> JobIdentity:
    """The identity from an environment (None when unreadable) and a /proc/PID/cgroup text."""
    env = env or {}
    ints = {column: _integer(env, names) for column, names in _INTEGERS.items()}
    master = _first(env, ("MASTER_ADDR",))
    if master and _first(env, ("MASTER_PORT",)):
        master += ":" + env["MASTER_PORT"].strip()
    v2 = next((line[3:] for line in cgroup_text.splitlines() if line.startswith("0::")), None)
    pod_uid = _first(env, _POD_UID)
    slurm_job, slurm_step = _first(env, ("SLURM_JOB_ID", "SLURM_JOBID")), _first(env, ("SLURM_STEP_ID", "SLURM_STEPID"))
    for line in cgroup_text.splitlines():
        path = line.split(":", 2)[-1]
        if pod_uid is None and (m := _KUBEPODS_UID.search(path)):
            pod_uid = m.group(1).replace("_", "-")
        if slurm_job is None and (m := _SLURM.search(path)):
            slurm_job, slurm_step = m.group(1), slurm_step or m.group(2)
    return JobIdentity(environ_status, ints["job_rank"], ints["job_local_rank"], ints["job_world_size"], master,
                       _first(env, ("TORCHELASTIC_RUN_ID",)), slurm_job, slurm_step, pod_uid,
                       _first(env, _POD_NAMESPACE), _first(env, _POD_NAME), v2)


def read_job_identity(pid: int) -> JobIdentity:
    """What /proc says of the job of `pid` now (root reads any process's environment)."""
    try:
        with open(f"/proc/{pid}/cgroup") as f:
            cgroup_text = f.read()
    except OSError:
        cgroup_text = ""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            raw = f.read(ENVIRON_MAX)
    except (FileNotFoundError, ProcessLookupError):
        return job_identity(None, "gone", cgroup_text)
    except OSError as e:
        return job_identity(None, f"unreadable: {e.strerror}", cgroup_text)
    env = parse_environ(raw)
    return job_identity(env, "read" if env else "empty", cgroup_text)
