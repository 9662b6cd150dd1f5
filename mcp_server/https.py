"""`recorder mcp --http`: the MCP server over HTTPS (streamable HTTP at /mcp) with a bearer token.

TLS is uvicorn's (the SDK's own runner has no TLS options). The token comes from a file (or
$STALL_RECORDER_MCP_TOKEN), never from the command line, and is required on every address: a request
without it, or with another, gets 401. Host and Origin headers are checked against allow-lists (the
bound address and, on loopback, localhost), which stops DNS-rebinding pages in a browser.
"""

from __future__ import annotations

import hmac
import ipaddress
import stat
from pathlib import Path

from mcp.server.auth.provider import AccessToken
from mcp.server.auth.settings import AuthSettings
from mcp.server.transport_security import TransportSecuritySettings

from mcp_server.server import build_server
from recorder.core.settings import Settings
from store.errors import UserError

TOKEN_ENV = Settings.variable("mcp_token")
MIN_TOKEN_CHARS = 16


class StaticTokenVerifier:
    """Accepts exactly one bearer token, compared in constant time."""

    def __init__(self, token: str) -> None:
        self._token = token.encode()

    async def verify_token(self, token: str) -> AccessToken | None:
        if hmac.compare_digest(token.encode(), self._token):
            return AccessToken(token=token, client_id="stall-recorder-user", scopes=[])
        return None


def parse_address(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise UserError(f"--http {text!r}: give HOST:PORT, e.g. 127.0.0.1:8765")
    return host, int(port)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def read_token(token_file: Path | None) -> str | None:
    if token_file is None:
        return Settings.from_environment(only=("mcp_token",)).mcp_token
    try:
        mode = token_file.stat().st_mode
        token = token_file.read_text().strip()
    except OSError as e:
        raise UserError(f"cannot read --token-file {token_file} ({e.strerror}): create it with "
                        f"'openssl rand -hex 32 > {token_file}; chmod 600 {token_file}'") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise UserError(f"--token-file {token_file} is readable by other users: chmod 600 {token_file}")
    return token


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
    public = extra_hosts[0] if host in ("0.0.0.0", "::") and extra_hosts else host
    base = f"https://{f'[{public}]' if ':' in public else public}:{port}"
    # The verifier accepts one configured token, which names no resource (RFC 8707): checking the
    # token's resource would refuse it (the SDK warns while this is unset; 3.0 turns it on by default).
    server = build_server(db, token_verifier=StaticTokenVerifier(token),
                          auth=AuthSettings(issuer_url=base, resource_server_url=f"{base}/mcp",
                                            validate_token_resource=False))
    return server.streamable_http_app(
        transport_security=TransportSecuritySettings(allowed_hosts=hosts, allowed_origins=origins), host=host)


def serve_https(db: Path, address: str, certfile: Path | None, keyfile: Path | None, token_file: Path | None,
                extra_hosts: list[str] | None = None) -> None:
    import uvicorn

    host, port = parse_address(address)
    if certfile is None or keyfile is None:
        raise UserError("--http needs --certfile and --keyfile (PEM): a self-signed pair for one host is "
                        "'openssl req -x509 -newkey rsa:2048 -nodes -days 365 -subj /CN=localhost "
                        "-keyout key.pem -out cert.pem'")
    for path in (certfile, keyfile):
        if not path.is_file():
            raise UserError(f"{path} does not exist: pass a PEM file")
    if host in ("0.0.0.0", "::") and not extra_hosts:
        raise UserError(f"binding {host} accepts any address: name the host clients will use with --allow-host NAME")
    app = build_app(db, host, port, read_token(token_file), extra_hosts)
    uvicorn.run(app, host=host, port=port, ssl_certfile=str(certfile), ssl_keyfile=str(keyfile),
                log_level="warning", timeout_graceful_shutdown=2)
