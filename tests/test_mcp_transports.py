"""The server as users start it: `recorder mcp` over real stdio and over real HTTPS (a self-signed
certificate made here), a bearer token that is required, refusals to start unsafely, and independent
clients when they are available: the MCP Inspector's CLI (run with npx) and Claude Code's `claude mcp`
commands, driven with the README's own set-up lines."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import socket
import ssl
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import anyio
import httpx2
import pytest
from mcp import Client, StdioServerParameters
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPDeprecationWarning
from test_mcp_recording import make_recording

from mcp_server import untrusted
from mcp_server.https import build_app

ROOT = Path(__file__).resolve().parent.parent
RECORDER = [sys.executable, "-m", "recorder"]
TOOL_COUNT = 15  # the recording tools and cluster_explain


@pytest.fixture(scope="module")
def db(tmp_path_factory) -> Path:
    return make_recording(tmp_path_factory.mktemp("mcp") / "r.db")


def cli_explain(db: Path) -> dict:
    out = subprocess.run([*RECORDER, "explain", "--db", str(db), "--json"], capture_output=True, text=True,
                         check=True, cwd=ROOT).stdout
    return json.loads(out)


async def exercise(client: Client) -> tuple[list[str], dict]:
    async with client as c:
        names = [t.name for t in (await c.list_tools()).tools]
        result = await c.call_tool("explain_stall", {})
        assert not result.is_error
        for name, args in (("capabilities", {}), ("top_stalls", {}), ("kernel_log", {}), ("list_steps", {}),
                           ("python_lines", {}), ("io_latency", {}), ("nccl_collectives", {}),
                           ("evidence", {"kind": "cuda_call", "id": "8"}),
                           ("run_sql", {"sql": "SELECT 9007199254740993"})):
            r = await c.call_tool(name, args)
            assert not r.is_error, name
            assert r.structured_content is not None, name
        sql = await c.call_tool("run_sql", {"sql": "SELECT 9007199254740993"})
        assert sql.structured_content["rows"] == [[{"integer": 9007199254740993, "text": "9007199254740993"}]]
        return names, result.structured_content


def test_stdio_subprocess_lists_tools_and_matches_recorder_explain(db):
    params = StdioServerParameters(command=sys.executable, args=["-m", "recorder", "mcp", "--db", str(db)],
                                   cwd=str(ROOT))
    names, report = anyio.run(exercise, Client(params))
    assert len(names) == TOOL_COUNT
    assert untrusted.unmark(report) == cli_explain(db)


def test_stdio_answers_every_request_written_before_the_input_ends(db):
    """A client that writes its requests and closes its end (`printf ... | recorder mcp`): every
    request read gets its answer before the server exits, however long its queries take."""
    init = {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
        "protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "pipe", "version": "1"}}}
    slow = ("WITH RECURSIVE r(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM r LIMIT 300000) "
            "SELECT count(*) AS n FROM r")
    requests = [init, {"jsonrpc": "2.0", "method": "notifications/initialized"},
                *({"jsonrpc": "2.0", "id": i, "method": "tools/call",
                   "params": {"name": "run_sql", "arguments": {"sql": slow}}} for i in range(2, 8)),
                {"jsonrpc": "2.0", "id": 8, "method": "tools/list"}]
    res = subprocess.run([*RECORDER, "mcp", "--db", str(db)], input="".join(json.dumps(r) + "\n" for r in requests),
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    replies = {m["id"]: m for m in map(json.loads, res.stdout.splitlines()) if "id" in m}
    assert sorted(replies) == list(range(1, 9)), (sorted(replies), res.stderr[-2000:])
    for i in range(2, 8):
        rows = replies[i]["result"]["structuredContent"]["rows"]
        assert rows == [[300000]], rows
    assert len(replies[8]["result"]["tools"]) == TOOL_COUNT


def test_stdio_on_a_demo_recording_every_tool_and_the_step_report(tmp_path):
    """A synthetic recording of an NVMe timeout (recorder demo): every tool answers over real stdio,
    and explain_stall(step=...) is `recorder explain --step ... --json`."""
    db = tmp_path / "demo.db"
    subprocess.run([*RECORDER, "demo", "--no-gpu", "nvme-timeout-checkpoint", "--db", str(db)], check=True,
                   capture_output=True, cwd=ROOT)
    params = StdioServerParameters(command=sys.executable, args=["-m", "recorder", "mcp", "--db", str(db)],
                                   cwd=str(ROOT))
    calls = [("list_sessions", {}), ("capabilities", {}), ("list_steps", {}), ("top_stalls", {}),
             ("python_lines", {}), ("io_latency", {}), ("nvme_events", {}), ("kernel_log", {}),
             ("nccl_collectives", {}), ("evidence", {"kind": "kernel_log", "id": 1}),
             ("run_sql", {"sql": "SELECT count(*) AS n FROM stall"})]

    async def go() -> dict:
        async with Client(params) as c:
            assert len((await c.list_tools()).tools) == TOOL_COUNT
            for name, args in calls:
                assert not (await c.call_tool(name, args)).is_error, name
            result = await c.call_tool("explain_stall", {"step": 80042})
            assert not result.is_error
            return result.structured_content
    report = untrusted.unmark(anyio.run(go))
    out = subprocess.run([*RECORDER, "explain", "--db", str(db), "--step", "80042", "--json"], capture_output=True,
                         text=True, check=True, cwd=ROOT).stdout
    assert report == json.loads(out)
    assert report["primary_cause"]["kind"] == "nvme_timeout"


# -- HTTPS ----------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def tls(tmp_path_factory) -> dict[str, Path]:
    if not shutil.which("openssl"):
        pytest.skip("needs the openssl command to make a self-signed certificate")
    d = tmp_path_factory.mktemp("tls")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost",
                    "-keyout", str(d / "key.pem"), "-out", str(d / "cert.pem")], check=True, capture_output=True)
    token = d / "token"
    token.write_text("t0k3n-" + "a" * 40 + "\n")
    token.chmod(0o600)
    return {"cert": d / "cert.pem", "key": d / "key.pem", "token": token}


@pytest.fixture(scope="module")
def https_server(db, tls):
    port = free_port()
    proc = subprocess.Popen([*RECORDER, "mcp", "--db", str(db), "--http", f"127.0.0.1:{port}", "--certfile",
                             str(tls["cert"]), "--keyfile", str(tls["key"]), "--token-file", str(tls["token"])],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60  # its start on a loaded machine (make test runs two test files at once)
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            break
        except OSError:
            if proc.poll() is not None:
                raise AssertionError(f"recorder mcp --http exited: {proc.stderr.read()}") from None
            if time.monotonic() > deadline:
                proc.kill()
                raise AssertionError("recorder mcp --http did not listen within 60 s") from None
            time.sleep(0.1)
    yield f"https://127.0.0.1:{port}/mcp"
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError("recorder mcp --http did not stop within 10 s of SIGTERM") from None


def tls_context(tls) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=str(tls["cert"]))


def test_https_with_the_token_lists_tools_and_matches_recorder_explain(db, tls, https_server):
    token = tls["token"].read_text().strip()
    http = httpx2.AsyncClient(verify=tls_context(tls), headers={"Authorization": f"Bearer {token}"})
    names, report = anyio.run(exercise, Client(streamable_http_client(https_server, http_client=http)))
    assert len(names) == TOOL_COUNT
    assert untrusted.unmark(report) == cli_explain(db)


INIT = {"jsonrpc": "2.0", "id": 1, "method": "initialize",
        "params": {"protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}}}
HEADERS = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json"}


def test_https_without_or_with_a_wrong_token_is_401(tls, https_server):
    with httpx2.Client(verify=tls_context(tls)) as http:
        none = http.post(https_server, json=INIT, headers=HEADERS)
        wrong = http.post(https_server, json=INIT, headers={**HEADERS, "Authorization": "Bearer " + "b" * 46})
        token = tls["token"].read_text().strip()
        evil_host = http.post(https_server, json=INIT,
                              headers={**HEADERS, "Authorization": f"Bearer {token}", "Host": "evil.example:443"})
        evil_origin = http.post(https_server, json=INIT, headers={**HEADERS, "Authorization": f"Bearer {token}",
                                                                  "Origin": "https://evil.example"})
    assert none.status_code == 401 and none.headers["www-authenticate"].startswith("Bearer")
    assert "bearer token required" in none.json()["error_description"]
    assert "bearer token required" in none.headers["www-authenticate"]
    assert "resource_metadata" not in none.headers["www-authenticate"]  # no OAuth to discover
    assert wrong.status_code == 401
    assert evil_host.status_code == 421
    assert evil_origin.status_code == 403


def test_https_advertises_no_oauth_and_a_client_without_the_token_is_told_to_send_it(tls, https_server):
    """No authorization server exists, so none is advertised: a client that finds no token gets
    "bearer token required", not a failed OAuth dynamic client registration."""
    base = https_server.rsplit("/mcp", 1)[0]
    token = tls["token"].read_text().strip()
    with httpx2.Client(verify=tls_context(tls)) as http:
        for path in ("/.well-known/oauth-protected-resource", "/.well-known/oauth-protected-resource/mcp",
                     "/.well-known/oauth-authorization-server", "/register"):
            assert http.get(base + path).status_code == 401, path
            assert http.get(base + path, headers={"Authorization": f"Bearer {token}"}).status_code == 404, path

    async def no_token() -> str:
        http = httpx2.AsyncClient(verify=tls_context(tls))
        try:
            async with Client(streamable_http_client(https_server, http_client=http)) as c:
                await c.list_tools()
        except BaseException as e:  # noqa: BLE001 - an exception group from the transport's task group
            return repr(e)
        return "connected"
    outcome = anyio.run(no_token)
    assert outcome != "connected" and "registration" not in outcome.lower(), outcome


def test_https_server_starts_without_sdk_deprecation_warnings(db):
    """The token is checked by the server's own middleware, not the SDK's OAuth resource-server
    support (whose unset `validate_token_resource` warns at every start): no deprecation warning."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", MCPDeprecationWarning)
        build_app(db, "127.0.0.1", free_port(), "t0k3n-" + "a" * 40)


def test_http_refuses_to_start_without_a_usable_token(db, tls):
    common = ["mcp", "--db", str(db), "--certfile", str(tls["cert"]), "--keyfile", str(tls["key"])]
    env = {k: v for k, v in os.environ.items() if k != "STALL_RECORDER_MCP_TOKEN"}
    for address in ("10.1.2.3:8765", "127.0.0.1:8765"):
        r = subprocess.run([*RECORDER, *common, "--http", address], capture_output=True, text=True, cwd=ROOT,
                           env=env, timeout=60)
        assert r.returncode == 2 and "without a bearer token" in r.stderr, r.stderr
    loose = tls["token"].with_name("loose")
    loose.write_text("x" * 40)
    loose.chmod(0o644)
    r = subprocess.run([*RECORDER, *common, "--http", "127.0.0.1:8765", "--token-file", str(loose)],
                       capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert r.returncode == 2 and "chmod 600" in r.stderr
    for address in ("0.0.0.0:8765", "0:8765", "000.000.000.000:8765", "[::0]:8765", "[::]:8765",
                    "[0:0:0:0:0:0:0:0]:8765"):
        r = subprocess.run([*RECORDER, *common, "--http", address, "--token-file", str(tls["token"])],
                           capture_output=True, text=True, cwd=ROOT, timeout=60)
        assert r.returncode == 2 and "--allow-host" in r.stderr, (address, r.stderr)


def test_http_refuses_a_bad_certificate_or_key_in_one_line(db, tls, tmp_path):
    other = tmp_path / "other-key.pem"
    subprocess.run(["openssl", "genrsa", "-out", str(other), "2048"], check=True, capture_output=True)
    junk = tmp_path / "junk.pem"
    junk.write_text("-----BEGIN CERTIFICATE-----\nnot base64 at all\n-----END CERTIFICATE-----\n")
    for cert, key in ((junk, tls["key"]), (tls["cert"], junk), (tls["cert"], other), (tls["key"], tls["cert"])):
        r = subprocess.run([*RECORDER, "mcp", "--db", str(db), "--http", f"127.0.0.1:{free_port()}", "--certfile",
                            str(cert), "--keyfile", str(key), "--token-file", str(tls["token"])],
                           capture_output=True, text=True, cwd=ROOT, timeout=60)
        assert r.returncode == 2, r.stderr
        assert "Traceback" not in r.stderr and r.stderr.count("\n") == 1 and "--certfile" in r.stderr, r.stderr


# -- a second, independent client -----------------------------------------------------------------
INSPECTOR = "@modelcontextprotocol/inspector"


def test_mcp_inspector_cli_lists_and_calls_tools(db):
    """Interoperability with the MCP Inspector (TypeScript SDK). It is fetched by npx on first use;
    offline without a cached copy, or without node, this skips with the reason."""
    npx = shutil.which("npx")
    if npx is None:
        pytest.skip("needs node's npx to run the MCP Inspector CLI")
    base = [npx, "-y", INSPECTOR, "--cli", sys.executable, "-m", "recorder", "mcp", "--db", str(db)]
    try:
        listed = subprocess.run([*base, "--method", "tools/list"], capture_output=True, text=True, timeout=180,
                                cwd=ROOT)
    except subprocess.TimeoutExpired:
        pytest.skip("the MCP Inspector could not be fetched within 180 s (offline?)")
    if listed.returncode != 0 and ("ENOTFOUND" in listed.stderr or "EAI_AGAIN" in listed.stderr
                                   or "network" in listed.stderr.lower()):
        pytest.skip(f"the MCP Inspector is not cached and cannot be fetched: {listed.stderr.strip()[-200:]}")
    assert listed.returncode == 0, listed.stderr
    tools = json.loads(listed.stdout)["tools"]
    assert len(tools) == TOOL_COUNT and all(t["annotations"]["readOnlyHint"] for t in tools)
    called = subprocess.run([*base, "--method", "tools/call", "--tool-name", "top_stalls", "--tool-arg", "limit=3"],
                            capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert called.returncode == 0, called.stderr
    result = json.loads(called.stdout)
    assert result["structuredContent"]["stalls"][0]["cuda_call_id"] == 8


# -- the README's client set-up, run as a new user would --------------------------------------------
README = ROOT / "README.md"
README_RECORDER = "/path/to/stall-recorder/.venv/bin/recorder"
README_DB = "/abs/path/run.db"
README_URL = "https://127.0.0.1:8765/mcp"
CLAUDE_STATUS = re.compile(r"^(?P<name>[\w.-]+): .* - (?P<status>✔ Connected|✘ Failed to connect|.+)$", re.M)


def readme_mcp_section() -> str:
    text = README.read_text()
    return text[text.index("## Ask an assistant (MCP)"):text.index("## Development")]


def readme_command(prefix: str) -> list[str]:
    """A command line from the README's MCP section (joined over backslash continuations), as argv."""
    lines = [ln.strip() for ln in readme_mcp_section().splitlines()]
    i = next(i for i, ln in enumerate(lines) if ln.startswith(prefix))
    text = lines[i]
    while text.endswith("\\"):
        i += 1
        text = text[:-1] + " " + lines[i]
    return shlex.split(text)


def installed_recorder() -> Path:
    """The `recorder` script of the environment running the tests, standing for the README's path."""
    script = Path(sys.executable).parent / "recorder"
    if not script.is_file():
        pytest.skip(f"needs the recorder script next to {sys.executable} (pip install -e .)")
    return script


def test_readme_cursor_snippet_is_json_and_its_command_serves_the_recording(db):
    """The `.cursor/mcp.json` snippet (Cursor's documented `mcpServers` / `command` / `args` shape) parses,
    and the command it names, with the placeholders filled in, answers over real stdio."""
    section = readme_mcp_section()
    start = section.index("{", section.index(".cursor/mcp.json"))
    snippet, _ = json.JSONDecoder().raw_decode(section[start:])
    server = snippet["mcpServers"]["stall-recorder"]
    assert server["command"] == README_RECORDER and README_DB in server["args"]
    args = [str(db) if a == README_DB else a for a in server["args"]]
    params = StdioServerParameters(command=str(installed_recorder()), args=args, cwd=str(db.parent))

    async def go() -> int:
        async with Client(params) as c:
            return len((await c.list_tools()).tools)
    assert anyio.run(go) == TOOL_COUNT


needs_claude = pytest.mark.skipif(shutil.which("claude") is None, reason=(
    "needs the Claude Code CLI on PATH (npm install @anthropic-ai/claude-code; add node_modules/.bin to PATH)"))


@pytest.fixture
def claude(tmp_path) -> Callable[..., subprocess.CompletedProcess]:
    """Runs the Claude Code CLI (`claude`, the npm registry package @anthropic-ai/claude-code) with a
    temporary HOME, in a temporary project folder. `claude mcp add/list/get` need no account and no
    network: `list` and `get` start each server and report whether it connected."""
    binary = shutil.which("claude")
    assert binary is not None
    home, project = tmp_path / "home", tmp_path / "project"
    home.mkdir()
    project.mkdir()
    base = {k: v for k, v in os.environ.items()
            if not k.startswith(("CLAUDE", "ANTHROPIC", "NODE_EXTRA_CA_CERTS", "STALL_RECORDER_MCP_TOKEN"))}
    base.update(HOME=str(home), CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1", DISABLE_AUTOUPDATER="1")

    def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        return subprocess.run([binary, *args], capture_output=True, text=True, timeout=120, cwd=project,
                              env={**base, **(env or {})}, stdin=subprocess.DEVNULL)
    return run


def statuses(listed: subprocess.CompletedProcess) -> dict[str, str]:
    assert listed.returncode == 0, listed.stderr
    return {m["name"]: m["status"] for m in CLAUDE_STATUS.finditer(listed.stdout)}


@needs_claude
def test_claude_code_adds_the_stdio_server_with_the_readme_command(db, claude, tmp_path):
    argv = [str(installed_recorder()) if a == README_RECORDER else str(db) if a == README_DB else a
            for a in readme_command("claude mcp add stall-recorder --")]
    added = claude(*argv[1:])
    assert added.returncode == 0 and "Added stdio MCP server stall-recorder" in added.stdout, added.stderr
    # a control that must fail, so that "Connected" is known to mean the server answered
    claude("mcp", "add", "missing-db", "--", str(installed_recorder()), "mcp", "--db", str(tmp_path / "none.db"))
    assert statuses(claude("mcp", "list")) == {"stall-recorder": "✔ Connected", "missing-db": "✘ Failed to connect"}
    got = claude("mcp", "get", "stall-recorder")
    assert "Status: ✔ Connected" in got.stdout and "Scope: Local config" in got.stdout, got.stdout
    without_separator = claude("mcp", "add", "x", str(installed_recorder()), "mcp", "--db", str(db))
    assert without_separator.returncode != 0 and "unknown option '--db'" in without_separator.stderr


@needs_claude
def test_claude_code_over_https_with_the_token_from_the_environment(tls, https_server, claude, tmp_path):
    """The README's HTTPS set-up: the header names ${STALL_RECORDER_MCP_TOKEN}, so the token is not
    written to Claude Code's configuration; the self-signed certificate is trusted through
    NODE_EXTRA_CA_CERTS and refused without it."""
    argv = [https_server if a == README_URL else a for a in readme_command("claude mcp add --transport http")]
    assert argv[-1] == "Authorization: Bearer ${STALL_RECORDER_MCP_TOKEN}"
    token = tls["token"].read_text().strip()
    added = claude(*argv[1:])
    assert added.returncode == 0 and "Added HTTP MCP server stall-recorder-https" in added.stdout, added.stderr
    claude("mcp", "add", "--transport", "http", "wrong-token", https_server,
           "--header", "Authorization: Bearer " + "b" * 64)
    trusted = {"STALL_RECORDER_MCP_TOKEN": token, "NODE_EXTRA_CA_CERTS": str(tls["cert"])}
    assert statuses(claude("mcp", "list", env=trusted)) == {"stall-recorder-https": "✔ Connected",
                                                           "wrong-token": "✘ Failed to connect"}
    untrusted_cert = statuses(claude("mcp", "list", env={"STALL_RECORDER_MCP_TOKEN": token}))
    assert untrusted_cert["stall-recorder-https"] == "✘ Failed to connect"
    assert token not in (tmp_path / "home" / ".claude.json").read_text()


def test_slow_header_connections_are_capped_and_closed_and_a_real_client_gets_through(tls, https_server):
    """Connections that finish the TLS handshake and then send their headers slowly never reach the
    token check: at most MAX_WAITING wait at once (the one waiting longest is closed), each for at
    most HEADER_TIMEOUT_S, and a real client is answered meanwhile."""
    from mcp_server.https import HEADER_TIMEOUT_S, MAX_WAITING

    port = int(https_server.rsplit(":", 1)[1].split("/")[0])
    ctx = tls_context(tls)
    slow = []
    for _ in range(MAX_WAITING + 36):
        raw = socket.create_connection(("127.0.0.1", port), timeout=10)
        conn = ctx.wrap_socket(raw, server_hostname="127.0.0.1")
        conn.sendall(b"POST /mcp HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # and never the rest
        slow.append(conn)
    time.sleep(0.5)

    def closed(conn) -> bool:
        conn.settimeout(0.05)
        try:
            return conn.recv(1) == b""
        except (TimeoutError, ssl.SSLWantReadError):
            return False
        except (ssl.SSLError, OSError):
            return True

    assert sum(map(closed, slow)) >= 36  # the oldest beyond the cap went at once
    token = tls["token"].read_text().strip()
    started = time.monotonic()
    with httpx2.Client(verify=ctx, headers={**HEADERS, "Authorization": f"Bearer {token}"}, timeout=10) as http:
        assert http.post(https_server, json=INIT).status_code == 200
    assert time.monotonic() - started < 5
    time.sleep(HEADER_TIMEOUT_S + 1)
    assert all(map(closed, slow))
    for conn in slow:
        conn.close()


def test_connections_still_in_the_tls_handshake_count_against_the_limit(tls, https_server):
    """Raw TCP connections that never send a ClientHello: they are counted with those waiting for
    their headers, so past MAX_WAITING the oldest are closed at once (the TLS layer used to hold
    each for a minute, uncounted), and a real client is answered meanwhile. (The deadline that
    closes the rest is HEADER_TIMEOUT_S from the connection, the same for both.)"""
    from mcp_server.https import MAX_WAITING

    port = int(https_server.rsplit(":", 1)[1].split("/")[0])
    silent = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(MAX_WAITING + 40)]
    time.sleep(0.5)

    def closed(conn: socket.socket) -> bool:
        conn.settimeout(0.05)
        try:
            return conn.recv(1) == b""
        except TimeoutError:
            return False
        except OSError:
            return True

    try:
        assert sum(map(closed, silent[:40])) == 40  # the oldest beyond the cap went at once
        assert not any(map(closed, silent[-MAX_WAITING // 2:]))  # the newest wait, within the limit
        ctx = tls_context(tls)
        token = tls["token"].read_text().strip()
        started = time.monotonic()
        with httpx2.Client(verify=ctx, headers={**HEADERS, "Authorization": f"Bearer {token}"}, timeout=10) as http:
            assert http.post(https_server, json=INIT).status_code == 200
        assert time.monotonic() - started < 5
    finally:
        for conn in silent:
            conn.close()
