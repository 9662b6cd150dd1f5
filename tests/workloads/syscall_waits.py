"""A thread that mostly waits for microseconds and now and then for long: the main thread and a
responder hand a byte back and forth through two pipes (short read() waits, both threads), and
after every burst the main thread sleeps (a long wait of its own, and of the responder blocked in
read() meanwhile). Prints JSON: rounds, both thread ids, the sleep, and this process's voluntary
context switches.

    python syscall_waits.py [--rounds 10] [--burst 2000] [--sleep-ms 20]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import threading
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--burst", type=int, default=2000)
    ap.add_argument("--sleep-ms", type=float, default=20)
    args = ap.parse_args()
    ping_r, ping_w = os.pipe()
    pong_r, pong_w = os.pipe()
    tids: list[int] = []

    def responder() -> None:
        tids.append(threading.get_native_id())
        while os.read(ping_r, 1) == b"i":  # @reply
            os.write(pong_w, b"o")

    thread = threading.Thread(target=responder, name="responder")
    thread.start()
    tids.append(threading.get_native_id())
    time.sleep(0.3)  # the recorder configures the walker for this process meanwhile  # @settle
    for _ in range(args.rounds):
        for _ in range(args.burst):
            os.write(ping_w, b"i")
            os.read(pong_r, 1)  # @ping
        time.sleep(args.sleep_ms / 1000)  # @long
    os.write(ping_w, b"q")
    thread.join()
    usage = resource.getrusage(resource.RUSAGE_SELF)
    print(json.dumps({"rounds": args.rounds, "main": tids[1], "responder": tids[0],
                      "sleep_ms": args.sleep_ms, "voluntary_switches": usage.ru_nvcsw}))


if __name__ == "__main__":
    main()
