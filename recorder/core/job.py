"""A process's place in its job, read once when the recorder first sees it: rank, local rank, world
size, rendezvous, run id, Slurm job and step, Kubernetes pod. They come from the process's initial
environment (/proc/PID/environ, what the launcher gave it: torchrun, srun, the kubelet's downward
API) and its cgroup path (kubepods-...-pod<UID>.slice, .../job_<ID>/step_<ID>). A value the process
does not carry is NULL, never guessed; an environment that could not be read is said so in
`environ_status`, and so is a value its field cannot hold (any process on the node chooses its own
environment, and the recorder reads the identity of every process it meets: a value is data to
check, never one to trust).
"""

from __future__ import annotations

import re
from dataclasses import astuple, dataclass

from store.text import printable

# Bytes of /proc/PID/environ read: launchers' environments are a few KiB; a process may carry a huge
# one (up to a quarter of its stack limit), and any process on the node may start one for the
# recorder to read, so past this the rest is not read (and environ_status says so).
ENVIRON_MAX = 256 << 10
CGROUP_MAX = 64 << 10  # bytes of /proc/PID/cgroup read
RANK_MAX = 1 << 24  # ranks and world sizes past this are refused: no job is that large
TEXT_MAX = 253  # characters of a name kept (a DNS name's length)
STATUS_MAX = 1024  # characters of environ_status
CGROUP_PATH_MAX = 1024  # characters of the cgroup path kept

# column <- the variables that give it, the first present wins: torchrun's, then Slurm's. A value
# that is present but not what the field can hold leaves the column NULL and says why in
# environ_status; it is never replaced by the next variable's (that would mix two sources).
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
_SLURM_JOB = ("SLURM_JOB_ID", "SLURM_JOBID")
_SLURM_STEP = ("SLURM_STEP_ID", "SLURM_STEPID")
# the text fields and what each may hold (ASCII only: the values are names a launcher wrote)
_UUID = r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}"
_TEXTS: dict[str, tuple[tuple[str, ...], str, str]] = {
    "master_addr": (("MASTER_ADDR",), r"[A-Za-z0-9._:%\[\]-]{1,253}", "a host name or address"),
    "run_id": (("TORCHELASTIC_RUN_ID",), r"[\x21-\x7e]{1,128}", "1 to 128 printable ASCII characters"),
    "slurm_job_id": (_SLURM_JOB, r"[0-9]{1,10}", "a job number"),
    "slurm_step_id": (_SLURM_STEP, r"[A-Za-z0-9_.]{1,32}", "a step number or name"),
    "pod_uid": (_POD_UID, _UUID, "a UID"),
    "pod_namespace": (_POD_NAMESPACE, r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?", "a Kubernetes namespace"),
    "pod_name": (_POD_NAME, r"[a-z0-9]([a-z0-9.-]{0,251}[a-z0-9])?", "a Kubernetes object name"),
}
_WANTED = sorted({"MASTER_PORT", *(n for names in _INTEGERS.values() for n in names),
                  *(n for names, _, _ in _TEXTS.values() for n in names)}, key=len, reverse=True)
# one pass over the raw environment for just the variables above (a variable starts after a NUL;
# one is put in front of the first): a Python loop over every variable costs ten times as much
_VARIABLE = re.compile(rb"\0(" + b"|".join(n.encode() for n in _WANTED) + rb")=([^\0]*)")
# kubepods-burstable-pod1a2b3c4d_....slice (systemd driver), /kubepods/burstable/pod1a2b3c4d-.../ (cgroupfs)
_KUBEPODS_UID = re.compile(r"kubepods.*?pod([0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12})",
                           re.ASCII)
# /slurm/uid_1000/job_4711/step_0 (cgroup v1), /system.slice/slurmstepd.scope/job_4711/step_batch (v2)
_SLURM = re.compile(r"/job_([0-9]{1,10})(?:/step_([A-Za-z0-9_.]{1,32}))?(?![A-Za-z0-9_.])")

JOB_COLUMNS = ("environ_status", "job_rank", "job_local_rank", "job_world_size", "master_addr", "run_id",
               "slurm_job_id", "slurm_step_id", "pod_uid", "pod_namespace", "pod_name", "cgroup")


@dataclass(frozen=True)
class JobIdentity:
    """The columns JOB_COLUMNS of a `process` row (store/migrations/0020_process_job.sql)."""

    # 'read', 'empty', or why it was not: 'unreadable: Permission denied', 'gone'; after 'read', what
    # was not taken of it: '; RANK unreadable: ...' for a value its field cannot hold, '; truncated: ...'
    environ_status: str
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
    """The variables of a raw environment (NUL-separated NAME=VALUE) that carry a job identity."""
    return {m.group(1).decode(): m.group(2).decode("utf-8", "replace") for m in _VARIABLE.finditer(b"\0" + raw)}


class _Reader:
    """Takes the identity's values from an environment one field at a time, keeping why a value
    present was refused."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env = env
        self.refused: list[str] = []

    def first(self, names: tuple[str, ...]) -> tuple[str, str] | None:
        for name in names:
            value = self.env.get(name, "").strip()
            if value:
                return name, value
        return None

    def _refuse(self, name: str, value: str, why: str) -> None:
        self.refused.append(f"{name} unreadable: '{printable(value, 40)}' is not {why}")

    def integer(self, names: tuple[str, ...], low: int) -> int | None:
        found = self.first(names)
        if found is None:
            return None
        name, value = found
        # ASCII digits only: str.isdigit() also takes '²', which int() refuses
        if re.fullmatch(r"[0-9]{1,9}", value) and low <= int(value) <= RANK_MAX:
            return int(value)
        self._refuse(name, value, f"an integer from {low} to {RANK_MAX}")
        return None

    def text(self, column: str) -> str | None:
        names, pattern, what = _TEXTS[column]
        found = self.first(names)
        if found is None:
            return None
        name, value = found
        if re.fullmatch(pattern, value):
            return value
        self._refuse(name, value, what)
        return None

    def port(self) -> str | None:
        found = self.first(("MASTER_PORT",))
        if found is None:
            return None
        if re.fullmatch(r"[0-9]{1,5}", found[1]) and 0 < int(found[1]) < 65536:
            return found[1]
        self._refuse(*found, "a port number")
        return None


def job_identity(env: dict[str, str] | None, environ_status: str, cgroup_text: str) -> JobIdentity:
    """The identity from an environment (None when unreadable) and a /proc/PID/cgroup text. Each
    value is checked against what its field holds (ASCII digits in range, names of a known
    alphabet and length); one that is not is left NULL and said in environ_status."""
    read = _Reader(env or {})
    ints = {column: read.integer(names, 1 if column == "job_world_size" else 0) for column, names in _INTEGERS.items()}
    texts = {column: read.text(column) for column in _TEXTS}
    master, port = texts.pop("master_addr"), read.port()
    if master and port:
        master += ":" + port
    lines = cgroup_text.splitlines()
    v2 = next((line[3:] for line in lines if line.startswith("0::")), None)
    if texts["pod_uid"] is None or texts["slurm_job_id"] is None:
        for line in lines:
            path = line.split(":", 2)[-1]
            if texts["pod_uid"] is None and (m := _KUBEPODS_UID.search(path)):
                texts["pod_uid"] = m.group(1).replace("_", "-")
            if texts["slurm_job_id"] is None and (m := _SLURM.search(path)):
                texts["slurm_job_id"], texts["slurm_step_id"] = m.group(1), texts["slurm_step_id"] or m.group(2)
    status = printable("; ".join([environ_status, *read.refused]), STATUS_MAX)
    cgroup = None if v2 is None else printable(v2, CGROUP_PATH_MAX)
    return JobIdentity(status, ints["job_rank"], ints["job_local_rank"], ints["job_world_size"], master,
                       texts["run_id"], texts["slurm_job_id"], texts["slurm_step_id"], texts["pod_uid"],
                       texts["pod_namespace"], texts["pod_name"], cgroup)


def read_job_identity(pid: int) -> JobIdentity:
    """What /proc says of the job of `pid` now (root reads any process's environment), each file
    read up to its cap."""
    try:
        with open(f"/proc/{pid}/cgroup", "rb") as f:
            cgroup_text = f.read(CGROUP_MAX).decode("utf-8", "replace")
    except OSError:
        cgroup_text = ""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            raw = f.read(ENVIRON_MAX + 1)
    except (FileNotFoundError, ProcessLookupError):
        return job_identity(None, "gone", cgroup_text)
    except OSError as e:
        return job_identity(None, f"unreadable: {e.strerror}", cgroup_text)
    status = "read" if raw.strip(b"\0") else "empty"
    if len(raw) > ENVIRON_MAX:  # the variable the cap cuts is dropped whole (RANK=12 is not RANK=1)
        raw = raw[: raw.rfind(b"\0", 0, ENVIRON_MAX) + 1]
        status += f"; truncated: variables past its first {ENVIRON_MAX} bytes not read"
    return job_identity(parse_environ(raw), status, cgroup_text)
