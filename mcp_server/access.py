"""Who may connect to a server of the recorder's, and how: the address rules, the bearer token and the
TLS pair that `recorder mcp --http` (mcp_server/https.py) and the recorder's own /metrics endpoint
(recorder/metrics_http.py) share. No MCP import here: the recorder loads this without the SDK."""

from __future__ import annotations

import ipaddress
import socket
import ssl
import stat
from pathlib import Path

from store.errors import UserError

MIN_TOKEN_CHARS = 16


def parse_address(text: str, option: str = "--http") -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise UserError(f"{option} {text!r}: give HOST:PORT, e.g. 127.0.0.1:8765")
    return host, int(port)


def addresses(host: str) -> list[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    """The addresses `host` binds, as the socket layer reads it ('0' and '000.000.000.000' are 0.0.0.0)."""
    if host == "localhost":
        return [ipaddress.ip_address("127.0.0.1")]
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as e:
        raise UserError(f"host {host!r} is not an address this machine can bind ({e}): "
                        "give an IP address, e.g. 127.0.0.1") from None
    return [ipaddress.ip_address(str(info[4][0]).split("%", 1)[0]) for info in infos]


def binds_everywhere(host: str) -> bool:
    return any(a.is_unspecified for a in addresses(host))


def is_loopback(host: str) -> bool:
    try:
        return all(a.is_loopback for a in addresses(host))
    except UserError:
        return False


def read_token(token_file: Path | None, env_token: str | None = None, option: str = "--token-file") -> str | None:
    """The token of --token-file, else `env_token` (${TOKEN_ENV}, read by the caller)."""
    if token_file is None:
        return env_token
    try:
        mode = token_file.stat().st_mode
        token = token_file.read_text().strip()
    except OSError as e:
        raise UserError(f"cannot read {option} {token_file} ({e.strerror}): create it with "
                        f"'openssl rand -hex 32 > {token_file}; chmod 600 {token_file}'") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise UserError(f"{option} {token_file} is readable by other users: chmod 600 {token_file}")
    return token


def check_tls(certfile: Path, keyfile: Path, options: tuple[str, str] = ("--certfile", "--keyfile")) -> None:
    """Load the pair as uvicorn will, so a bad file is a one-line error instead of a traceback."""
    try:
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(str(certfile), str(keyfile))
    except (ssl.SSLError, OSError, ValueError) as e:
        reason = getattr(e, "reason", None) or getattr(e, "strerror", None) or str(e)
        raise UserError(f"cannot use {options[0]} {certfile} with {options[1]} {keyfile} ({reason}): pass a PEM "
                        "certificate and its private key, e.g. from 'openssl req -x509 -newkey rsa:2048 -nodes "
                        "-days 365 -subj /CN=localhost -keyout key.pem -out cert.pem'") from None



def server_tls(certfile: Path, keyfile: Path) -> ssl.SSLContext:
    """The server's TLS context (the defaults of the ssl module for a server: TLS 1.2 and later)."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(str(certfile), str(keyfile))
    return context
