"""docs/architecture.md's checklists are true: a cause kind and an MCP tool added to a copy of the tree,
touching only the files "Adding a cause kind" and "Adding an MCP tool" name, reach the report and the
server; every kind is declared once (a family, a specificity, next actions); the server publishes
exactly the tools of mcp_server.tools.TOOLS, explain_stall with the report's model as its schema."""

from __future__ import annotations

import fnmatch
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import anyio
import pytest
from conftest import ROOT
from mcp import Client

from mcp_server.server import build_server
from mcp_server.tools import TOOLS
from recorder.demo import write_scenario
from store.analysis.kinds import FAMILIES, KINDS, STEP_ACTIONS
from store.db import open_store
from store.db.rules import cause_rule

DOC = (ROOT / "docs/architecture.md").read_text()


def named_files(section: str, steps: str) -> list[str]:
    """The file paths (backticked) of the numbered steps `steps` (e.g. '12') of a checklist."""
    body = DOC.split(f"### {section}\n", 1)[1] if f"### {section}\n" in DOC else DOC.split(f"## {section}\n", 1)[1]
    body = body.split("\n## ", 1)[0]
    chosen = "".join(m.group(0) for m in re.finditer(rf"(?ms)^([{steps}])\. .*?(?=^\d\. |^\S|\Z)", body))
    return [p for p in re.findall(r"`([\w./<>-]+\.(?:py|sql))`", chosen) if "/" in p]


def matches(path: str, named: list[str]) -> bool:
    return any(fnmatch.fnmatch(path, re.sub(r"<[^>]+>|NNNN", "*", n)) for n in named)


# a kind that claims the CPU waits of a step as a noisy neighbour (more specific than cpu_contention)
FAMILY_MODULE = '''
from store.analysis.kinds.family import Facts, Family, Kind, RuleContext
from store.units import ms


def candidates(ctx: RuleContext) -> list[dict]:
    waits = [r for r in ctx.rows if r["cause"] == "cpu_wait"]
    if not waits:
        return []
    return [{"kind": "noisy_neighbour", "dur_ns": sum(r["dur_ns"] for r in waits),
             "excess_dur_ns": sum(r["excess_dur_ns"] for r in waits), "who": waits[0]["detail"]}]


def noisy_neighbour(f: Facts) -> None:
    f.facts["summary"] = f"noisy neighbour: {f.cand['who']} took {ms(f.dur)} of CPU"
    f.path = ["runnable", "neighbour ran"]
    f.context["who"] = f.cand["who"]


FAMILY = Family(name="neighbours", kinds=(Kind("noisy_neighbour", noisy_neighbour),), whole=candidates,
                actions={"noisy_neighbour": ["Move {who} elsewhere"]})
'''

TOOL = '''

def step_count(store: Store, session_id: int | None = None) -> dict:
    """How many steps the recording marks."""
    return {"steps": store.one("SELECT count(*) AS n FROM step_mark")["n"]}


TOOLS = (*TOOLS, ToolDef(step_count, models.StepCount))
'''

PROBE = '''
import json, sys
import anyio
from mcp import Client
from recorder.demo import write_scenario
from store.db import open_store
from store.report.build import explain
from mcp_server.server import build_server
import mcp_server.tools as tools

db = sys.argv[1]
sid = write_scenario("cpu-contention", db)
with open_store(db, readonly=True) as store:
    report = explain(store, sid)

async def serve():
    async with Client(build_server(db)) as c:
        names = [t.name for t in (await c.list_tools()).tools]
        got = await c.call_tool("step_count", {})
        return names, got.structured_content
names, counted = anyio.run(serve)
print(json.dumps({"cause": report["primary_cause"], "tools": names, "counted": counted,
                  "registry": [t.fn.__name__ for t in tools.TOOLS], "where": tools.__file__}))
'''


@pytest.fixture(scope="module")
def copy(tmp_path_factory) -> tuple[Path, dict[str, str]]:
    """A copy of the packages with a cause kind and an MCP tool added by their checklists: the
    report and the tool list of a demo recording there, and the files touched."""
    tree = tmp_path_factory.mktemp("tree")
    for name in ("recorder", "store", "mcp_server", "bpf"):
        shutil.copytree(ROOT / name, tree / name, ignore=shutil.ignore_patterns("__pycache__"))
    touched = {
        "store/analysis/kinds/neighbours.py": FAMILY_MODULE,
        "store/migrations/9001_noisy_neighbour.sql":
            "INSERT INTO cause_kind (kind, specificity) VALUES ('noisy_neighbour', 10);\n",
    }
    init = (tree / "store/analysis/kinds/__init__.py").read_text()
    touched["store/analysis/kinds/__init__.py"] = init.replace(
        "from store.analysis.kinds import cpu,", "from store.analysis.kinds import neighbours\n"
        "from store.analysis.kinds import cpu,").replace(
        "waits.FAMILY)", "waits.FAMILY, neighbours.FAMILY)")
    touched["mcp_server/tools.py"] = (tree / "mcp_server/tools.py").read_text() + TOOL
    touched["mcp_server/models.py"] = (tree / "mcp_server/models.py").read_text() + (
        "\n\nclass StepCount(Result):\n    steps: int\n")
    for path, text in touched.items():
        (tree / path).write_text(text)
    out = subprocess.run([sys.executable, "-c", PROBE, str(tree / "r.db")], cwd=tree, capture_output=True,
                         text=True, timeout=120, env={"PYTHONPATH": str(tree), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.splitlines()[-1])
    assert result["where"] == str(tree / "mcp_server/tools.py")  # the copy ran, not the tree
    return result, touched


def test_a_kind_added_by_the_checklist_is_the_reports_cause(copy) -> None:
    result, touched = copy
    named = named_files("Adding a cause kind", "12")
    assert named, "the checklist names no file"
    for path in touched:
        if path.startswith("store/"):
            assert matches(path, named), f"{path} is not named by 'Adding a cause kind': {named}"
    cause = result["cause"]
    assert cause["kind"] == "noisy_neighbour" and cause["summary"].startswith("noisy neighbour: ffmpeg (pid 31337)")
    assert cause["next_actions"] == ["Move ffmpeg (pid 31337) elsewhere"]
    assert cause["kernel_path"] == ["runnable", "neighbour ran"]


def test_a_tool_added_by_the_checklist_is_published(copy) -> None:
    result, touched = copy
    named = named_files("Adding an MCP tool", "123")
    for path in touched:
        if path.startswith("mcp_server/"):
            assert matches(path, named), f"{path} is not named by 'Adding an MCP tool': {named}"
    assert result["tools"] == result["registry"] and result["tools"][-1] == "step_count"
    assert result["counted"] == {"steps": 60}


def test_every_kind_is_declared_once_with_a_specificity_and_actions(tmp_path: Path) -> None:
    declared = [k.name for f in FAMILIES for k in f.kinds]
    assert len(declared) == len(set(declared)) == len(KINDS)
    db = tmp_path / "k.db"
    write_scenario("healthy", db)
    with open_store(db, readonly=True) as store:
        rule = cause_rule(store)
    assert set(rule.specificity) == set(KINDS)  # every row of cause_kind is a kind, and every kind a row
    assert set(rule.event_cause.values()) <= set(KINDS)
    assert all(k in STEP_ACTIONS for k in KINDS)
    assert {k for f in FAMILIES for k in f.actions} - set(KINDS) == {
        "cpu_contention_same_process", "cpu_contention_job", "cpu_contention_job_worker", "cpu_contention_recorder",
        "slow_cuda_call_once"}


def test_the_server_publishes_exactly_the_registry_with_the_reports_schema(tmp_path: Path) -> None:
    db = tmp_path / "m.db"
    write_scenario("healthy", db)

    async def listed():
        async with Client(build_server(db)) as c:
            return (await c.list_tools()).tools
    tools = anyio.run(listed)
    assert [t.name for t in tools] == [t.fn.__name__ for t in TOOLS]
    schema = next(t for t in tools if t.name == "explain_stall").output_schema
    # the report's model (both modes), as marked: its fields and their descriptions
    steps = schema["$defs"]["StepReport"]["properties"]
    assert {"primary_cause", "breakdown", "negatives", "next_actions", "mode", "session", "window"} <= set(steps)
    assert {"findings", "cuda", "waits"} <= set(schema["$defs"]["CallReport"]["properties"])
    assert schema["$defs"]["PrimaryCause"]["properties"]["dur_ns"]["description"] == \
        "ns of the step this cause accounts for"
