"""Starts N children that each run Python in this program's image for a while (so a recorder walks
their stacks there), then exec an interpreter that sleeps 1 ms at a time in `spin()`: each exec is
a new interpreter starting in a thread the stack walker knew in another image, as a child of
`recorder record` or of a launcher is. Prints the children's pids (JSON); exits 1 if one failed.

    python exec_children.py INTERPRETER N SECONDS_BEFORE_EXEC SECONDS_AFTER_EXEC [AT_ONCE]

AT_ONCE children run at a time (default all N).
"""

from __future__ import annotations

import json
import os
import sys
import time

SPIN = """import time
def spin():
    end = time.monotonic() + {seconds}
    while time.monotonic() < end:
        time.sleep(0.001)
spin()
"""
SPIN_LINE = 5  # the line of time.sleep in SPIN: where every wait after the exec is


def before_exec(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        time.sleep(0.001)


def main() -> int:
    interpreter, n, before, after = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4])
    at_once = int(sys.argv[5]) if len(sys.argv) > 5 else n
    pids: list[int] = []
    failed = 0
    while len(pids) < n:
        wave = []
        for _ in range(min(at_once, n - len(pids))):
            pid = os.fork()
            if pid == 0:
                before_exec(before)
                os.execv(interpreter, [interpreter, "-c", SPIN.format(seconds=after)])
            wave.append(pid)
        failed += sum(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) != 0 for pid in wave)
        pids += wave
    print(json.dumps(pids), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
