"""The report as text: `render_text()` words a report (store/models.py) line by line. It queries
nothing; every number and sentence it prints is a field of the report, so the text and `--json`
always carry the same content."""

from __future__ import annotations

from store.db.session import KNOWN_LAYERS
from store.models import CallFinding, CallReport, Loss, NotObserved, Session, StallReport, StepReport, as_report
from store.text import printable
from store.units import NS, ms

Report = StallReport | StepReport | CallReport | dict


def _python_lines(python: str | None, python_stack: list[str], stack: bool, indent: str) -> list[str]:
    """'at forward() at train.py:142' under a call, and with `stack` its frames, innermost first."""
    out = [f"{indent}at {python}"] if python else []
    if stack:
        out += [f"{indent}    {frame}" for frame in python_stack or []]
    return out


def _finding_lines(findings: list[CallFinding], stack: bool) -> list[str]:
    out = []
    for f in findings:
        out.append(f"  {f.utc}  {f.text}")
        out += _python_lines(f.python, f.python_stack, stack, "    ")
    return out


def _tail(observed: list[str], not_observed: list[NotObserved], loss: Loss, words: dict[str, str] | None) -> list[str]:
    """What was and was not observed (each layer worded by the report's `layer_words`, else as it always
    was), and what was lost."""
    lossy = {x.layer for x in loss.in_window}
    layers = {**KNOWN_LAYERS, **(words or {})}
    lines = ["Observed: " + (", ".join(layers.get(k, k) + (" (records lost in this window)" if k in lossy else "")
                                       for k in observed) or "nothing")]
    if not observed and len({n.why for n in not_observed}) == 1 and len(not_observed) > 1:
        lines.append(f"Not observed: any layer ({not_observed[0].why})")
    else:
        lines += [f"Not observed: {n.what} ({n.why})" for n in not_observed]
    lines += [f"Lost in this window: {x.text}" for x in loss.in_window]
    n = loss.dropped_events
    lines.append("Data loss: " + ("none" if not n else
                                  f"{n} event{'s' if n != 1 else ''} dropped in the session; by probe: "
                                  + "; ".join(f"{k}: {v}" for k, v in loss.by_probe.items())))
    return lines


def _on_cpu_lines(cpu, after_cause: bool) -> list[str]:
    """The on-CPU profile's lines of a step: its top site after a cause that leaves most of the excess
    unexplained, and every site listed when there are several."""
    if cpu is None:
        return []
    lines = [f"On the CPU: {cpu.summary.removeprefix('on the CPU ')}"] if after_cause else []
    if len(cpu.sites) > 1:
        lines.append("  CPU time by site: " + "; ".join(f"{x.text} {ms(x.dur_ns)} (usually {ms(x.usual_dur_ns)})"
                                                       for x in cpu.sites))
    return lines


def _hang_lines(r: StepReport | CallReport, stack: bool) -> list[str]:
    """Calls in flight at the stop (a stuck job): who is inside which call since when, at which line,
    and which ranks never entered a collective in flight."""
    h = r.hang
    if h is None:
        return []
    lines = [f"Hang: {h.summary}:"]
    for c in h.open_calls:
        lines.append(f"  {c.text}")
        if stack:
            lines += [f"      {f}" for f in c.python_stack]
    lines += [f"  {c.text}" for c in h.collectives]
    return lines


def _actions(next_actions: list[str]) -> list[str]:
    if not next_actions:
        return []
    return ["Recommended next actions:"] + [f"  {i}. {a}" for i, a in enumerate(next_actions, 1)]


def render_text(report: Report, stack: bool = False) -> str:
    """The report as text; `stack` adds each slow call's whole Python stack under its line."""
    r = as_report(report)
    if isinstance(r, StepReport):
        return render_step_text(r, stack)
    w, s = r.window, r.session
    lines = [
        "Stall report",
        f"Session: {s.id} on {s.host} ({s.state}), target {s.target}",
        *([f"Incident: {s.incident}"] if s.incident else []),
        *([f"Recording: {s.ended}"] if s.ended else []),
        *([f"Window kept: {s.window_kept}"] if s.window_kept else []),
        *_import_lines(s),
        *_hang_lines(r, stack),
        f"Window: {w.start_utc} -> {w.end_utc} ({w.dur_ns / NS:.1f} s)",
        f"Symptom: {r.symptom}",
    ]
    p = r.primary_cause
    if p:
        lines.append(f"Primary cause: {p.summary}")
        lines.append(f"  {p.text}")
        lines += _python_lines(r.findings[0].python, r.findings[0].python_stack, stack, "  ")
        lines.append(f"  thread {p.thread}")
    else:
        lines.append("Primary cause: none: no stall found in this window")
    lines += _device_lines(r)
    rest = r.findings[1:]
    if rest:
        lines.append(f"Other slow calls ({r.cuda.slow_calls} in the window):")
        lines += _finding_lines(rest, stack)
    if r.offcpu:
        parts = [f"{o.reason} {ms(o.dur_ns)} ({o.intervals})" for o in r.offcpu[:5]]
        lines.append("Off-CPU time of traced threads: " + ", ".join(parts))
    if r.waits:
        lines.append("Longest waits by Python line:")
        for x in r.waits:
            n = f"{x.intervals} waits, longest {ms(x.longest_dur_ns)}" if x.intervals > 1 else "1 wait"
            lines.append(f"  {ms(x.dur_ns)} {x.reason}{f' in {x.syscalls}' if x.syscalls else ''} ({n})"
                         f" at {x.python or 'no Python line'}, {x.threads}")
    if r.negatives:
        lines.append("Checked and clean: " + "; ".join(r.negatives))
    lines += _tail(r.observed_layers, r.not_observed, r.loss, r.layer_words)
    lines += _actions(r.next_actions)
    return "\n".join(map(printable, lines))


def _import_lines(s: Session) -> list[str]:
    return ([f"Imported from: {s.imported}"] if s.imported else []) + [f"Joined: {j}" for j in s.joined or []]


def _device_lines(r: StepReport | CallReport) -> list[str]:
    """The device's own timeline (an imported profiler trace): busy share per device, top kernels,
    and what the launching thread did while the device was idle."""
    g = r.gpu
    if g is None or g.busy_pct is None:
        return []
    lines = ["Device: " + ", ".join(f"device {d.device} busy {d.busy_pct}% ({ms(d.busy_ns)})" for d in g.devices or [])
             + (f"; bound by the {g.bound}" if g.bound else "")]
    if g.top_kernels:
        lines.append("  Top kernels: " + "; ".join(f"{_short(k.name)} {ms(k.dur_ns)} x{k.count} ({k.share_pct}%)"
                                                   for k in g.top_kernels))
    if g.host_idle:
        lines.append(f"  While the device was idle ({ms(g.idle_ns)}), the host was in: "
                     + "; ".join(f"{h.name} {ms(h.dur_ns)} ({h.share_pct}%)" for h in g.host_idle))
    if g.python_idle:
        lines.append("  Python lines while the device was idle: "
                     + "; ".join(f"{h.name} {ms(h.dur_ns)} ({h.share_pct}%)" for h in g.python_idle))
    return lines


def _short(name: str, limit: int = 80) -> str:
    """A C++ kernel name cut to its first `limit` characters (templates make them kilobytes long)."""
    return name if len(name) <= limit else name[:limit - 3] + "..."


def render_step_text(report: Report, stack: bool = False) -> str:
    r = as_report(report)
    assert isinstance(r, StepReport), "render_step_text takes a step report"
    w, s = r.window, r.session
    lines = ["Stall report", f"Session: {s.id} on {s.host} ({s.state}), target {s.target}"]
    if s.incident:
        lines.append(f"Incident: {s.incident}")
    if s.ended:
        lines.append(f"Recording: {s.ended}")
    if s.window_kept:
        lines.append(f"Window kept: {s.window_kept}")
    lines += _import_lines(s)
    lines.extend(_hang_lines(r, stack))
    st = r.step
    if st:
        t = st.thread
        lines.append(f"Window: {w.start_utc} -> {w.end_utc}   step {st.step} ({ms(st.dur_ns)}, median "
                     f"{ms(st.baseline_dur_ns)}){' [inferred]' if st.inferred else ''}")
        lines.append(f"Thread: {t.name} (tid {t.tid}) of {t.process} (pid {t.pid})")
        if t.job:
            lines.append(f"Job: {t.job}")
    else:
        lines.append(f"Window: {w.start_utc} -> {w.end_utc} ({w.dur_ns / NS:.1f} s)")
    lines.append(f"Symptom: {r.symptom}")
    p = r.primary_cause
    if p:
        lines.append(f"Primary cause: {p.summary}")
        if p.lineage:
            lines.append(f"Workload lineage: tag {p.lineage.tag_hex}  {p.lineage.label or '(no label)'}"
                         + (f"  checkpoint {p.lineage.checkpoint}" if p.lineage.checkpoint else ""))
        if p.python:
            lines.append(f"Python: {p.python}")
            if stack:
                lines += [f"    {f}" for f in p.python_stack or []]
        if len(p.python_lines) > 1 or (p.python_lines and p.python_lines[0].python != p.python):
            lines.append("  Time by line: " + "; ".join(f"{x.python or 'line not known'} {ms(x.dur_ns)}"
                                                         for x in p.python_lines))
        if p.kernel_path:
            lines.append("Kernel path: " + " -> ".join(p.kernel_path))
        if p.share_of_stall is not None:
            lines.append(f"Share of the stall: {100 * p.share_of_stall:.0f}% ({ms(p.excess_dur_ns)} above the "
                         "usual in the neighbouring steps)")
    elif r.stall and r.on_cpu:
        lines.append(f"Primary cause: {r.on_cpu.summary}")
    elif r.stall:
        lines.append("Primary cause: none recorded: no wait of the thread explains the step (it ran on the CPU)")
    else:
        lines.append("Primary cause: none: no stall")
    lines += _on_cpu_lines(r.on_cpu, p is not None)
    late = r.straggler
    if late:
        lines.append(f"Why rank {late.rank} (pid {late.pid}) was late: {late.summary}"
                     + (f" at {late.python}" if late.python else ""))
    if r.breakdown:
        parts = [f"{b.cause}{f' {b.detail}' if b.detail else ''} {ms(b.dur_ns)} (usually {ms(b.usual_dur_ns)})"
                 for b in r.breakdown[:6]]
        lines.append("Breakdown: " + "; ".join(parts))
    if r.launches:
        n = r.launches
        lines.append(f"Kernel launches: {n.launches:,} in the step, {n.kernels} kernels (counted exactly at their "
                     f"entries; {n.sampled} kept as samples with their stacks, durations not recorded)")
    lines += _device_lines(r)
    if r.findings:
        lines.append(f"Slow CUDA calls in the step ({len(r.findings)}):")
        lines += _finding_lines(r.findings, stack)
    if r.secondary:
        lines.append("Secondary signals: " + "; ".join(r.secondary))
    if r.negatives:
        lines.append("Checked and clean: " + "; ".join(r.negatives))
    lines += _tail(r.observed_layers, r.not_observed, r.loss, r.layer_words)
    if r.other_stalls:
        lines.append("Other stalled steps: " + ", ".join(
            f"{o.step} ({ms(o.dur_ns)}, {o.ratio}x)" for o in r.other_stalls))
    lines += _actions(r.next_actions)
    return "\n".join(map(printable, lines))
