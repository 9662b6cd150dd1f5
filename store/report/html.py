"""`recorder report --html FILE`: the stall report as one self-contained page with plots.

The page holds the text report (`store.report.build.explain` + `render_text`, the same content as
`recorder explain`), the step durations against their rolling baseline with the stalls marked, the
stalled step's breakdown by cause, per-device block latency percentiles and the stalled step's
timeline across layers (steps, CUDA, NCCL, off-CPU, block requests, kernel events), with the
report's JSON at the end.

Plots are drawn by matplotlib as inline SVG: no JavaScript and nothing fetched, so the file opens
offline, in a mail attachment or an air-gapped incident folder, and reads the same in any browser.
"""

from __future__ import annotations

import html
import io
import json
import os
import re
import shlex
from pathlib import Path

from store.db import Store
from store.errors import UserError
from store.report.build import explain, ms, render_text, session_row

STALL = "#d62728"       # stalls, slow rows
BASE = "#1f77b4"        # ordinary steps
BASELINE = "#ff7f0e"    # the rolling median
LAYER_COLOURS = {"step": "#9e9e9e", "stall": STALL, "cuda": "#2ca02c", "nccl": "#9467bd", "sched": "#8c564b",
                 "block": BASE, "queued": "#aec7e8", "device": "#ff9896", "memory": "#e377c2",
                 "gpu": "#17becf"}
OFFCPU_COLOURS = {"preempted": "#d62728", "io": "#1f77b4", "uninterruptible": "#17becf", "futex": "#bcbd22",
                  "sleep": "#c7c7c7", "poll": "#7f7f7f", "net": "#e377c2"}
MAX_TIMELINE_ROWS = 5000  # per layer in the timeline plot: beyond that a timeline tool reads better
MAX_STALL_ROWS = 30  # stalls in the page's table, worst first (each is a step report of its own)


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # names come from the traced machine (any user names a process 'p$^$'): text, never mathtext
    plt.rcParams.update({"svg.fonttype": "none", "svg.hashsalt": "stall-recorder", "font.size": 9,
                         "text.parse_math": False})
    return plt


def _svg(fig) -> str:
    """The figure as an <svg> element to inline: no XML prolog, doctype or metadata block."""
    buf = io.StringIO()
    fig.savefig(buf, format="svg", bbox_inches="tight", metadata={"Date": None, "Creator": None})
    _plt().close(fig)
    text = buf.getvalue()
    text = text[text.index("<svg"):]
    return re.sub(r"<metadata>.*?</metadata>", "", text, flags=re.S)


# -- the plots ------------------------------------------------------------------------------------
def step_plot(store: Store, sid: int, chosen: int | None) -> str | None:
    rows = store.query("SELECT thread_id, step, dur, baseline_dur, slow FROM step_baseline"
                       " WHERE session_id = ? ORDER BY ts", (sid,))
    if not rows:
        return None
    plt = _plt()
    threads = sorted({r["thread_id"] for r in rows})
    fig, axes = plt.subplots(len(threads), 1, figsize=(11, 2.6 * len(threads)), squeeze=False,
                             constrained_layout=True)
    for ax, tid in zip(axes[:, 0], threads, strict=True):
        rs = [r for r in rows if r["thread_id"] == tid]
        name = store.row("SELECT thread_name, pid, tid FROM thread_info WHERE thread_id = ?", (tid,))
        x = [r["step"] for r in rs]
        ax.plot(x, [r["dur"] / 1e6 for r in rs], "o-", ms=3, lw=1, color=BASE, label="step duration")
        ax.plot(x, [(r["baseline_dur"] or 0) / 1e6 for r in rs], "--", lw=1.2, color=BASELINE,
                label="baseline (rolling median)")
        slow = [r for r in rs if r["slow"]]
        ax.scatter([r["step"] for r in slow], [r["dur"] / 1e6 for r in slow], s=60, color=STALL, zorder=3,
                   label="stall")
        for r in slow:
            if r["step"] == chosen:
                ax.annotate(f"step {r['step']}: {ms(r['dur'])}", (r["step"], r["dur"] / 1e6),
                            textcoords="offset points", xytext=(8, -4), color=STALL)
        ax.set_ylabel("ms")
        ax.set_title(f"steps of {name['thread_name']} (pid {name['pid']}, tid {name['tid']})", loc="left")
        ax.grid(alpha=0.3)
        ax.legend(loc="upper left", fontsize=8)
    axes[-1, 0].set_xlabel("step")
    return _svg(fig)


def breakdown_plot(report: dict) -> str | None:
    rows = report.get("breakdown") or []
    if not rows:
        return None
    plt = _plt()
    rows = rows[:12]
    labels = [f"{r['cause']}: {r['detail']}" for r in rows][::-1]
    fig, ax = plt.subplots(figsize=(11, 0.45 * len(rows) + 1.2))
    y = range(len(rows))
    ax.barh([i + 0.2 for i in y], [r["dur_ns"] / 1e6 for r in rows][::-1], height=0.4, color=STALL,
            label=f"step {report['step']['step']}")
    ax.barh([i - 0.2 for i in y], [(r.get("usual_dur_ns") or 0) / 1e6 for r in rows][::-1], height=0.4,
            color=BASE, label="usual (neighbouring steps)")
    ax.set_yticks(list(y), labels)
    ax.set_xlabel("ms of the step's thread")
    ax.grid(axis="x", alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    return _svg(fig)


def latency_plot(store: Store, sid: int) -> tuple[str | None, list[dict]]:
    rows = store.query("SELECT device, op, requests, p50_dur, p99_dur, p999_dur, max_dur FROM block_latency"
                       " WHERE session_id = ? ORDER BY device, op", (sid,))
    if not rows:
        return None, rows
    plt = _plt()
    fig, ax = plt.subplots(figsize=(11, 0.5 * len(rows) * 4 / 3 + 1.2))
    labels = [f"{r['device'] or '?'} {r['op']} ({r['requests']})" for r in rows]
    marks = (("p50_dur", "p50", BASE, "o"), ("p99_dur", "p99", BASELINE, "s"), ("p999_dur", "p99.9", "#9467bd", "D"),
             ("max_dur", "max", STALL, "x"))
    for col, label, colour, marker in marks:
        ax.scatter([(r[col] or 0) / 1e6 for r in rows], range(len(rows)), color=colour, marker=marker, label=label,
                   zorder=3)
    for i, r in enumerate(rows):
        ax.plot([(r["p50_dur"] or 0) / 1e6, (r["max_dur"] or 0) / 1e6], [i, i], color="#c7c7c7", zorder=1)
    ax.set_yticks(range(len(rows)), labels)
    ax.set_xscale("log")
    from matplotlib.ticker import FuncFormatter

    plain = FuncFormatter(lambda v, _: f"{v:g}")  # 2.5, 100, 3400 rather than 10^0.4
    ax.xaxis.set_major_formatter(plain)
    ax.xaxis.set_minor_formatter(plain if ax.get_xlim()[1] / max(ax.get_xlim()[0], 1e-9) < 100 else FuncFormatter(
        lambda v, _: ""))
    ax.set_xlabel("request latency, ms (log scale)")
    ax.grid(axis="x", alpha=0.3, which="both")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8)
    return _svg(fig), rows


def timeline_plot(store: Store, sid: int, a: int, b: int, threads: list[tuple[int | None, str]]) -> str | None:
    """One row per layer: per thread (of `threads`; None = every thread) for the CPU-side layers,
    per disk for block requests, and the kernel log's device lines."""
    lanes: list[tuple[str, list[tuple[int, int, str]]]] = []   # (label, [(ts, dur, colour)])
    marks: list[tuple[int, str]] = []
    w: dict = {"s": sid, "a": a, "b": b}

    def lane(label: str, sql: str, colour) -> None:
        rows = store.query(f"{sql} LIMIT {MAX_TIMELINE_ROWS}", w)
        if rows:
            lanes.append((label, [(max(r["ts"], a), min(r["ts"] + r["dur"], b) - max(r["ts"], a),
                                   colour(r) if callable(colour) else colour) for r in rows]))

    for thread_id, who in threads:
        w["t"] = thread_id
        same = "thread_id = :t" if thread_id is not None else "1"
        pre = f"{who}: " if who else ""
        lane(f"{pre}steps", f"SELECT ts, dur, slow FROM step_baseline WHERE session_id = :s AND {same}"
                            " AND ts < :b AND ts + dur > :a", lambda r: STALL if r["slow"] else LAYER_COLOURS["step"])
        lane(f"{pre}CUDA calls", f"SELECT ts, dur FROM cuda_call WHERE session_id = :s AND {same} AND ts < :b"
                                 " AND ts + dur > :a", LAYER_COLOURS["cuda"])
        lane(f"{pre}NCCL calls", f"SELECT ts, dur FROM nccl_call WHERE session_id = :s AND {same} AND ts < :b"
                                 " AND ts + dur > :a", LAYER_COLOURS["nccl"])
        lane(f"{pre}off-CPU", f"SELECT ts, dur, reason FROM offcpu WHERE session_id = :s AND {same} AND ts < :b"
                              " AND ts + dur > :a", lambda r: OFFCPU_COLOURS.get(r["reason"], "#7f7f7f"))
        lane(f"{pre}reclaim", f"SELECT ts, dur FROM reclaim_interval WHERE session_id = :s AND {same} AND ts < :b"
                              " AND ts + dur > :a", LAYER_COLOURS["memory"])
    for (disk,) in [tuple(r.values()) for r in store.query(
            "SELECT DISTINCT device FROM block_request WHERE session_id = :s AND ts < :b AND ts + dur > :a", w)]:
        w["d"] = disk
        lane(f"{disk} queued", "SELECT ts, coalesce(queued_dur, 0) AS dur FROM block_request WHERE session_id = :s"
             " AND device IS :d AND ts < :b AND ts + dur > :a", LAYER_COLOURS["queued"])
        lane(f"{disk} on device", "SELECT coalesce(issue_ts, ts) AS ts, coalesce(device_dur, dur) AS dur"
             " FROM block_request WHERE session_id = :s AND device IS :d AND ts < :b AND ts + dur > :a",
             LAYER_COLOURS["device"])
    for (dev,) in [tuple(r.values()) for r in store.query(
            "SELECT DISTINCT device FROM device_activity WHERE session_id = :s AND ts < :b AND ts + dur > :a"
            " AND kind IN ('kernel', 'memcpy', 'memset') ORDER BY device", w)]:
        w["g"] = dev  # an imported profiler trace: the device's own timeline
        lane(f"device {dev} kernels", "SELECT ts, dur FROM device_activity WHERE session_id = :s AND device = :g"
             " AND kind = 'kernel' AND ts < :b AND ts + dur > :a ORDER BY ts", LAYER_COLOURS["gpu"])
        lane(f"device {dev} copies, memsets", "SELECT ts, dur FROM device_activity WHERE session_id = :s"
             " AND device = :g AND kind IN ('memcpy', 'memset') AND ts < :b AND ts + dur > :a ORDER BY ts",
             LAYER_COLOURS["device"])
    gpus = _gpu_lanes(store, sid, a, b)
    for r in store.query("SELECT ts, coalesce(event_kind, subsystem, 'kernel log') AS kind FROM kernel_log"
                         " WHERE session_id = :s AND ts BETWEEN :a AND :b AND subsystem IS NOT NULL", w):
        marks.append((r["ts"], r["kind"]))
    if not lanes and not marks and not gpus:
        return None
    plt = _plt()
    n = len(gpus) + len(lanes) + (1 if marks else 0)
    fig, ax = plt.subplots(figsize=(11, 0.42 * n + 1.3))
    for i, (_, points) in enumerate(gpus):  # utilisation 0-100% drawn across the lane's height
        y = n - 1 - i
        xs = [(ts - a) / 1e6 for ts, _ in points]
        ys = [y - 0.4 + 0.8 * u / 100 for _, u in points]
        ax.fill_between(xs, y - 0.4, ys, step="post", color=LAYER_COLOURS["gpu"], alpha=0.35, linewidth=0)
        ax.step(xs, ys, where="post", color=LAYER_COLOURS["gpu"], lw=1)
        ax.axhline(y - 0.4, color="#c7c7c7", lw=0.5)
    for i, (_, spans) in enumerate(lanes):
        y = n - 1 - len(gpus) - i
        ax.broken_barh([((ts - a) / 1e6, max(d, 1) / 1e6) for ts, d, _ in spans], (y - 0.35, 0.7),
                       facecolors=[c for _, _, c in spans], edgecolor="none")
    labels = [label for label, _ in gpus] + [label for label, _ in lanes]
    if marks:
        ax.scatter([(ts - a) / 1e6 for ts, _ in marks], [0] * len(marks), marker="v", s=70, color=STALL, zorder=3)
        for ts, kind in marks[:8]:
            ax.annotate(kind.split(".")[-1], ((ts - a) / 1e6, 0), textcoords="offset points", xytext=(4, 6),
                        fontsize=7, color=STALL)
        labels.append("kernel log")
    ax.set_yticks(range(n), labels[::-1])
    ax.set_xlim(0, (b - a) / 1e6)
    ax.set_ylim(-0.6, n - 0.4)
    ax.set_xlabel("ms from the start of the window")
    ax.grid(axis="x", alpha=0.3)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in OFFCPU_COLOURS.values()]
    ax.legend(handles, [f"off-CPU: {k}" for k in OFFCPU_COLOURS], loc="upper center", bbox_to_anchor=(0.5, -0.18),
              ncol=7, fontsize=7, frameon=False)
    return _svg(fig)


def _gpu_lanes(store: Store, sid: int, a: int, b: int) -> list[tuple[str, list[tuple[int, int]]]]:
    """Per GPU, its utilisation samples (gpu_sample, NVML) over [a, b], with the last one before a
    so that the line starts at the window's left edge."""
    out = []
    for g in store.query("SELECT DISTINCT gpu_index FROM gpu_sample WHERE session_id = ? AND ts BETWEEN ? AND ?"
                         " AND util_gpu IS NOT NULL ORDER BY gpu_index", (sid, a, b)):
        rows = store.query(
            "SELECT * FROM (SELECT ts, util_gpu FROM gpu_sample WHERE session_id = :s AND gpu_index = :g"
            " AND ts < :a AND util_gpu IS NOT NULL ORDER BY ts DESC LIMIT 1) UNION ALL"
            " SELECT ts, util_gpu FROM gpu_sample WHERE session_id = :s AND gpu_index = :g AND ts BETWEEN :a AND :b"
            f" AND util_gpu IS NOT NULL ORDER BY ts LIMIT {MAX_TIMELINE_ROWS}",
            {"s": sid, "g": g["gpu_index"], "a": a, "b": b})
        points = [(max(r["ts"], a), r["util_gpu"]) for r in rows]
        points.append((b, points[-1][1]))
        out.append((f"GPU {g['gpu_index']} utilisation", points))
    return out


def first_event_ts(store: Store, sid: int, a: int, b: int) -> int | None:
    """ns of the first event recorded in [a, b) on the timeline's layers (steps, CUDA and NCCL calls,
    off-CPU intervals, block requests, GPU samples), through the (thread_id, ts) indexes; None if none."""
    per_thread = " ".join(
        f"UNION ALL SELECT (SELECT min(x.ts) FROM {table} x WHERE x.thread_id = t.id AND x.ts >= :a AND x.ts < :b)"
        " FROM thread t WHERE t.session_id = :s"
        for table in ("cuda_call", "nccl_call", "offcpu_interval", "block_request", "reclaim_interval"))
    row = store.one(
        "SELECT min(ts) AS ts FROM (SELECT min(ts) AS ts FROM step_mark WHERE session_id = :s AND ts >= :a AND ts < :b"
        " UNION ALL SELECT min(ts) FROM gpu_sample WHERE session_id = :s AND ts >= :a AND ts < :b"
        f" {per_thread})", {"s": sid, "a": a, "b": b})
    return row["ts"] if row else None


def stall_rows(store: Store, sid: int, a: int, b: int, limit: int = MAX_STALL_ROWS) -> tuple[list[dict], int]:
    """The stalled steps starting in [a, b), worst first, each with its primary cause and Python
    line (the report of that step): at most `limit`, and how many there are in all."""
    from store.analysis.causes import find_stalls

    stalls = find_stalls(store, sid, a, b)
    out = []
    for r in stalls[:limit]:
        one = explain(store, sid, step=r["step"])
        p = one.get("primary_cause") or {}
        out.append({"step": r["step"], "dur_ns": r["dur"], "baseline_dur_ns": r["baseline_dur"],
                    "ratio": r["ratio"], "cause": p.get("summary") or "no recorded wait explains it",
                    "python": p.get("python")})
    return out, len(stalls)


def stall_table(rows: list[dict], total: int) -> str:
    if not rows:
        return "<p>No step stalled in this window.</p>"
    body = "".join(
        f"<tr><td>{r['step']}</td><td>{ms(r['dur_ns'])}</td><td>{ms(r['baseline_dur_ns'])}</td>"
        f"<td>{r['ratio']}x</td><td style='text-align:left'>{html.escape(r['cause'])}</td>"
        f"<td style='text-align:left'><code>{html.escape(r['python'] or '')}</code></td></tr>" for r in rows)
    more = (f"<p class=note>The {len(rows)} worst of {total} stalls; each one's report: <code>recorder report "
            "--step N</code>.</p>" if total > len(rows) else
            "<p class=note>Each one's report: <code>recorder report --step N --html FILE</code> or "
            "<code>recorder explain --step N</code>.</p>")
    return ("<table class=stalls><tr><th>step</th><th>took</th><th>median</th><th>ratio</th><th>cause</th>"
            f"<th>Python line</th></tr>{body}</table>{more}")


# -- the page -------------------------------------------------------------------------------------
CSS = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1150px; color: #222; }
h1 { font-size: 1.5em; } h2 { font-size: 1.15em; margin-top: 2em; border-bottom: 1px solid #ddd; }
pre { background: #f6f8fa; padding: 1em; white-space: pre-wrap; font-size: 12px; line-height: 1.35; }
.symptom { font-size: 1.1em; padding: .6em 1em; border-left: 4px solid #d62728; background: #fdf2f2; }
.ok { border-left-color: #2ca02c; background: #f2fbf2; }
table { border-collapse: collapse; font-size: 13px; } td, th { padding: 2px 10px; text-align: right; }
th { border-bottom: 1px solid #ccc; } td:first-child, th:first-child { text-align: left; }
.note { color: #666; font-size: 12px; } svg { width: 100%; height: auto; }
"""


def _section(title: str, body: str) -> str:
    return f"<section><h2>{html.escape(title)}</h2>\n{body}\n</section>"


def build_html(store: Store, session_id: int | None = None, window: str | None = None,
               step_number: int | None = None) -> tuple[str, dict]:
    """The page for the session's worst stall, or for step `step_number`, or for the worst stall in
    `window` (A..B as `recorder explain --window` takes it)."""
    session = session_row(store, session_id)
    sid = session["id"]
    report = explain(store, sid, window, None, False, step_number)
    step = report.get("step") if report.get("mode") == "step" else None
    parts = [f"<h1>stall-recorder: session {sid} on {html.escape(session['hostname'])}</h1>",
             f"<p class=note>{html.escape(session['target'])} &middot; kernel {html.escape(session['kernel_release'])}"
             f" &middot; window {report['window']['start_utc']} .. {report['window']['end_utc']}</p>"]
    symptom = report.get("symptom") or (report.get("primary_cause") or {}).get("summary") or ""
    stalled = bool(report.get("stall") or report.get("primary_cause"))
    parts.append(f"<p class='symptom{'' if stalled else ' ok'}'>{html.escape(symptom)}</p>")
    if report.get("primary_cause"):
        parts.append(f"<p><b>Cause:</b> {html.escape(report['primary_cause'].get('summary', ''))}</p>")
    plots: dict[str, bool] = {}

    svg = step_plot(store, sid, step["step"] if step else None)
    plots["steps"] = svg is not None
    parts.append(_section("Step durations", svg or "<p>No step markers or inferred steps in this session.</p>"))
    svg = breakdown_plot(report) if step else None
    plots["breakdown"] = svg is not None
    if svg and step:
        parts.append(_section(f"Where step {step['step']} went (against its neighbours)", svg))
    svg, lat = latency_plot(store, sid)
    plots["latency"] = svg is not None
    if svg:
        table = "".join(
            f"<tr><td>{html.escape(str(r['device']))}</td><td>{html.escape(str(r['op']))}</td><td>{r['requests']}</td>"
            + "".join(f"<td>{ms(r[c])}</td>" for c in ("p50_dur", "p99_dur", "p999_dur", "max_dur")) + "</tr>"
            for r in lat)
        svg += ("<table><tr><th>device</th><th>op</th><th>requests</th><th>p50</th><th>p99</th><th>p99.9</th>"
                f"<th>max</th></tr>{table}</table>")
    parts.append(_section("Block request latency by device", svg or "<p>No block requests recorded.</p>"))
    gpu = report.get("gpu") or {}
    if gpu.get("top_kernels") is not None:
        rows = "".join(f"<tr><td>{html.escape(k['name'][:160])}</td><td>{ms(k['dur_ns'])}</td><td>{k['count']}</td>"
                       f"<td>{k['share_pct']}%</td></tr>" for k in gpu["top_kernels"])
        idle = "".join(f"<tr><td>{html.escape(h['name'][:160])}</td><td>{html.escape(h['kind'])}</td>"
                       f"<td>{ms(h['dur_ns'])}</td><td>{h['share_pct']}%</td></tr>" for h in gpu.get("host_idle") or [])
        python = "".join(f"<tr><td>{html.escape(h['name'][:160])}</td><td>{ms(h['dur_ns'])}</td>"
                         f"<td>{h['share_pct']}%</td></tr>" for h in gpu.get("python_idle") or [])
        busy = ", ".join(f"device {d['device']} {d['busy_pct']}%" for d in gpu.get("devices") or [])
        parts.append(_section("The device (profiler trace)", (
            f"<p>Busy: {html.escape(busy or 'no kernel, copy or memset')}; bound by the {gpu.get('bound')}.</p>"
            "<table><tr><th>kernel</th><th>time</th><th>launches</th><th>of kernel time</th></tr>"
            f"{rows}</table><p>While the device was idle ({ms(gpu.get('idle_ns'))}), the launching thread was in:</p>"
            f"<table><tr><th>host op</th><th>kind</th><th>idle time</th><th>share</th></tr>{idle}</table>"
            + (f"<p>By Python line:</p><table><tr><th>Python</th><th>idle time</th><th>share</th></tr>{python}</table>"
               if python else ""))))
    win = report["window"]
    threads: list[tuple[int | None, str]] = [(None, "")]
    if step:
        row = store.row("SELECT thread_id FROM step_mark WHERE id = ?", (step["step_mark_id"],))
        threads = [(row["thread_id"], "")]
        late = report.get("straggler")
        if late:  # the rank waited for, over the same time: what it was doing instead
            other = store.one("SELECT m.thread_id FROM step_mark m JOIN thread_info t ON t.thread_id = m.thread_id"
                              " WHERE m.session_id = ? AND t.pid = ? AND m.step = ?", (sid, late["pid"], late["step"]))
            if other:
                threads = [(row["thread_id"], f"pid {step['thread']['pid']}"),
                           (other["thread_id"], f"rank {late['rank']} pid {late['pid']}")]
    from store.db.session import resolve_window

    lo_ts, hi_ts = resolve_window(store, session, window)
    stalls, total = stall_rows(store, sid, lo_ts, hi_ts)
    parts.append(_section("Stalls" + (f" in {window}" if window else ""),
                          stall_table(stalls, total)))
    start = win["start_ts"]
    if not step:  # a window, not a step: the plot starts where the recording has something to show
        first = first_event_ts(store, sid, win["start_ts"], win["end_ts"])
        if first is not None and first > start:
            start = first
    svg = timeline_plot(store, sid, start, win["end_ts"], threads)
    plots["timeline"] = svg is not None
    title = (f"Timeline of step {step['step']} ({ms(win['dur_ns'])}) across layers" if step
             else f"Timeline of the report's window from its first recorded event ({ms(win['end_ts'] - start)})")
    t0 = session["started_ts"]
    # ms-rounded outwards, so that the exported window holds all of this one
    lo, hi = (win["start_ts"] - t0) // 1_000_000, -(-(win["end_ts"] - t0) // 1_000_000)
    pick = f"--step {step['step']}" if step else f"--window {lo / 1e3:.3f}..{hi / 1e3:.3f}"
    hint = (f"<p class=note>Every row of it, with the causal links as arrows: <code>recorder export --db "
            f"{html.escape(shlex.quote(str(store.path)))} --session {sid} {pick} --perfetto timeline.pftrace</code>, "
            "then open the file in ui.perfetto.dev.</p>")
    parts.append(_section(title, (svg or "<p>Nothing recorded in the window.</p>") + hint))
    parts.append(_section("The report (recorder explain)", f"<pre>{html.escape(render_text(report))}</pre>"))
    parts.append(_section("The report as JSON (recorder explain --json)",
                          f"<pre>{html.escape(json.dumps(report, indent=1))}</pre>"))
    page = ("<!DOCTYPE html>\n<html lang=en><head><meta charset=utf-8>"
            f"<title>stall-recorder session {sid}</title><style>{CSS}</style></head>\n<body>\n"
            + "\n".join(parts) + "\n</body></html>\n")
    return page, {"session_id": sid, "stall": stalled, "stalls": total, "plots": plots}


def write_html(store: Store, out: Path, session_id: int | None = None, window: str | None = None,
               step: int | None = None) -> dict:
    parent = out.parent if str(out.parent) else Path(".")
    if not parent.is_dir():
        raise UserError(f"folder {parent} does not exist: create it or write the report elsewhere")
    page, info = build_html(store, session_id, window, step)
    tmp = out.with_name(out.name + ".part")
    try:
        tmp.write_text(page, encoding="utf-8")
        os.replace(tmp, out)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise UserError(f"cannot write {out}: {e.strerror}; pass a writable path") from None
    return {"file": str(out), "bytes": len(page.encode()), **info}
