"""CPU: the step's thread was runnable and waited for a CPU (step_cause 'cpu_wait', one row per task
that held it): cpu_contention, with every contender, and next actions that depend on who they were
(another task, threads of the thread's own process, a helper or a worker of the job, the recorder)."""

from __future__ import annotations

from store.analysis.jobs import forked_copy, thread_names
from store.analysis.kinds.family import Facts, Family, Kind, RuleContext
from store.units import ms

# a process of the job by these names is a data-loader worker (PyTorch names its workers' main thread
# so); one by the training process's own name, or with its command line (forked_copy), is a forked
# copy of it, which a worker also is
WORKER_NAMES = ("pt_data_worker",)


def candidates(ctx: RuleContext) -> list[dict]:
    waits = [r for r in ctx.rows if r["cause"] == "cpu_wait"]
    if not waits:
        return []
    # every task that held the CPU counts: three copies of a hog split the wait between them
    contenders = ctx.store.query(
        "SELECT contender_name, contender_relation, group_concat(DISTINCT contender_pid) AS pids,"
        " count(DISTINCT contender_pid) AS n, count(DISTINCT contender_tid) AS threads,"
        " group_concat(DISTINCT contender_tid) AS tids, min(contender_tid) AS contender_tid,"
        " min(contender_pid) AS contender_pid, group_concat(DISTINCT contended_cpu) AS cpus,"
        " sum(reason = 'preempted') AS preemptions, sum(reason != 'preempted') AS delayed_wakeups,"
        " sum(runq_dur) AS dur, min(ts) AS first_ts FROM step_offcpu WHERE step_mark_id = ? AND runq_dur > 0"
        " AND contender_name IS NOT NULL GROUP BY contender_name, contender_relation ORDER BY dur DESC",
        (ctx.step["step_mark_id"],))
    return [{"dur_ns": sum(r["dur_ns"] for r in waits), "excess_dur_ns": sum(r["excess_dur_ns"] for r in waits),
             "detail": None, "kind": "cpu_contention", "contender": contenders[0] if contenders else None,
             "contenders": contenders}]


def _who(c: dict) -> str:
    if not c["n"]:  # its threads' processes were not found (gone before they were read)
        pids = f"tid {c['tids']}" if c.get("tids") else "process not known"
    else:
        pids = f"pid {c['pids']}" if c["n"] == 1 else f"{c['n']} processes: pids {c['pids']}"
    threads = f"{c['threads']} threads" if c["threads"] > 1 else "a thread"
    pids += {"same_process": f", {threads} of its own process",
             "job": ", a process of the recorded job",
             "recorder": ", the recorder itself"}.get(c["contender_relation"], "")
    return f"{c['contender_name']} ({pids}; {ms(c['dur'])})"


def cpu_contention(f: Facts) -> None:
    top = f.cand.get("contender") or {}
    everyone = f.cand.get("contenders") or []
    facts = f.facts
    facts.update(contender_pid=top.get("contender_pid"), contender_name=top.get("contender_name"),
                 contender_relation=top.get("contender_relation"),
                 cpus=top.get("cpus"), preemptions=sum(c["preemptions"] or 0 for c in everyone),
                 contenders=[{"name": c["contender_name"], "relation": c["contender_relation"],
                              "pids": c["pids"], "cpus": c["cpus"],
                              "cpu_wait_dur_ns": c["dur"], "preemptions": c["preemptions"],
                              "delayed_wakeups": c["delayed_wakeups"]} for c in everyone])
    pre = facts["preemptions"]
    named = ", then ".join(_who(c) for c in everyone[:2]) or "tasks not recorded"
    facts["summary"] = (f"CPU contention: the thread waited {ms(f.dur)} for the CPU, behind {named} "
                        f"on cpu {top.get('cpus')}" + (f", preempted {pre} times" if pre else ""))
    f.path = [f"runnable on cpu {top.get('cpus')}", f"{top.get('contender_name')} ran instead"]
    names = thread_names(f.store, f.step["thread_id"])
    f.context.update(tid=names.get("tid"), thread_name=names.get("thread_name"),
                     cpu_count=(f.store.one("SELECT cpu_count FROM session WHERE id = ?", (f.step["session_id"],))
                                or {}).get("cpu_count", "?"))
    if facts.get("contender_pid") is None:  # its process was not read
        f.context["contender_tid_only"] = top.get("contender_tid")
    # contention from the job's own threads and processes, or from the recorder, is fixed elsewhere
    # than contention from another task
    if facts.get("contender_relation"):
        f.actions_of = f"cpu_contention_{facts['contender_relation']}"
    workers = (*WORKER_NAMES, names.get("process_name"))
    if f.actions_of == "cpu_contention_job" and (facts.get("contender_name") in workers or forked_copy(
            f.store, f.step["session_id"], facts.get("contender_pid"), names.get("pid"))):
        f.actions_of = "cpu_contention_job_worker"


FAMILY = Family(
    name="cpu",
    kinds=(Kind("cpu_contention", cpu_contention, lost_time=("cpu_wait", None), own_stack=True),),
    whole=candidates,
    actions={
        "cpu_contention": [
            ("See what {contender_name} (pid {contender_pid}) is and why it runs there: "
             "ps -o pid,psr,pcpu,cmd -p {contender_pid}", "contender_pid"),
            ("Keep it off the training threads' CPUs: an exclusive cpuset for the job, "
             "or taskset -cp <other cpus> {contender_pid}", "contender_pid"),
            # a contender whose process was not read (it was gone): only its thread is known
            ("Find the process of {contender_name} (thread {contender_tid_only}) if it still runs: "
             "grep Tgid /proc/{contender_tid_only}/status; then keep it off the training threads' CPUs",
             "contender_tid_only"),
            "Check that thread {tid} ({thread_name}) is pinned where you expect: taskset -cp {tid}",
        ],
        "cpu_contention_same_process": [
            "The training thread waited behind {contender_name}, threads of its own process: more runnable "
            "threads than CPUs ({cpu_count} online). Lower the intra-op threads (torch.set_num_threads, "
            "OMP_NUM_THREADS, MKL_NUM_THREADS) so that they and the data loader's workers fit the CPUs",
            "See the process's threads and where they ran: ps -L -o tid,psr,pcpu,comm -p {contender_pid}",
            "Check that thread {tid} ({thread_name}) is pinned where you expect: taskset -cp {tid}",
        ],
        # a process the job started that is not a copy of the training process (a helper: a compiler,
        # an evaluation script, a shell command)
        "cpu_contention_job": [
            "The training thread waited behind {contender_name} (pid {contender_pid}), a helper process the "
            "recorded job started itself, not a foreign task",
            "Run {contender_name} on CPUs other than the training threads' (taskset -cp <other cpus> "
            "{contender_pid}), at a lower priority (nice -n 10), or outside the training loop",
            "Check that thread {tid} ({thread_name}) is pinned where you expect: taskset -cp {tid}",
        ],
        # a process of the job with the training process's own name or command line (a forked worker)
        # or a DataLoader worker's name (pt_data_worker)
        "cpu_contention_job_worker": [
            "The training thread waited behind {contender_name} (pid {contender_pid}), a worker process of the "
            "recorded job itself (a forked copy of the training process: a data-loader worker), not a foreign "
            "task",
            "Give the job's processes fewer CPUs than they compete for: fewer DataLoader workers (num_workers), "
            "or pin the workers to CPUs other than the training threads' (taskset -cp <other cpus> "
            "{contender_pid}; worker_init_fn)",
            "Check that thread {tid} ({thread_name}) is pinned where you expect: taskset -cp {tid}",
        ],
        "cpu_contention_recorder": [
            "The recorder itself (pid {contender_pid}) took the CPU from the training thread: run it on CPUs the "
            "job does not use (taskset -c <other cpus> recorder ...), as its own cost should never be a cause",
            "Measure what it costs on this job: benchmarks/bench_training_job.py; and report the figures",
        ],
    },
)
