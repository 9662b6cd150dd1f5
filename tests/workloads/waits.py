"""Stalls whose cause is in another thread or process, each step marked with recorder.step(n).

    python waits.py chain --file F --cgroup-procs P [--steps 40] [--slow-step 25] [--big 1048576]
        The main process reads batches from a multiprocessing queue fed by a worker process
        ("loader-worker", moved into the blkio cgroup P) that reads each batch from F with O_DIRECT; at
        --slow-step the batch is --big bytes, which the cgroup's throttle queues for a while. With
        --big 4096 nothing is slow: the clean run.
    python waits.py gil [--steps 60] [--hog-step 30] [--hog-steps 10] [--no-markers]
        Each step sleeps 1 ms ten times (taking the GIL back each time); from --hog-step for
        --hog-steps steps a second thread ("gil-hog") runs a pure-Python loop holding the GIL, so each
        re-acquisition waits for it. At the end the main thread waits on a threading.Event another
        thread sets: a futex wait that is not the GIL's. --hog-steps 0: the clean run. --cruncher: a
        third thread ("cruncher") hashes a large buffer meanwhile, with the GIL released inside the
        hash: awake beside the hog, it must never be named the GIL's holder.
    python waits.py net --mode poll|recv|slow-server [--steps 40] [--slow-step 25]
        Run in a network namespace of its own (unshare -n): an echo server process on 127.0.0.1 and a
        client (the main thread) that sends a request per step and waits for the echo. At --slow-step:
        'poll'/'recv' drop every packet on lo (a tbf qdisc too small for any packet) for --drop-ms, so
        the request is retransmitted; the client socket has a timeout ('poll': it waits in poll()) or
        none ('recv': in recvfrom()). 'slow-server': no loss on the client's connection, the server
        sleeps --drop-ms before it answers, while another process (`waits.py noise`, in a namespace of
        its own) has connections that retransmit.

Prints one JSON line: the pids and thread ids involved and the source lines of the waits.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import mmap
import multiprocessing as mp
import os
import socket
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
import recorder  # noqa: E402

PR_SET_NAME = 15


def _name(name: bytes) -> None:
    ctypes.CDLL(None).prctl(PR_SET_NAME, ctypes.c_char_p(name), 0, 0, 0)


def _line(tag: str) -> int:
    """The line of this file that carries the comment `# <tag>`."""
    with open(__file__) as f:
        for i, text in enumerate(f, 1):
            if text.rstrip().endswith(f"# {tag}") and "_line(" not in text:
                return i
    raise ValueError(tag)


# -- a queue fed by a worker process that reads a throttled disk -------------------------------------
def _loader(queue, path: str, steps: int, slow_step: int, big: int, cgroup_procs: str) -> None:
    with open(cgroup_procs, "w") as f:  # only the worker is throttled
        f.write(str(os.getpid()))
    _name(b"loader-worker")
    buf = mmap.mmap(-1, max(big, 4096))  # page-aligned, as O_DIRECT wants
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    with os.fdopen(fd, "rb", buffering=0) as disk:
        offset = 0
        for step in range(steps):
            size = big if step == slow_step else 4096
            disk.seek(offset)
            disk.readinto(memoryview(buf)[:size])  # LOADER_READ
            offset += size
            queue.put(size)


def chain(a: argparse.Namespace) -> dict:
    ctx = mp.get_context("fork")
    queue = ctx.Queue(maxsize=1)
    worker = ctx.Process(target=_loader, args=(queue, a.file, a.steps, a.slow_step, a.big, a.cgroup_procs))
    worker.start()
    for step in range(a.steps):
        recorder.step(step)
        queue.get()  # QUEUE_GET
        time.sleep(0.02)  # the step's work
    recorder.step(a.steps)
    worker.join()
    return {"pid": os.getpid(), "tid": threading.get_native_id(), "worker_pid": worker.pid,
            "read_line": _line("LOADER_READ"), "get_line": _line("QUEUE_GET")}


# -- a thread holding the GIL -----------------------------------------------------------------------
def gil(a: argparse.Namespace) -> dict:
    out: dict = {"pid": os.getpid(), "tid": threading.get_native_id()}
    done = [False]

    def hog() -> None:
        _name(b"gil-hog")
        out["hog_tid"] = threading.get_native_id()
        x = 1
        while not done[0]:  # HOG_LOOP
            x = x * 3 % 1000003  # HOG_BODY
        out["hog_result"] = x

    hog_thread = threading.Thread(target=hog, name="gil-hog")

    def cruncher() -> None:
        _name(b"cruncher")
        out["cruncher_tid"] = threading.get_native_id()
        data = b"x" * (32 << 20)
        while not done[0]:
            hashlib.sha256(data).digest()  # CRUNCH: the GIL released for the whole hash

    crunch_thread = threading.Thread(target=cruncher, name="cruncher")
    for step in range(a.steps):
        if not a.no_markers:
            recorder.step(step)
        if a.hog_steps and step == a.hog_step:
            out["hog_start"] = time.monotonic_ns()
            hog_thread.start()
            if a.cruncher:
                crunch_thread.start()
        if a.hog_steps and step == a.hog_step + a.hog_steps:
            done[0] = True
            hog_thread.join()
            if a.cruncher:
                crunch_thread.join()
            out["hog_end"] = time.monotonic_ns()
        for _ in range(10):
            time.sleep(0.001)  # MAIN_SLEEP
    if not a.no_markers:
        recorder.step(a.steps)
    out["steps_end"] = time.monotonic_ns()
    # a futex wait that is not the GIL's: an Event set by another thread after 50 ms
    event = threading.Event()
    setter = threading.Thread(target=lambda: (time.sleep(0.05), event.set()), name="setter")
    setter.start()
    out["event_wait_start"] = time.monotonic_ns()
    event.wait()  # EVENT_WAIT
    out["event_wait_end"] = time.monotonic_ns()
    setter.join()
    out.update(hog_lines=[_line("HOG_LOOP"), _line("HOG_BODY")], sleep_line=_line("MAIN_SLEEP"),
               event_line=_line("EVENT_WAIT"))
    return out


# -- a client waiting for its peer behind retransmissions ----------------------------------------------
# Every packet on lo is dropped while a token bucket too small for any packet is its qdisc (tbf needs
# no classifier or netem module); only inside the workload's own network namespace.
DROP = ("qdisc", "add", "dev", "lo", "root", "tbf", "rate", "8bit", "burst", "100", "limit", "1")
UNDROP = ("qdisc", "del", "dev", "lo", "root")


def _tc(*args: str) -> None:
    subprocess.run(["tc", *args], check=True, capture_output=True)


def _serve(listener: socket.socket, delay_at: int, delay_s: float) -> None:
    _name(b"echo-server")
    conn, _ = listener.accept()
    n = 0
    while True:
        data = conn.recv(65536)
        if not data:
            return
        if n == delay_at:
            time.sleep(delay_s)  # SERVER_SLEEP
        conn.sendall(data)
        n += 1


def noise(a: argparse.Namespace) -> dict:
    """In a network namespace of its own: connections whose packets are lost (lo down), one sent on
    every 100 ms, so that they retransmit for --seconds. Prints 'ready' once connected."""
    _name(b"noise-sender")
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    conns = [socket.create_connection(listener.getsockname()) for _ in range(int(a.seconds * 10))]
    accepted = [listener.accept()[0] for _ in conns]
    print("ready", flush=True)
    # lo down: every segment is lost, and each connection retransmits on its timer
    subprocess.run(["ip", "link", "set", "lo", "down"], check=True)
    for c in conns:
        c.sendall(b"n" * 512)
        time.sleep(0.1)
    time.sleep(0.5)  # the recorder finds who owns a retransmitted connection while it is open
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    for c in conns + accepted:
        c.close()
    return {"pid": os.getpid(), "connections": len(conns)}


def net(a: argparse.Namespace) -> dict:
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)
    port = listener.getsockname()[1]
    slow_server = a.mode == "slow-server"
    server = mp.get_context("fork").Process(
        target=_serve, args=(listener, a.slow_step if slow_server else -1, a.drop_ms / 1000))
    server.start()
    client = socket.create_connection(("127.0.0.1", port))
    client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    client.settimeout(10 if a.mode in ("poll", "slow-server") else None)
    out: dict = {"pid": os.getpid(), "tid": threading.get_native_id(), "server_pid": server.pid,
                 "client": list(client.getsockname()), "server_port": port}
    other = None
    for step in range(a.steps):
        recorder.step(step)
        if slow_server and step == a.slow_step - 1:
            # another process's connections retransmit during the slow step, in their own namespace
            other = subprocess.Popen(["unshare", "-n", sys.executable, __file__, "noise", "--seconds", "2"],
                                     stdout=subprocess.PIPE, text=True)
            assert other.stdout is not None and other.stdout.readline().strip() == "ready"
            out["noise_pid"] = other.pid
        if step == a.slow_step:
            out["drop_start"] = time.monotonic_ns()
            if not slow_server:
                _tc(*DROP)
                threading.Timer(a.drop_ms / 1000, _tc, UNDROP).start()
        client.sendall(b"r" * 512)
        got = b""
        while len(got) < 512:
            got += client.recv(65536)  # CLIENT_RECV
        time.sleep(0.01)
    recorder.step(a.steps)
    client.close()
    server.join()
    if other is not None:
        other.wait()
    out.update(recv_line=_line("CLIENT_RECV"), server_line=_line("SERVER_SLEEP"))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="what", required=True)
    c = sub.add_parser("chain")
    c.add_argument("--file", required=True)
    c.add_argument("--cgroup-procs", required=True)
    c.add_argument("--steps", type=int, default=40)
    c.add_argument("--slow-step", type=int, default=25)
    c.add_argument("--big", type=int, default=1 << 20)
    g = sub.add_parser("gil")
    g.add_argument("--steps", type=int, default=60)
    g.add_argument("--hog-step", type=int, default=30)
    g.add_argument("--hog-steps", type=int, default=10)
    g.add_argument("--no-markers", action="store_true")
    g.add_argument("--cruncher", action="store_true")
    n = sub.add_parser("net")
    n.add_argument("--mode", choices=("poll", "recv", "slow-server"), required=True)
    n.add_argument("--steps", type=int, default=40)
    n.add_argument("--slow-step", type=int, default=25)
    n.add_argument("--drop-ms", type=int, default=700)
    o = sub.add_parser("noise")
    o.add_argument("--seconds", type=float, default=2)
    a = ap.parse_args()
    out = {"chain": chain, "gil": gil, "net": net, "noise": noise}[a.what](a)
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
