"""Wake-ups from irq_work, for tests/test_losses_bpf.py: a thread blocked in epoll_wait() on a BPF
ring buffer is woken by the kernel's irq_work (a ring buffer record's notification is queued to the
CPU's irq_work interrupt), never by a task.

    python irq_work_wakeups.py [--rounds N]

A socket filter on a UDP socket writes one record to a ring buffer per datagram received; a worker
thread sends one datagram over loopback every 5 ms, N times; the main thread waits for each record
in epoll_wait (bcc's ring_buffer_poll). A socket filter, not a tracing program: the kernel runs no
tracing program while another runs on the CPU, so the irq_work interrupt that a tracing program's
record raises at once would find the recorder's programs skipped. Prints one JSON line: pid, the
poller's and the worker's tids and how many records the poller got.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import threading
import time

from bcc import BPF

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from recorder.core import kheaders  # noqa: E402  (the kernel headers BCC compiles with here)

SETTLE_S = 1.0  # the recorder starts tracing the process meanwhile
PROGRAM = """
BPF_RINGBUF_OUTPUT(records, 1);
int on_datagram(struct __sk_buff *skb)
{
    u32 one = 1;
    records.ringbuf_output(&one, sizeof(one), 0);
    return -1; /* keep the whole datagram */
}
"""
SO_ATTACH_BPF = 50


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=200)
    args = ap.parse_args()
    kheaders.locate()
    bpf = BPF(text=PROGRAM)
    fn = bpf.load_func("on_datagram", BPF.SOCKET_FILTER)
    rx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    rx.bind(("127.0.0.1", 0))
    rx.setsockopt(socket.SOL_SOCKET, SO_ATTACH_BPF, fn.fd)
    tx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    got = [0]

    def record(_ctx: object, _data: object, _size: int) -> None:
        got[0] += 1

    bpf["records"].open_ring_buffer(record)
    time.sleep(SETTLE_S)
    worker_tid: list[int] = []

    def worker() -> None:
        worker_tid.append(threading.get_native_id())
        for _ in range(args.rounds):
            time.sleep(0.005)
            tx.sendto(b"x", rx.getsockname())

    t = threading.Thread(target=worker, name="notifier")
    t.start()
    while t.is_alive():
        bpf.ring_buffer_poll(200)
    t.join()
    bpf.ring_buffer_consume()
    print(json.dumps({"pid": os.getpid(), "poller": threading.get_native_id(), "worker": worker_tid[0],
                      "records": got[0]}))


if __name__ == "__main__":
    main()
