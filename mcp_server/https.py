"""`recorder mcp --http`: the MCP server over HTTPS (streamable HTTP at /mcp) with a bearer token.

uvicorn serves HTTP (the SDK's own runner has no TLS options); the TLS handshake is the server's
own, on each accepted connection, so that connections still in it are bounded too. The token comes from a file (or
$STALL_RECORDER_MCP_TOKEN), never from the command line, and is required on every address and path: a
request without it, or with another, gets 401 with a body and a WWW-Authenticate header that say
"bearer token required". No OAuth metadata is advertised (there is no authorization server: a client
that looked for one would fail at dynamic client registration instead of asking for the token).
Host and Origin headers are checked against allow-lists (the bound address and, on loopback,
localhost), which stops DNS-rebinding pages in a browser. An address that binds every interface
(0.0.0.0, ::, and spellings of them such as 0, 000.000.000.000, [::0]) needs --allow-host.
"""

from __future__ import annotations

import hmac
import json
import ssl
from pathlib import Path
from typing import Any

from mcp.server.transport_security import TransportSecuritySettings

from mcp_server.access import (  # noqa: F401 - the access rules, shared with the recorder's /metrics
    MIN_TOKEN_CHARS,
    addresses,
    binds_everywhere,
    check_tls,
    is_loopback,
    parse_address,
    read_token,
    server_tls,
)
from mcp_server.server import build_server
from store.errors import UserError

TOKEN_ENV = "STALL_RECORDER_MCP_TOKEN"  # the caller reads it (recorder.core.settings: mcp_token)


TOKEN_REQUIRED = ("bearer token required: send 'Authorization: Bearer TOKEN' with the token this server "
                  "was started with (its --token-file or $STALL_RECORDER_MCP_TOKEN)")


class BearerAuth:
    """ASGI middleware: every HTTP request needs exactly the one configured token (compared in
    constant time); anything else gets 401 saying so."""

    def __init__(self, app: Any, token: str) -> None:
        self.app = app
        self._token = token.encode()

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        header = dict(scope.get("headers") or ()).get(b"authorization", b"")
        scheme, _, value = header.partition(b" ")
        if scheme.lower() == b"bearer" and hmac.compare_digest(value.strip(), self._token):
            await self.app(scope, receive, send)
            return
        wrong = bool(value.strip())
        description = "the bearer token is not this server's" if wrong else TOKEN_REQUIRED
        body = json.dumps({"error": "invalid_token", "error_description": description}).encode()
        await send({"type": "http.response.start", "status": 401, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
            (b"www-authenticate",
             f'Bearer realm="stall-recorder", error="invalid_token", error_description="{description}"'.encode())]})
        await send({"type": "http.response.body", "body": body})


def allowed(host: str, port: int, extra_hosts: list[str]) -> tuple[list[str], list[str]]:
    names = [host] if ":" not in host else [f"[{host}]"]
    if is_loopback(host):
        names += ["127.0.0.1", "localhost", "[::1]"]
    names += extra_hosts
    hosts = sorted({f"{n}:{port}" for n in names})
    origins = sorted({f"https://{h}" for h in hosts})
    return hosts, origins


def build_app(db: Path, host: str, port: int, token: str | None, extra_hosts: list[str] | None = None):
    """The ASGI app, after the checks that refuse to serve without a usable token."""
    if not token:
        where = "a loopback address" if is_loopback(host) else f"{host}, which is not a loopback address"
        raise UserError(f"refusing to serve on {where} without a bearer token: pass --token-file FILE "
                        f"(chmod 600) or set ${TOKEN_ENV}")
    if len(token) < MIN_TOKEN_CHARS:
        raise UserError(f"the bearer token is shorter than {MIN_TOKEN_CHARS} characters: "
                        "make one with 'openssl rand -hex 32'")
    hosts, origins = allowed(host, port, extra_hosts or [])
    server = build_server(db)
    app = server.streamable_http_app(
        transport_security=TransportSecuritySettings(allowed_hosts=hosts, allowed_origins=origins), host=host)
    return BearerAuth(app, token)


HEADER_TIMEOUT_S = 10.0  # a connection's TLS handshake and a request's headers are in within this of it
MAX_WAITING = 64  # connections in their handshake or with no request in yet: past this the oldest is closed


def header_deadline_protocol(tls: ssl.SSLContext) -> type:
    """uvicorn's HTTP/1.1 protocol behind a TLS handshake of its own, with a deadline on both: a
    connection that does not finish its handshake and send a request's headers within
    HEADER_TIMEOUT_S is closed, and at most MAX_WAITING connections are in their handshake or wait
    for their headers at once (the one waiting longest goes), so connections that never reach the
    token check (raw TCP connections that never say hello included) cannot take every file
    descriptor and starve a real client. The handshake is the server's own (asyncio's start_tls on
    the accepted connection): a listener given an SSL context would hide a connection from the
    protocol, and from this count, until its handshake is done."""
    import asyncio

    from uvicorn.protocols.http.h11_impl import H11Protocol

    waiting: dict[Any, None] = {}  # insertion order: the one waiting longest first

    def wait(conn: Any) -> None:
        waiting[conn] = None
        while len(waiting) > MAX_WAITING:
            next(iter(waiting))._too_slow()

    def done_waiting(conn: Any) -> None:
        """The connection's deadline cancelled and its place among the waiting given up."""
        if conn._deadline is not None:
            conn._deadline.cancel()
            conn._deadline = None
        waiting.pop(conn, None)

    class HeaderDeadline(H11Protocol):
        _deadline: Any = None

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._arm()

        def _arm(self) -> None:
            self._disarm()
            self._deadline = self.loop.call_later(HEADER_TIMEOUT_S, self._too_slow)
            wait(self)

        def _disarm(self) -> None:
            done_waiting(self)

        def _too_slow(self) -> None:
            self._disarm()
            self.transport.close()

        def handle_events(self) -> None:
            super().handle_events()
            if self.cycle is not None and not self.cycle.response_complete:  # a request's headers are in
                self._disarm()

        def on_response_complete(self) -> None:
            self._arm()  # the next request's headers, on a connection kept alive
            super().on_response_complete()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

    class Handshake(asyncio.Protocol):
        """An accepted TCP connection until its TLS handshake is done; then HeaderDeadline takes
        it over, for what is left of the same deadline's count (a new deadline for the headers)."""

        def __init__(self, **uvicorn_args: Any) -> None:
            self._args = uvicorn_args
            self._loop = uvicorn_args.get("_loop") or asyncio.get_event_loop()
            self._raw: Any = None
            self._deadline: Any = None
            self._task: Any = None
            self._http: HeaderDeadline | None = None
            self._early: list[bytes] = []  # what came after the handshake before HeaderDeadline took over
            self._eof = False
            self._lost = False

        def connection_made(self, transport: Any) -> None:
            self._raw = transport
            self._deadline = self._loop.call_later(HEADER_TIMEOUT_S, self._too_slow)
            wait(self)
            self._task = self._loop.create_task(self._handshake())

        async def _handshake(self) -> None:
            try:
                app_transport = await self._loop.start_tls(self._raw, self, tls, server_side=True,
                                                           ssl_handshake_timeout=HEADER_TIMEOUT_S)
            except Exception:  # noqa: BLE001 - a failed handshake (reset, timeout, not TLS) ends that connection only
                self._disarm()
                self._raw.abort()
                return
            self._disarm()
            if self._lost or app_transport is None:
                return
            http = self._http = HeaderDeadline(**self._args)
            app_transport.set_protocol(http)
            http.connection_made(app_transport)
            for data in self._early:
                http.data_received(data)
            if self._eof:
                http.eof_received()

        def _disarm(self) -> None:
            done_waiting(self)

        def _too_slow(self) -> None:
            self._disarm()
            if self._raw is not None:
                self._raw.abort()

        def data_received(self, data: bytes) -> None:
            if self._http is not None:
                self._http.data_received(data)
            else:
                self._early.append(data)

        def eof_received(self) -> None:
            if self._http is not None:
                self._http.eof_received()
            else:
                self._eof = True

        def connection_lost(self, exc: Exception | None) -> None:
            self._lost = True
            self._disarm()
            if self._http is not None:
                self._http.connection_lost(exc)

    return Handshake


def serve_https(db: Path, address: str, certfile: Path | None, keyfile: Path | None, token_file: Path | None,
                extra_hosts: list[str] | None = None, env_token: str | None = None) -> None:
    import uvicorn

    host, port = parse_address(address)
    if certfile is None or keyfile is None:
        raise UserError("--http needs --certfile and --keyfile (PEM): a self-signed pair for one host is "
                        "'openssl req -x509 -newkey rsa:2048 -nodes -days 365 -subj /CN=localhost "
                        "-keyout key.pem -out cert.pem'")
    for path in (certfile, keyfile):
        if not path.is_file():
            raise UserError(f"{path} does not exist: pass a PEM file")
    if binds_everywhere(host) and not extra_hosts:
        raise UserError(f"binding {host} accepts connections on every interface: name the host clients will "
                        "use with --allow-host NAME (or bind one address, e.g. 127.0.0.1)")
    check_tls(certfile, keyfile)
    app = build_app(db, host, port, read_token(token_file, env_token), extra_hosts)
    # TLS is done by the protocol (header_deadline_protocol), not by uvicorn's listener
    uvicorn.run(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=2,
                http=header_deadline_protocol(server_tls(certfile, keyfile)))
