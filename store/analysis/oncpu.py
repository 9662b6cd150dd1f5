"""Where a step's CPU time went, from the on-CPU profile (the `cpu_sample` rows of the profile layer,
through the `step_cpu_profile` view): the evidence of a stall no wait explains. A step whose excess
is on the CPU (no cause, or the cause found explains less than half of it) is put on its sites: a
library and the function the thread entered it by, and a Python line ("on the CPU for 290 ms in
cuLaunchKernel (libcuda.so.1), from train.py:142"; "in Python at model.py:88").

A site's time in the step is set against its usual time in the thread's neighbouring steps, so a
line that always takes 50 ms of every step is not what made this one slow: sites are ranked by
their time above that, and the step's time on each is stated."""

from __future__ import annotations

from store.db import Store
from store.units import ms

NEIGHBOURS = 10  # steps on each side whose time on a site is its usual time
SITES = 3  # sites listed
UNEXPLAINED_SHARE = 0.5  # the excess is on the CPU when no cause explains at least this share of it
# causes whose time may itself be on the CPU (a slow CUDA call spinning in the driver): the profile
# says where, whatever share of the excess they explain
PLACED_KINDS = ("slow_cuda_call",)


def site_text(site: dict) -> str:
    """'in cuLaunchKernel (libcuda.so.1), from train.py:142', 'in Python at model.py:88'."""
    if site["library"] is None:
        return f"in Python at {site['python']}" if site["python"] else "in code whose stack was not read"
    text = f"in {site['function'] or 'a function without a symbol'} ({site['library']})"
    return text + (f", from {site['python']}" if site["python"] else "")


def _sites(store: Store, step_mark_id: int) -> list[dict]:
    return store.query("SELECT library, function, python, python_stack_id, samples, dur, in_kernel"
                       " FROM step_cpu_profile WHERE step_mark_id = ?", (step_mark_id,))


def on_cpu(store: Store, step: dict, explained_ns: int) -> dict | None:
    """The step's time on the CPU by site, when its excess is on the CPU: `explained_ns` is the
    excess its primary cause accounts for (0 without one, or for a cause of PLACED_KINDS). None
    when the step is not slow, the excess is explained, or no sample of its thread was recorded in
    it (no profile)."""
    excess = max(step["excess_dur"] or 0, 0)
    if not step["slow"] or not excess or explained_ns >= UNEXPLAINED_SHARE * excess:
        return None
    if not store.one("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'cpu_sample'"):
        return None  # recorded before the profile
    sites = _sites(store, step["step_mark_id"])
    if not sites:
        return None
    neighbours = store.query(
        "SELECT id FROM step_mark WHERE thread_id = ? AND id != ? AND step BETWEEN ? AND ?",
        (step["thread_id"], step["step_mark_id"], step["step"] - NEIGHBOURS, step["step"] + NEIGHBOURS))
    usual: dict[tuple, int] = {}
    for n in neighbours:
        for s in _sites(store, n["id"]):
            key = (s["library"], s["function"], s["python"])
            usual[key] = usual.get(key, 0) + s["dur"]
    count = max(len(neighbours), 1)
    for s in sites:
        s["usual_dur_ns"] = usual.get((s["library"], s["function"], s["python"]), 0) // count
        s["excess_dur_ns"] = max(s["dur"] - s["usual_dur_ns"], 0)
    sites.sort(key=lambda s: (-s["excess_dur_ns"], -s["dur"]))
    top = sites[0]
    listed = [{"library": s["library"], "function": s["function"], "python": s["python"],
               "python_stack_id": s["python_stack_id"], "samples": s["samples"], "dur_ns": s["dur"],
               "usual_dur_ns": s["usual_dur_ns"], "in_kernel_samples": s["in_kernel"], "text": site_text(s)}
              for s in sites[:SITES]]
    return {
        "summary": f"on the CPU for {ms(top['dur'])} {site_text(top)}",
        "dur_ns": sum(s["dur"] for s in sites),
        "samples": sum(s["samples"] for s in sites),
        "unexplained_dur_ns": excess - min(explained_ns, excess),
        "sites": listed,
    }
