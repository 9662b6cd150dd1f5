"""I/O: the step's thread blocked on I/O (step_cause 'blocked', details io and uninterruptible), and
what the requests it waited on met: a device event that hit one (nvme_timeout, io_error,
iommu_fault, pcie_aer, dma_bounce: the device_event_cause table maps event kinds to these), else
how the slowest one spent its time (slow_io, io_queued, io_throttled), else no request recorded
(blocked_io)."""

from __future__ import annotations

from typing import Any

from store.analysis.kinds.family import IO_REASONS, Facts, Family, Kind, RuleContext
from store.db import Store
from store.db.rules import cause_rule
from store.units import ms

# a request is called slow at or above this fraction of its device's requests (op): the p99 the
# report's latency tables and block_request_percentile print
SLOW_REQUEST_FRACTION = 0.99
NVME_ACTIONS = {"aborting": "abort", "reset controller": "controller reset", "reset": "controller reset",
                "abort": "abort", "disable controller": "controller disabled", "disable": "controller disabled"}


def candidates(ctx: RuleContext) -> list[dict]:
    """One candidate from the step's I/O waits: the most specific device event that hit a request
    of the step, else the slowest request's stage, else a wait without a request."""
    io = [r for r in ctx.rows if r["cause"] == "blocked" and r["detail"] in ctx.io_reasons]
    if not io:
        return []
    store, sid = ctx.store, ctx.step["step_mark_id"]
    every = store.query("SELECT * FROM step_block_request WHERE step_mark_id = ? ORDER BY overlap_dur DESC", (sid,))
    requests = every[:5]
    events = []
    for r in every:  # per request: `=` reaches into every arm of the link view
        events += store.query(
            "SELECT e.*, c.cause FROM block_request_device_event e"
            " LEFT JOIN device_event_cause c ON c.kind = e.kind WHERE e.block_request_id = ?",
            (r["block_request_id"],))
    events.sort(key=lambda e: e["ts"])
    waits = store.query(
        f"SELECT * FROM step_offcpu WHERE step_mark_id = ? AND reason IN ({','.join('?' * len(IO_REASONS))})"
        " ORDER BY blocked_dur DESC LIMIT 1", (sid, *IO_REASONS))
    cand = {"dur_ns": sum(r["dur_ns"] for r in io), "excess_dur_ns": sum(r["excess_dur_ns"] for r in io),
            "events": events, "requests": requests, "wait": waits[0] if waits else None}
    kinds = [e["cause"] for e in events if e["cause"]]
    if kinds:
        specificity = cause_rule(store).specificity
        kind = max(kinds, key=lambda k: specificity[k])
        hit = [e for e in events if e["cause"] == kind]
        request = next(r for r in every if r["block_request_id"] == hit[0]["block_request_id"])
        cand.update(kind=kind, request=request, hit=hit)
    elif requests:
        worst = max(requests, key=lambda r: r["dur"])
        if worst["submitter_kind"] == "target_deferred" and (worst["queued_dur"] or 0) > (worst["device_dur"] or 0):
            kind = "io_throttled"
        elif (worst["queued_dur"] or 0) > (worst["device_dur"] or 0):
            kind = "io_queued"
        else:
            kind = "slow_io"
        cand.update(kind=kind, request=worst)
    else:
        cand.update(kind="blocked_io", request=None)
    return [cand]


def percentile(store: Store, session_id: int, request: dict) -> dict:
    """Where the request's latency falls among the session's requests of its device and op."""
    span = {"s": session_id, "d": request["device"], "o": request["op"], "v": request["dur"]}
    n = store.row("SELECT count(*) AS n FROM block_request WHERE session_id = :s AND device = :d AND op = :o",
                  span)["n"]
    below = store.row("SELECT count(*) AS n FROM block_request WHERE session_id = :s AND device = :d AND op = :o"
                      " AND dur <= :v", span)["n"]
    mid = store.one("SELECT dur FROM block_request WHERE session_id = :s AND device = :d AND op = :o"
                    " ORDER BY dur LIMIT 1 OFFSET :h", {**span, "h": max(n - 1, 0) // 2})
    return {"requests": n, "rank": below, "fraction": round(below / n, 5) if n else None,
            "median_dur_ns": mid["dur"] if mid else None}


def io_path(f: Facts) -> list[str]:
    """The kernel path of the wait: the syscall, the writeback, the block layer, the device."""
    request, syscall = f.request, f.syscall
    path = []
    if syscall:
        path.append(f"{syscall}()")
    if request:
        if request.get("op") == "write" and syscall in ("fsync", "fdatasync", "sync_file_range", "msync"):
            path.append("writeback of the file's dirty pages")
        if request.get("submitter_kind") == "target_deferred":
            path.append(f"blk-throttle (queued {ms(request.get('queued_dur'))})")
        else:
            path.append(f"blk-mq (queued {ms(request.get('queued_dur'))})")
        path.append(f"{request.get('device')} (on device {ms(request.get('device_dur'))})")
    return path


def event_rows(store: Store, events: list[dict]) -> list[dict]:
    """The typed rows behind device events (nvme_event, block_error, ...), in time order."""
    out = []
    for e in events:
        row = store.one(f"SELECT * FROM {e['event_table']} WHERE id = ?", (e["event_id"],))
        if row:
            out.append({**row, "event_table": e["event_table"], "kind": e["kind"], "link_detail": e["detail"]})
    return out


def nvme_timeout(f: Facts) -> None:
    rows = event_rows(f.store, f.cand.get("hit") or [])
    first = next((r for r in rows if r.get("qid") is not None), rows[0] if rows else {})
    disk = f.request.get("device")
    ctrl = first.get("controller")
    pci = f.store.one("SELECT pci_address FROM block_device WHERE session_id = ? AND controller = ? LIMIT 1",
                      (f.request.get("session_id"), ctrl)) if ctrl else None
    actions = []
    for r in rows:
        if r.get("kind") in ("nvme_timeout", "nvme_timeout_abort", "nvme_timeout_reset") and r.get("action"):
            actions.append(NVME_ACTIONS.get(r["action"], r["action"]))
        elif r["event_table"] == "nvme_event" and r["kind"] != "nvme_timeout":
            actions.append(r["link_detail"])
    nv: dict[str, Any] = {"device": disk, "controller": ctrl, "queue": first.get("qid"),
          "request_tag": first.get("tag", first.get("rq_tag")), "pci_address": pci["pci_address"] if pci else None,
          "actions": list(dict.fromkeys(actions)), "first_event_ts": rows[0]["ts"] if rows else None}
    f.facts.update(nv)
    f.context.update(link=nv["pci_address"] or nv["controller"], link_address=nv["pci_address"] or "<pci address>")
    where = [f"controller {nv['controller']}"] + [f"{name} {nv[key]}" for name, key in (
        ("queue", "queue"), ("request tag", "request_tag")) if nv[key] is not None]
    f.facts["summary"] = (f"NVMe timeout on {disk} ({', '.join(where)})" +
                          (", then controller reset" if "controller reset" in nv["actions"] else "") +
                          f": the thread waited {ms(f.dur)} for I/O")
    f.path = io_path(f) + ["NVMe timeout"] + nv["actions"][:4] + ["request completed"]


def device_event(f: Facts) -> None:
    """io_error, iommu_fault, pcie_aer, dma_bounce: a device event while the request was in flight."""
    kind, disk, dur = f.kind, f.request.get("device"), f.dur
    rows = event_rows(f.store, f.cand.get("hit") or [])
    first = rows[0] if rows else {}
    device = first.get("device") or first.get("dev") or first.get("source")
    pci = f.store.one("SELECT pci_address FROM block_device WHERE session_id = ? AND disk = ? LIMIT 1",
                      (f.request.get("session_id"), disk)) if disk else None
    if pci and pci["pci_address"] and device and pci["pci_address"].endswith(device):
        device = pci["pci_address"]  # VT-d prints bus:dev.fn without the PCI segment
    f.facts.update(device=disk, event_device=device, events=len(rows))
    f.context["sector"] = first.get("sector")
    if kind == "io_error":
        f.facts["summary"] = (f"I/O error on {disk} at sector {first.get('sector')} ({f.cand['hit'][0]['detail']}):"
                              f" the thread waited {ms(dur)} for I/O")
    elif kind == "iommu_fault":
        f.facts["summary"] = (f"IOMMU fault on {device} ({f.cand['hit'][0]['detail']}) while {disk} I/O was in "
                              f"flight: the thread waited {ms(dur)} for I/O")
    elif kind == "pcie_aer":
        f.facts["summary"] = (f"PCIe AER error on {device} ({f.cand['hit'][0]['detail']}) while {disk} I/O was in "
                              f"flight: the thread waited {ms(dur)} for I/O")
    else:
        full = any(r["kind"] == "swiotlb_full" for r in rows)
        bounces = sum(1 for r in rows if r["kind"] == "dma_bounce")
        f.facts["summary"] = (f"DMA through SWIOTLB bounce buffers on {device} ({disk}): {bounces} bounces "
                              f"during the step" + (", and the bounce pool was full" if full else "") +
                              f"; the thread waited {ms(dur)} for I/O")
    f.path = io_path(f) + [f"{kind.replace('_', ' ')} on {device}"]


def slow_io(f: Facts) -> None:
    request, disk, dur = f.request, f.request.get("device"), f.dur
    pct = percentile(f.store, f.step["session_id"], request)
    f.facts.update(device=disk, percentile=pct)
    where = ""
    if pct.get("requests"):
        where = (f" (slower than {100 * (pct['rank'] - 1) / pct['requests']:.1f}% of its {pct['requests']} "
                 f"{request['op']}s; median {ms(pct['median_dur_ns'])})")
    if not pct.get("requests") or pct["fraction"] >= SLOW_REQUEST_FRACTION:
        f.facts["summary"] = (f"slow {request['op']} on {disk}: one request took {ms(request['device_dur'])}"
                              f" on the device{where}; the thread waited {ms(dur)} for I/O")
    else:  # an ordinary request of its device: the wait is the I/O's, not a slow device's
        f.facts["summary"] = (f"waiting for I/O on {disk}: the longest request took {ms(request['device_dur'])}"
                              f" on the device, at p{100 * pct['fraction']:.0f} of its {pct['requests']} "
                              f"{request['op']}s (median {ms(pct['median_dur_ns'])}), not above its device's "
                              f"p{100 * SLOW_REQUEST_FRACTION:g}; the thread waited {ms(dur)} for I/O")
    f.path = io_path(f)


def queued(f: Facts) -> None:
    """io_queued, io_throttled: the request waited before the device."""
    disk = f.request.get("device")
    what = "blk-throttle (a cgroup I/O limit)" if f.kind == "io_throttled" else "the block layer's queue"
    f.facts.update(device=disk, percentile={})
    f.facts["summary"] = (f"I/O queued in {what} for {ms(f.request.get('queued_dur'))} before reaching {disk}; "
                          f"the thread waited {ms(f.dur)} for I/O")
    f.path = io_path(f)


def blocked_io(f: Facts) -> None:
    f.facts.update(device=f.request.get("device"), percentile={})
    f.facts["summary"] = (f"blocked on I/O ({f.syscall or 'no syscall'}) for {ms(f.dur)}; "
                          "no block request was recorded")
    f.path = io_path(f)


IO_TIME = ("blocked", IO_REASONS)
FAMILY = Family(
    name="io",
    kinds=tuple(Kind(name, facts, lost_time=IO_TIME) for name, facts in (
        ("nvme_timeout", nvme_timeout), ("io_error", device_event), ("iommu_fault", device_event),
        ("pcie_aer", device_event), ("dma_bounce", device_event), ("slow_io", slow_io), ("io_queued", queued),
        ("io_throttled", queued), ("blocked_io", blocked_io))),
    whole=candidates,
    actions={
        "nvme_timeout": [
            "Read the drive's health and error log: nvme smart-log /dev/{controller}; nvme error-log "
            "/dev/{controller} (media errors, critical warnings, entries at the time of the timeout)",
            "Check the PCIe link of {link}: lspci -vvv -s {link_address} (LnkSta, AER status) "
            "and the kernel log for AER lines around it",
            "Compare {device}'s write latency during checkpoints with the rest of the session: "
            "SELECT * FROM block_latency WHERE device = '{device}'",
            "If timeouts recur, update the drive firmware or move checkpoints off {device}",
        ],
        "io_error": [
            "Check the disk: smartctl -a /dev/{device} (or nvme smart-log), and the kernel log around the error",
            "Verify the data read from sector {sector} of {device} (the file system may need a check)",
        ],
        "iommu_fault": [
            "Find the driver and mapping that faulted: dmesg around the fault, lspci -k -s {event_device}",
            "Check the IOMMU mode (iommu=pt / intel_iommu=on) and the device's DMA mask; a recurring fault at "
            "the same address points to a driver or firmware bug",
        ],
        "pcie_aer": [
            "Inspect the link: lspci -vvv -s {event_device} (LnkSta, AER counters)",
            "Reseat or replace the device or riser if correctable errors keep counting",
        ],
        "dma_bounce": [
            "Find why {event_device} bounces: its DMA mask (dmesg | grep -i 'dma mask'), swiotlb=force on the "
            "kernel command line, an IOMMU in passthrough with a device that cannot reach all memory",
            "Enable the IOMMU for the device or give it a 64-bit DMA mask; as a stopgap enlarge the pool "
            "(swiotlb=<slabs>)",
        ],
        "slow_io": [
            "Look at {device}'s latency over the session: SELECT * FROM block_latency_window WHERE device = "
            "'{device}' (queue depth and competing I/O at that second)",
            "Check the drive: nvme smart-log /dev/{device} (or smartctl -a), firmware and temperature",
            "Prefetch or read ahead the training data so one slow read does not stall a step",
        ],
        "io_queued": [
            "Check the I/O scheduler and queue depth of {device} (cat /sys/block/{device}/queue/scheduler)",
            "See who else used {device} then: SELECT * FROM block_request_named WHERE device = '{device}' "
            "AND ts BETWEEN {request_ts} AND {request_end}",
        ],
        "io_throttled": [
            "Check the cgroup's I/O limits (io.max, blkio.throttle.*) of the job",
            "See who else used {device} then: SELECT * FROM block_request_named WHERE device = '{device}' "
            "AND ts BETWEEN {request_ts} AND {request_end}",
        ],
        "blocked_io": [
            "Record with the block layer attached to see the requests behind the wait "
            "(recorder doctor says whether it can)",
        ],
    },
)
