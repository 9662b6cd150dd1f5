"""The report as text: `render_text()` words a report (store/analysis.py) line by line. It queries
nothing; every number and sentence it prints is a field of the report, so the text and `--json`
always carry the same content."""

from __future__ import annotations

from store.session import LAYERS, STEP_LAYERS
from store.units import NS, ms


def _python_lines(finding: dict, stack: bool, indent: str) -> list[str]:
    """'at forward() at train.py:142' under a call, and with `stack` its frames, innermost first."""
    out = [f"{indent}at {finding['python']}"] if finding.get("python") else []
    if stack:
        out += [f"{indent}    {frame}" for frame in finding.get("python_stack") or []]
    return out


def render_text(report: dict, stack: bool = False) -> str:
    """The report as text; `stack` adds each slow call's whole Python stack under its line."""
    if report.get("mode") == "step":
        return render_step_text(report, stack)
    w = report["window"]
    s = report["session"]
    lines = [
        "Stall report",
        f"Session: {s['id']} on {s['host']} ({s['state']}), target {s['target']}",
        f"Window: {w['start_utc']} -> {w['end_utc']} ({w['dur_ns'] / NS:.1f} s)",
        f"Symptom: {report['symptom']}",
    ]
    p = report["primary_cause"]
    if p:
        lines.append(f"Primary cause: {p['summary']}")
        lines.append(f"  {p['text']}")
        lines += _python_lines(report["findings"][0], stack, "  ")
        lines.append(f"  thread {p['thread']}")
    else:
        lines.append("Primary cause: none: no stall found in this window")
    rest = report["findings"][1:]
    if rest:
        lines.append(f"Other slow calls ({report['cuda']['slow_calls']} in the window):")
        for f in rest:
            lines.append(f"  {f['utc']}  {f['text']}")
            lines += _python_lines(f, stack, "    ")
    if report["offcpu"]:
        parts = [f"{r['reason']} {ms(r['dur_ns'])} ({r['intervals']})" for r in report["offcpu"][:5]]
        lines.append("Off-CPU time of traced threads: " + ", ".join(parts))
    if report["negatives"]:
        lines.append("Checked and clean: " + "; ".join(report["negatives"]))
    lines.append("Observed: " + (", ".join(LAYERS[k] for k in report["observed_layers"]) or "nothing"))
    for n in report["not_observed"]:
        lines.append(f"Not observed: {n['what']} ({n['why']})")
    loss = report["loss"]
    lines.append("Data loss: " + ("none" if not loss["dropped_events"] else
                                  f"{loss['dropped_events']} events dropped "
                                  + ", ".join(f"{k}: {v}" for k, v in loss["by_probe"].items())))
    if report["next_actions"]:
        lines.append("Recommended next actions:")
        lines += [f"  {i}. {a}" for i, a in enumerate(report["next_actions"], 1)]
    return "\n".join(lines)



def render_step_text(report: dict, stack: bool = False) -> str:
    w = report["window"]
    s = report["session"]
    lines = ["Stall report", f"Session: {s['id']} on {s['host']} ({s['state']}), target {s['target']}"]
    st = report["step"]
    where = ""
    if st:
        t = st["thread"]
        where = (f"   step {st['step']} ({ms(st['dur_ns'])}, median {ms(st['baseline_dur_ns'])})"
                 f"{' [inferred]' if st['inferred'] else ''}")
        lines.append(f"Window: {w['start_utc']} -> {w['end_utc']}{where}")
        lines.append(f"Thread: {t['name']} (tid {t['tid']}) of {t['process']} (pid {t['pid']})")
    else:
        lines.append(f"Window: {w['start_utc']} -> {w['end_utc']} ({w['dur_ns'] / NS:.1f} s)")
    lines.append(f"Symptom: {report['symptom']}")
    p = report["primary_cause"]
    if p:
        lines.append(f"Primary cause: {p['summary']}")
        lineage = p.get("lineage")
        if lineage:
            lines.append(f"Workload lineage: tag {lineage['tag_hex']}  {lineage['label'] or '(no label)'}"
                         + (f"  checkpoint {lineage['checkpoint']}" if lineage.get("checkpoint") else ""))
        if p.get("python"):
            lines.append(f"Python: {p['python']}")
            if stack:
                lines += [f"    {f}" for f in p.get("python_stack") or []]
        if p.get("kernel_path"):
            lines.append("Kernel path: " + " -> ".join(p["kernel_path"]))
        lines.append(f"Share of the stall: {100 * p['share_of_stall']:.0f}% ({ms(p['excess_dur_ns'])} above the "
                     "usual in the neighbouring steps)")
    elif report["stall"]:
        lines.append("Primary cause: none recorded: no wait of the thread explains the step (it ran on the CPU)")
    else:
        lines.append("Primary cause: none: no stall")
    late = report.get("straggler")
    if late:
        lines.append(f"Why rank {late['rank']} (pid {late['pid']}) was late: {late['summary']}"
                     + (f" at {late['python']}" if late.get("python") else ""))
    if report.get("breakdown"):
        parts = []
        for r in report["breakdown"][:6]:
            label = r["cause"] + (f" {r['detail']}" if r["detail"] else "")
            parts.append(f"{label} {ms(r['dur_ns'])} (usually {ms(r['usual_dur_ns'])})")
        lines.append("Breakdown: " + "; ".join(parts))
    if report.get("findings"):
        lines.append(f"Slow CUDA calls in the step ({len(report['findings'])}):")
        for f in report["findings"]:
            lines.append(f"  {f['utc']}  {f['text']}")
            lines += _python_lines(f, stack, "    ")
    if report.get("secondary"):
        lines.append("Secondary signals: " + "; ".join(report["secondary"]))
    if report["negatives"]:
        lines.append("Checked and clean: " + "; ".join(report["negatives"]))
    lines.append("Observed: " + (", ".join(STEP_LAYERS[k] for k in report["observed_layers"]) or "nothing"))
    for n in report["not_observed"]:
        lines.append(f"Not observed: {n['what']} ({n['why']})")
    loss = report["loss"]
    lines.append("Data loss: " + ("none" if not loss["dropped_events"] else
                                  f"{loss['dropped_events']} events dropped "
                                  + ", ".join(f"{k}: {v}" for k, v in loss["by_probe"].items())))
    if report.get("other_stalls"):
        lines.append("Other stalled steps: " + ", ".join(
            f"{o['step']} ({ms(o['dur_ns'])}, {o['ratio']}x)" for o in report["other_stalls"]))
    if report["next_actions"]:
        lines.append("Recommended next actions:")
        lines += [f"  {i}. {a}" for i, a in enumerate(report["next_actions"], 1)]
    return "\n".join(lines)
