"""Two threads hand a byte back and forth through two pipes N times: every hand-off blocks the
receiving thread in read(), so the recording gets about 2N blocked off-CPU intervals. Prints JSON:
the round trips made, both thread ids, and this process's context switches.

    python pingpong.py [--round-trips 20000]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import threading


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--round-trips", type=int, default=20000)
    args = ap.parse_args()
    ping_r, ping_w = os.pipe()
    pong_r, pong_w = os.pipe()
    tids: list[int] = []

    def responder() -> None:
        tids.append(threading.get_native_id())
        for _ in range(args.round_trips):
            os.read(ping_r, 1)
            os.write(pong_w, b"o")

    thread = threading.Thread(target=responder, name="responder")
    thread.start()
    tids.append(threading.get_native_id())
    for _ in range(args.round_trips):
        os.write(ping_w, b"i")
        os.read(pong_r, 1)
    thread.join()
    usage = resource.getrusage(resource.RUSAGE_SELF)
    print(json.dumps({"round_trips": args.round_trips, "tids": tids,
                      "voluntary_switches": usage.ru_nvcsw}))


if __name__ == "__main__":
    main()
