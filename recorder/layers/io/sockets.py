"""Which recorded process owns a TCP connection.

A retransmission fires from a timer in softirq context, so the task running at the tracepoint is
rarely the socket's owner (matching retransmits to a wait by the running task finds them only when
the owner happened to be on the CPU). The connection's 4-tuple is in the event; its socket inode is
in the owner's network namespace (/proc/PID/net/tcp, tcp6) and the inode among the owner's open
files (/proc/PID/fd). Retransmits are rare, so the tables are read on a miss, not kept current.
"""

from __future__ import annotations

import ipaddress
import os
import time
from collections.abc import Callable

Conn = tuple[str, int, str, int]  # (saddr, sport, daddr, dport) as tcp_retransmit stores them
RETRY_NS = 500_000_000  # a connection not found is looked up again at most this often


def _addr(hexaddr: str) -> str:
    """An address of /proc/net/tcp{,6}: 32-bit words in host (little-endian) order."""
    raw = bytes.fromhex(hexaddr)
    raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    addr = ipaddress.ip_address(raw)
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        return str(addr.ipv4_mapped)
    return str(addr)


def connections(pid: int) -> dict[Conn, int]:
    """The TCP connections of pid's network namespace: 4-tuple -> socket inode."""
    out: dict[Conn, int] = {}
    for name in ("tcp", "tcp6"):
        try:
            with open(f"/proc/{pid}/net/{name}") as f:
                next(f, None)
                for line in f:
                    parts = line.split()
                    if len(parts) < 10:
                        continue
                    (la, lp), (ra, rp) = parts[1].split(":"), parts[2].split(":")
                    inode = int(parts[9])
                    if inode:
                        out[(_addr(la), int(lp, 16), _addr(ra), int(rp, 16))] = inode
        except (OSError, ValueError):
            continue
    return out


def socket_inodes(pid: int) -> set[int]:
    """Inodes of the sockets pid has open."""
    out: set[int] = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return out
    for fd in fds:
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            out.add(int(link[8:-1]))
    return out


class SocketOwners:
    """Connection -> the process row (process.id) of the recorded process that holds its socket.

    `processes` gives the recorded processes (pid -> process.id) when asked."""

    def __init__(self, processes: Callable[[], dict[int, int]]) -> None:
        self.processes = processes
        self._owner: dict[Conn, int | None] = {}
        self._missed: dict[Conn, int] = {}  # connection -> when it was last looked for in vain

    def owner(self, conn: Conn) -> int | None:
        if conn in self._owner:
            return self._owner[conn]
        now = time.monotonic_ns()
        if now - self._missed.get(conn, -RETRY_NS) < RETRY_NS:
            return None
        self._scan()
        found = self._owner.get(conn)
        if found is None:
            self._missed[conn] = now
            if len(self._missed) > 4096:
                self._missed.clear()
        return found

    def _scan(self) -> None:
        tables: dict[str, dict[Conn, int]] = {}  # network namespace -> its connections
        for pid, process_id in list(self.processes().items()):
            try:
                ns = os.readlink(f"/proc/{pid}/ns/net")
            except OSError:
                continue
            if ns not in tables:
                tables[ns] = connections(pid)
            inodes = socket_inodes(pid)
            if not inodes:
                continue
            for conn, inode in tables[ns].items():
                if inode in inodes:
                    self._owner[conn] = process_id
        if len(self._owner) > 65536:
            self._owner.clear()
