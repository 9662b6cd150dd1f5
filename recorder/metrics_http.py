"""`--metrics-listen HOST:PORT`: the recorder's metrics (recorder/metrics.py, recorder/workload_metrics.py)
served at /metrics for Prometheus to scrape, opt-in, bound to the address given.

On a loopback address it is plain HTTP and needs no token (a token file, when given, is still
required). Anywhere else the MCP server's HTTPS rules apply (mcp_server/access.py): TLS with
--metrics-certfile/--metrics-keyfile, and a bearer token from --metrics-token-file (mode 600, at
least 16 characters) on every request, compared in constant time; a request without it gets 401.
Prometheus sends it with `authorization: {credentials_file: ...}` (docs/deploy.md).

The server runs in threads of its own and only hands out the text the recorder's main loop last
rendered (`publish()`, once a second): a scrape never touches the database or the probes. Each
connection gets HEADER_TIMEOUT_S for its TLS handshake and its request (done in its own thread,
never in the accepting one) and at most MAX_CONNECTIONS are served at once; more are closed at
once, so connections that never send a request cannot starve Prometheus for long.
"""

from __future__ import annotations

import hmac
import socket
import ssl
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from mcp_server.access import (
    MIN_TOKEN_CHARS,
    addresses,
    check_tls,
    is_loopback,
    parse_address,
    read_token,
    server_tls,
)
from store.errors import UserError

HEADER_TIMEOUT_S = 10.0
MAX_CONNECTIONS = 32
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


@dataclass(frozen=True)
class ListenOptions:
    address: str
    token_file: Path | None = None
    certfile: Path | None = None
    keyfile: Path | None = None

    def check(self) -> tuple[str, int, str | None, ssl.SSLContext | None]:
        """(host, port, token, TLS context), or a one-line error before anything starts."""
        host, port = parse_address(self.address, "--metrics-listen")
        addresses(host)  # an address this machine cannot bind is refused here
        loopback = is_loopback(host)
        token = read_token(self.token_file, None, "--metrics-token-file")
        if token is not None and len(token) < MIN_TOKEN_CHARS:
            raise UserError(f"the --metrics-token-file token is shorter than {MIN_TOKEN_CHARS} characters: make "
                            "one with 'openssl rand -hex 32'")
        if (self.certfile is None) != (self.keyfile is None):
            raise UserError("--metrics-certfile and --metrics-keyfile go together (PEM certificate and its key)")
        if not loopback:
            if token is None:
                raise UserError(f"refusing to serve metrics on {host}, which is not a loopback address, without a "
                                "bearer token: pass --metrics-token-file FILE (chmod 600)")
            if self.certfile is None:
                raise UserError(f"refusing to serve metrics on {host}, which is not a loopback address, without "
                                "TLS: pass --metrics-certfile and --metrics-keyfile (PEM)")
        tls = None
        if self.certfile is not None and self.keyfile is not None:
            for path in (self.certfile, self.keyfile):
                if not path.is_file():
                    raise UserError(f"{path} does not exist: pass a PEM file")
            check_tls(self.certfile, self.keyfile, ("--metrics-certfile", "--metrics-keyfile"))
            tls = server_tls(self.certfile, self.keyfile)
        return host, port, token, tls


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False

    def __init__(self, address: tuple[str, int], token: str | None, tls: ssl.SSLContext | None) -> None:
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        self.token = token.encode() if token else None
        self.tls = tls
        self.text = b""
        self.slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self.scrapes = 0
        super().__init__(address, _Handler)

    def process_request(self, request, client_address) -> None:  # noqa: ANN001 - socketserver's signature
        if not self.slots.acquire(blocking=False):  # too many connections at once: this one goes
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request, client_address) -> None:  # noqa: ANN001
        try:
            request.settimeout(HEADER_TIMEOUT_S)
            if self.tls is not None:  # the handshake in this connection's thread, under its deadline
                try:
                    request = self.tls.wrap_socket(request, server_side=True)
                except (OSError, ssl.SSLError):
                    self.shutdown_request(request)
                    return
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release()


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    timeout = HEADER_TIMEOUT_S
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the base class's name
        pass  # a scrape a second is not worth a log line

    def _send(self, status: int, body: bytes, content_type: str = "text/plain; charset=utf-8",
              extra: tuple[tuple[str, str], ...] = ()) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for name, value in extra:
            self.send_header(name, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        token = self.server.token
        if token is not None:
            scheme, _, value = (self.headers.get("Authorization") or "").partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(value.strip().encode(), token):
                self._send(401, b"bearer token required: send 'Authorization: Bearer TOKEN' with the token of "
                                b"the recorder's --metrics-token-file\n",
                           extra=(("WWW-Authenticate", 'Bearer realm="stall-recorder"'),))
                return
        if self.path.split("?", 1)[0] != "/metrics":
            self._send(404, b"the metrics are at /metrics\n")
            return
        self.server.scrapes += 1
        self._send(200, self.server.text, CONTENT_TYPE)

    do_HEAD = do_GET  # noqa: N815


class MetricsListener:
    """The /metrics endpoint: start() binds (a one-line error if it cannot), publish() hands it the
    text to serve, close() stops it."""

    def __init__(self, options: ListenOptions) -> None:
        self.options = options
        self.host, self.port, self._token, self._tls = options.check()
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        try:
            self._server = _Server((self.host, self.port), self._token, self._tls)
        except OSError as e:
            raise UserError(f"--metrics-listen {self.options.address}: cannot bind ({e.strerror}): pass a free "
                            "port of an address of this machine") from None
        self.port = self._server.server_address[1]  # port 0: the one the kernel chose
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.5},
                                        name="stall-metrics-http", daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{'https' if self._tls else 'http'}://{host}:{self.port}/metrics"

    def publish(self, text: str) -> None:
        if self._server is not None:
            self._server.text = text.encode()

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
