"""The listing tools answer from the data, through `recorder mcp` over real stdio on demo recordings:
io_latency's percentiles are the block_latency view's, its slowest request is the one the step report
blames; python_lines and top_stalls agree with `recorder top`; a window narrows every one of them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import anyio
import pytest
from mcp import Client, StdioServerParameters

from mcp_server import untrusted

ROOT = Path(__file__).resolve().parent.parent
RECORDER = [sys.executable, "-m", "recorder"]


@pytest.fixture(scope="module")
def demos(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("demos")
    out = {}
    for name in ("p999-read-latency", "cpu-contention", "healthy"):
        out[name] = d / f"{name}.db"
        subprocess.run([*RECORDER, "demo", "--no-gpu", name, "--db", str(out[name])], check=True,
                       capture_output=True, cwd=ROOT)
    return out


def over_stdio(db: Path, calls: list[tuple[str, dict]]) -> list[dict]:
    params = StdioServerParameters(command=sys.executable, args=["-m", "recorder", "mcp", "--db", str(db)],
                                   cwd=str(ROOT))

    async def go() -> list[dict]:
        out = []
        async with Client(params) as c:
            for name, args in calls:
                r = await c.call_tool(name, args)
                assert not r.is_error, (name, r.content)
                out.append(untrusted.unmark(r.structured_content))
        return out
    return anyio.run(go)


def cli_json(*args: str) -> dict:
    return json.loads(subprocess.run([*RECORDER, *args, "--json"], capture_output=True, text=True, check=True,
                                     cwd=ROOT).stdout)


VIEW = ("SELECT device, op, requests, bytes, p50_dur, p99_dur, p999_dur, max_dur, p99_queued_dur, max_queued_dur,"
        " p99_device_dur, max_device_dur FROM block_latency ORDER BY max_dur DESC")


def test_io_latency_is_the_block_latency_view_with_the_request_the_report_blames(demos):
    db = demos["p999-read-latency"]
    io, view, report = over_stdio(db, [("io_latency", {}), ("run_sql", {"sql": VIEW}),
                                       ("explain_stall", {"worst": True})])
    keys = ["device", "op", "requests", "bytes", "p50_dur_ns", "p99_dur_ns", "p999_dur_ns", "max_dur_ns",
            "p99_queued_dur_ns", "max_queued_dur_ns", "p99_device_dur_ns", "max_device_dur_ns"]
    assert [[d[k] for k in keys] for d in io["devices"]] == view["rows"]
    nvme = io["devices"][0]
    assert (nvme["device"], nvme["requests"]) == ("nvme0n1", 1280)
    slowest = nvme["slowest_requests"][0]
    assert slowest["block_request_id"] == report["primary_cause"]["evidence"]["request"]
    assert slowest["dur_ns"] == nvme["max_dur_ns"] and slowest["session_percentile"] == 1.0
    assert [r["dur_ns"] for r in nvme["slowest_requests"]] == sorted(
        (r["dur_ns"] for r in nvme["slowest_requests"]), reverse=True)
    worst = nvme["worst_seconds"][0]
    assert worst["max_dur_ns"] == nvme["max_dur_ns"]
    assert worst["window_s"] == (slowest["ts_ns"] - io["start_ns"]) // 1_000_000_000  # whole session: its start
    assert "note" not in io


def test_io_latency_in_a_window_counts_only_the_requests_that_started_in_it(demos):
    db = demos["p999-read-latency"]
    (full,) = over_stdio(db, [("io_latency", {})])
    ts = full["devices"][0]["slowest_requests"][0]["ts_ns"]
    start_ns = full["start_ns"]
    a, b = (ts - start_ns) / 1e9 - 1, (ts - start_ns) / 1e9 + 1
    sql = (f"SELECT count(*), max(dur) FROM block_request WHERE ts >= {full['start_ns']} + {int(a * 1e9)}"
           f" AND ts < {full['start_ns']} + {int(b * 1e9)}")
    io, counted = over_stdio(db, [("io_latency", {"window": f"{a}..{b}"}), ("run_sql", {"sql": sql})])
    d = io["devices"][0]
    assert [d["requests"], d["max_dur_ns"]] == counted["rows"][0]
    assert 0 < d["requests"] < full["devices"][0]["requests"]
    assert all(w["window_s"] in (int(a), int(a) + 1, int(b)) for w in d["worst_seconds"])


def test_python_lines_and_top_stalls_agree_with_recorder_top(demos):
    for name in ("p999-read-latency", "cpu-contention"):
        db = demos[name]
        lines, top = over_stdio(db, [("python_lines", {}), ("top_stalls", {})])
        cli = cli_json("top", "--db", str(db))
        assert [(x["python_line"], x["stalls"], x["excess_dur_ns"]) for x in lines["stall_lines"]] == \
            [(x["python"], x["stalls"], x["excess_dur_ns"]) for x in cli["worst_lines"]], name
        assert [(s["step"], s["dur_ns"], s["cause"], s["summary"]) for s in top["steps"]] == \
            [(s["step"], s["dur_ns"], s["cause"], s["summary"]) for s in cli["worst_stalls"]], name
        assert top["stalled_steps_in_window"] == cli["stalls_total"]
        assert "note" not in lines and "note" not in top
    lines, cuda = over_stdio(demos["p999-read-latency"], [
        ("python_lines", {}), ("run_sql", {"sql": "SELECT python_line, dur FROM python_lines"})])
    assert lines["stall_lines"][0]["python_line"] == "load_batch() at data.py:88"
    assert [[x["python_line"], x["cuda_dur_ns"]] for x in lines["lines"]] == cuda["rows"]


def test_a_healthy_recording_has_lines_but_no_stalls(demos):
    lines, top = over_stdio(demos["healthy"], [("python_lines", {}), ("top_stalls", {})])
    assert lines["stall_lines"] == [] and lines["lines"] and "note" not in lines
    assert top["steps"] == [] and top["stalled_steps_in_window"] == 0 and "note" not in top
