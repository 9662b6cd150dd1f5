"""The device's own timeline over a step or window (device_activity, from imported profiler traces):
how busy each device was (the union of its kernels, copies and memsets), the kernels that took the
most time, and what the launching thread was doing while its device sat idle.

A step is bound by the device when its device was busy for most of it (BOUND_BY_DEVICE), else by
the host: the idle time is then attributed to the innermost host op (operator, Python function,
runtime call, annotation) the step's thread was in, so the report names what kept the device waiting.
"""

from __future__ import annotations

from store.db import Store

BOUND_BY_DEVICE = 80.0  # % busy from which a step is bound by the device
TOP_KERNELS = 5
HOST_LISTED = 5
WORK = ("kernel", "memcpy", "memset")
STEP_PREFIX = "ProfilerStep#"


def _union(intervals: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            if b > out[-1][1]:
                out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out


def _overlap(a: int, b: int, busy: list[tuple[int, int]]) -> int:
    return sum(max(0, min(b, y) - max(a, x)) for x, y in busy)


def _gaps(a: int, b: int, busy: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out, at = [], a
    for x, y in busy:
        if x > at:
            out.append((at, min(x, b)))
        at = max(at, y)
    if at < b:
        out.append((at, b))
    return [(x, y) for x, y in out if y > x]


def has_device_activity(store: Store, sid: int) -> bool:
    return store.one("SELECT 1 AS x FROM device_activity WHERE session_id = ? LIMIT 1", (sid,)) is not None


def timeline(store: Store, sid: int, a: int, b: int, thread_id: int | None = None,
             process_id: int | None = None) -> dict | None:
    """Busy share per device over [a, b), the top kernels, and (with the step's thread) what the host
    did while the busiest device was idle; None when the session has no device activity there."""
    if b <= a:
        return None
    where = "session_id = :s AND ts < :b AND ts + dur > :a AND kind IN ('kernel', 'memcpy', 'memset')"
    params: dict = {"s": sid, "a": a, "b": b}
    if process_id is not None and store.one("SELECT 1 AS x FROM device_activity WHERE session_id = :s"
                                            " AND process_id = :p LIMIT 1", {"s": sid, "p": process_id}):
        where += " AND process_id = :p"
        params["p"] = process_id
    rows = store.query(f"SELECT ts, dur, device, kind, name_id FROM device_activity WHERE {where}", params)
    if not rows:
        if not has_device_activity(store, sid):
            return None
        return {"busy_pct": 0.0, "devices": [], "top_kernels": [], "idle_ns": b - a, "bound": "host",
                "host_idle": _host_idle(store, thread_id, a, b, [(a, b)]),
                "python_idle": _host_idle(store, thread_id, a, b, [(a, b)], kinds=("python_function",))}
    per_device: dict[int, list[tuple[int, int]]] = {}
    kernels: dict[int, list[int]] = {}
    for r in rows:
        x, y = max(r["ts"], a), min(r["ts"] + r["dur"], b)
        per_device.setdefault(r["device"], []).append((x, y))
        if r["kind"] == "kernel":
            k = kernels.setdefault(r["name_id"], [0, 0])
            k[0] += y - x
            k[1] += 1
    devices: list[dict] = []
    for device, spans in sorted(per_device.items()):
        busy = _union(spans)
        busy_ns = sum(y - x for x, y in busy)
        devices.append({"device": device, "busy_ns": busy_ns, "busy_pct": round(100.0 * busy_ns / (b - a), 1),
                        "busy": busy})
    main = max(devices, key=lambda d: d["busy_ns"])
    total_kernel = sum(k[0] for k in kernels.values()) or 1
    top = sorted(kernels.items(), key=lambda kv: -kv[1][0])[:TOP_KERNELS]
    names = {r["id"]: r["value"] for r in store.query(
        f"SELECT id, value FROM string WHERE id IN ({','.join(str(int(i)) for i, _ in top) or 'NULL'})")}
    gaps = _gaps(a, b, main["busy"])
    out = {
        "busy_pct": main["busy_pct"],
        "devices": [{k: d[k] for k in ("device", "busy_ns", "busy_pct")} for d in devices],
        "top_kernels": [{"name": names.get(i, "?"), "dur_ns": v[0], "count": v[1],
                         "share_pct": round(100.0 * v[0] / total_kernel, 1)} for i, v in top],
        "idle_ns": sum(y - x for x, y in gaps),
        "host_idle": _host_idle(store, thread_id, a, b, gaps),
        "python_idle": _host_idle(store, thread_id, a, b, gaps, kinds=("python_function",)),
        "bound": "device" if main["busy_pct"] >= BOUND_BY_DEVICE else "host",
    }
    return out


def _host_idle(store: Store, thread_id: int | None, a: int, b: int, gaps: list[tuple[int, int]],
               kinds: tuple[str, ...] | None = None) -> list[dict]:
    """Per innermost host op of the thread (of `kinds`, default any): the idle time of the device it
    covers, most first; the time in no such op is '(between ops)'. With kinds=('python_function',),
    the Python lines (a trace recorded with_stack=True) the thread was in while the device was idle."""
    if thread_id is None or not gaps:
        return []
    ops = store.query(
        "SELECT o.ts, o.dur, o.kind, s.value AS name FROM host_op o JOIN string s ON s.id = o.name_id"
        " WHERE o.thread_id = ? AND o.ts < ? AND o.ts + o.dur > ? ORDER BY o.ts, o.dur DESC", (thread_id, b, a))
    ops = [o for o in ops if not o["name"].startswith(STEP_PREFIX) and (kinds is None or o["kind"] in kinds)]
    if not ops and kinds is not None:
        return []
    idle_total = sum(y - x for x, y in gaps)
    # each op's own share: its idle overlap less its children's (ops on one thread nest)
    own: dict[tuple[str, str], int] = {}
    stack: list[dict] = []
    covered = 0
    for o in ops:
        o["end"] = o["ts"] + o["dur"]
        o["idle"] = _overlap(max(o["ts"], a), min(o["end"], b), gaps)
        while stack and stack[-1]["end"] <= o["ts"]:
            stack.pop()
        if stack:
            stack[-1]["idle"] -= o["idle"]
        else:
            covered += o["idle"]
        o["key"] = (o["kind"], o["name"])
        stack.append(o)
    for o in ops:
        if o["idle"] > 0:
            own[o["key"]] = own.get(o["key"], 0) + o["idle"]
    if idle_total > covered:
        own[("none", "(between ops)")] = idle_total - covered
    ranked = sorted(own.items(), key=lambda kv: -kv[1])[:HOST_LISTED]
    return [{"name": name, "kind": kind, "dur_ns": dur, "share_pct": round(100.0 * dur / idle_total, 1)}
            for (kind, name), dur in ranked]


def text(d: dict) -> str:
    """'device busy 42.0% of the step (bound by the host: idle 350 ms, the host in DataLoader.__next__
    for 310 ms)'; the top kernels are said apart."""
    from store.units import ms

    out = f"device busy {d['busy_pct']}% of the step"
    if d["bound"] == "device":
        return out + " (bound by the device)"
    python = [h for h in d.get("python_idle") or [] if h["kind"] != "none"]
    host = python[0] if python else (d["host_idle"][0] if d["host_idle"] else None)
    out += f" (bound by the host: device idle {ms(d['idle_ns'])}"
    if host:
        out += f", the launching thread in {host['name']} for {ms(host['dur_ns'])} of it"
    return out + ")"
