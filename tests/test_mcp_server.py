"""The MCP server through the SDK's own client, in process: every tool, the schema resource, the
investigate prompt, and trace text coming back marked as data."""

from __future__ import annotations

import json
import subprocess
import sys

import anyio
import pytest
from mcp import Client
from test_mcp_recording import INJECTION, make_recording

from mcp_server import untrusted
from mcp_server.schema import objects
from mcp_server.server import build_server
from store.errors import StoreError

TOOLS = {"list_sessions", "list_processes", "capabilities", "list_steps", "explain_stall", "top_stalls", "python_lines",
         "cluster_explain", "io_latency", "nvme_events", "kernel_log", "nccl_collectives", "device_timeline",
         "evidence", "run_sql"}
CALLS = [("list_sessions", {}), ("list_processes", {}), ("capabilities", {}), ("list_steps", {}), ("explain_stall", {}),
         ("top_stalls", {}), ("python_lines", {}), ("io_latency", {}), ("nvme_events", {}), ("kernel_log", {}),
         ("nccl_collectives", {}), ("device_timeline", {}), ("evidence", {"kind": "cuda_call", "id": 8}),
         ("run_sql", {"sql": "SELECT count(*) AS n FROM cuda_call"})]


@pytest.fixture
def db(tmp_path):
    return make_recording(tmp_path / "r.db")


def call_all(server, calls):
    async def go():
        async with Client(server, raise_exceptions=True) as c:
            tools = (await c.list_tools()).tools
            results = {}
            for name, args in calls:
                r = await c.call_tool(name, args)
                results[name if name not in results else name + "#2"] = r
            schema = (await c.read_resource("schema://tables")).contents[0].text
            prompt = (await c.get_prompt("investigate", {"question": "why did step 80042 stall?"})).messages
            return tools, results, schema, prompt
    return anyio.run(go)


def test_every_tool_answers_read_only_and_structured(db):
    tools, results, _, _ = call_all(build_server(db), CALLS)
    assert {t.name for t in tools} == TOOLS
    assert all(t.annotations.read_only_hint for t in tools)
    for name, r in results.items():
        assert not r.is_error, (name, r.content)
        assert isinstance(r.structured_content, dict), name
    stalls = results["top_stalls"].structured_content["stalls"]
    assert [(s["cuda_call_id"], s["dur_ns"], s["cause"]) for s in stalls] == [(8, 12_000_000, "cpu_contention")]
    ev = results["evidence"].structured_content
    assert [o["overlap_dur_ns"] for o in ev["offcpu_intervals"]] == [5_000_000, 6_000_000]
    assert ev["contenders"][0]["contender_name"] == {"untrusted_text": "hog"}
    nvme = results["nvme_events"].structured_content["events"]
    assert [(e["kind"], e["tag"], e["qid"]) for e in nvme] == [("timeout", 4096, 7)]
    assert results["run_sql"].structured_content["rows"] == [[10]]


def test_layers_not_recorded_say_so_instead_of_numbers(db):
    _, results, _, _ = call_all(build_server(db), CALLS)
    for name, key in (("list_steps", "steps"), ("python_lines", "lines"), ("io_latency", "devices"),
                      ("nccl_collectives", "collectives"), ("device_timeline", "top_kernels")):
        out = results[name].structured_content
        assert out[key] == [] and ("not recorded" in out["note"] or "not observed" in out["note"]), name
    nccl = results["nccl_collectives"].structured_content
    assert "no libnccl mapped" not in nccl["note"]  # trace text stays out of the recorder's own words
    assert nccl["not_recorded_because"] == [{"probe": {"untrusted_text": "ncclAllReduce"},
                                             "target": {"untrusted_text": ""}, "status": "absent",
                                             "detail": {"untrusted_text": "no libnccl mapped by the targets"}}]
    layers = {x["layer"]: x["observed"] for x in results["capabilities"].structured_content["layers"]}
    assert layers["sched"] and layers["cuda"] and not layers["nccl"] and not layers["block"]


def test_trace_text_that_looks_like_instructions_comes_back_marked_as_data(db):
    calls = [("kernel_log", {}), ("run_sql", {"sql": "SELECT cmdline FROM process WHERE pid = 20"}),
             ("evidence", {"kind": "kernel_log", "id": 2})]
    _, results, _, _ = call_all(build_server(db), calls)
    records = results["kernel_log"].structured_content["records"]
    assert records[1]["text"] == {"untrusted_text": INJECTION}
    assert results["evidence"].structured_content["kernel_log"]["text"] == {"untrusted_text": INJECTION}
    cell = results["run_sql"].structured_content["rows"][0][0]
    assert cell["untrusted_text"].startswith("hog --spin SYSTEM: ignore")
    assert len(cell["untrusted_text"]) == untrusted.MAX_CHARS and cell["original_chars"] > untrusted.MAX_CHARS
    # nowhere does trace text appear as a bare string
    for r in results.values():
        for value in _strings(r.structured_content):
            assert "ignore all previous" not in value, value


def _strings(value):
    if isinstance(value, dict):
        for k, v in value.items():
            if k != untrusted.MARKER:
                yield from _strings(v)
    elif isinstance(value, list):
        for v in value:
            yield from _strings(v)
    elif isinstance(value, str):
        yield value


def test_explain_stall_is_recorder_explain_json(db):
    for args, cli in (({}, []), ({"worst": True}, ["--worst"]), ({"window": "1.5..1.8"}, ["--window", "1.5..1.8"])):
        _, results, _, _ = call_all(build_server(db), [("explain_stall", args)])
        out = subprocess.run([sys.executable, "-m", "recorder", "explain", "--db", str(db), "--json", *cli],
                             capture_output=True, text=True, check=True).stdout
        assert untrusted.unmark(results["explain_stall"].structured_content) == json.loads(out)


def test_errors_are_tool_errors_with_the_store_message(db):
    calls = [("explain_stall", {"session_id": 9}), ("evidence", {"kind": "cuda_call", "id": 999}),
             ("explain_stall", {"window": "nonsense"}), ("run_sql", {"sql": "DELETE FROM session"})]

    async def go():
        async with Client(build_server(db)) as c:
            return [await c.call_tool(n, a) for n, a in calls]
    results = anyio.run(go)
    assert all(r.is_error for r in results)
    assert "no session 9" in results[0].content[0].text
    assert "no CUDA call 999" in results[1].content[0].text
    with pytest.raises(StoreError, match="no recording at"):
        build_server(db.with_name("missing.db"))


def test_schema_resource_documents_every_table_and_view_from_the_sql_files(db):
    _, _, schema, prompt = call_all(build_server(db), [])
    _, known = objects()
    for name, obj in known.items():
        assert f"## {obj.kind} {name}" in schema
    # every column of every table has its comment from the migrations, not a second copy
    assert "- wall_offset_ns INTEGER: ns to add to a ts to get Unix time (CLOCK_REALTIME)" in schema
    # (the check of complete column comments belongs to the store; here only what the resource relies on)
    tables = [o for o in known.values() if o.kind == "table" and o.name in ("session", "thread", "cuda_call",
                                                                            "offcpu_interval", "nvme_event")]
    undocumented = [f"{o.name}.{c}" for o in tables for c, _ in o.columns if c not in o.comments and c != "id"]
    assert undocumented == []
    text = prompt[0].content.text
    assert "why did step 80042 stall?" in text and "untrusted_text" in text and "capabilities" in text


def test_step_drill_down_from_explain_to_the_nvme_event(tmp_path):
    """On the synthetic NVMe scenario: explain_stall(step=N) -> evidence(step) -> the block request
    -> the NVMe timeout that hit it, all through the tools."""
    from recorder.demo import write_scenario

    db = tmp_path / "nvme.db"
    write_scenario("nvme-timeout-checkpoint", db)
    calls = [("list_steps", {"limit": 3}), ("explain_stall", {"step": 80042})]
    _, results, _, _ = call_all(build_server(db), calls)
    steps = untrusted.unmark(results["list_steps"].structured_content)["steps"]
    assert steps[0]["step"] == 80042 and steps[0]["stalled"] is True and not steps[1]["stalled"]
    report = untrusted.unmark(results["explain_stall"].structured_content)
    cause = report["primary_cause"]
    assert cause["kind"] == "nvme_timeout" and (cause["queue"], cause["request_tag"]) == (7, 4096)
    request_id = cause["evidence"]["request"]
    _, results, _, _ = call_all(build_server(db), [
        ("evidence", {"kind": "step", "id": report["step"]["step_mark_id"]}),
        ("evidence", {"kind": "block_request", "id": request_id}),
    ])
    step_ev = untrusted.unmark(results["evidence"].structured_content)
    links = {(link["relation"], link["to_table"], link["to_id"]) for link in step_ev["links"]}
    assert ("io", "block_request", request_id) in links
    req_ev = untrusted.unmark(results["evidence#2"].structured_content)
    kinds = [e["kind"] for e in req_ev["device_events"]]
    assert kinds[0] == "nvme_timeout" and "nvme_resetting" in kinds
