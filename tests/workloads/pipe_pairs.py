"""Pipe ping-pong on many threads: tens of thousands of off-CPU intervals a second, a few MB a
second of rows. Exits with status 3 (a command's own status, which `recorder record` returns).

    python pipe_pairs.py PAIRS SECONDS [DONE_FILE [END_FILE]]

writes 'done' into DONE_FILE at the end; with END_FILE, ends a second after that file appears
(SECONDS is then the longest it runs).
"""

import os
import sys
import threading
import time

pairs, seconds = int(sys.argv[1]), float(sys.argv[2])
end = time.monotonic() + seconds


def side(rd: int, wr: int, first: bool) -> None:
    if first:
        os.write(wr, b"x")
    while time.monotonic() < end:
        os.read(rd, 1)
        os.write(wr, b"x")


for _ in range(pairs):
    a_r, a_w = os.pipe()
    b_r, b_w = os.pipe()
    for args in ((a_r, b_w, True), (b_r, a_w, False)):
        threading.Thread(target=side, args=args, daemon=True).start()
end_file = sys.argv[4] if len(sys.argv) > 4 else None
while time.monotonic() < end + 0.5:
    if end_file and os.path.exists(end_file):
        end = min(end, time.monotonic() + 1)
    time.sleep(0.1)
if len(sys.argv) > 3:
    with open(sys.argv[3], "w") as f:
        f.write("done")
sys.exit(3)
