"""The script's own module frames, on real BPF. A module body (first line 1, name '<module>') is
told from another only by its file on CPython before 3.12 (no co_version): at start-up site
exec()s each line of a .pth file as a module body of '<string>' and frees it, and the allocator
may put the script's module code at that address. Once a start-up stack with the .pth line was
resolved, every frame of the script's module was named after it (`<module>() at <string>:6`,
about one run in three) unless the checksum that keys resolved code objects mixes in the file.
The script's module-level loop must be its own file and line in every CUDA call and every wait."""

from __future__ import annotations

import sys
import textwrap

import pytest
from conftest import needs_bpf, q, run_recorder, workload_output

pytestmark = [needs_bpf, pytest.mark.bpf]

SCRIPT = """\
import ctypes, json, os, sys, time

rt = ctypes.CDLL(sys.argv[1])
rt.cudaMalloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t]
ptr = ctypes.c_void_p()
# what site does with a .pth line: a module body of '<string>', run, then freed
BODY = "import time\\nfor i in range(10):\\n    time.sleep(0.02)  # the body's wait\\n"
pth = compile(BODY, "<string>", "exec")
exec(pth, {})
time.sleep(0.3)  # the module's first wait (the recorder resolves the body's stacks meanwhile)
addr = id(pth)
del pth
# the same body from a file, at the freed body's address
keep = []
for _ in range(100000):
    mine = compile(BODY, sys.argv[2], "exec")
    if id(mine) == addr:
        break
    keep.append(mine)
exec(mine, {})
for step in range(30):
    rt.cudaMalloc(ctypes.byref(ptr), 1 << 20)  # the module's call line
    time.sleep(0.01)  # the module's wait line
sys.stdout.write(json.dumps({"pid": os.getpid(), "reused": id(mine) == addr}) + "\\n")
"""


def _line(marker: str) -> int:
    return next(n for n, t in enumerate(SCRIPT.splitlines(), 1) if marker in t)


@pytest.mark.parametrize("run", range(3))  # it failed about one run in three
def test_module_level_frames_after_the_exec_are_the_scripts(tmp_path, native, run):
    script = tmp_path / "modlevel.py"
    script.write_text(textwrap.dedent(SCRIPT))
    db = tmp_path / "r.db"
    body = tmp_path / "body.py"
    res = run_recorder("record", "--db", str(db), "--", sys.executable, str(script), str(native["libcudart.so.12"]),
                       str(body), timeout=300)
    assert res.returncode == 0, res.stderr
    out = workload_output(res.stdout)
    pid = out["pid"]
    assert out["reused"]  # the case: the file's body at the freed '<string>' body's address
    call, wait, first = _line("the module's call line"), _line("the module's wait line"), _line("first wait")
    # every call's line is the module's, in the script (never another image's code at that address)
    assert q(db, "SELECT python_line, count(*) FROM cuda_call_python GROUP BY 1") == [
        (f"<module>() at modlevel.py:{call}", 30)]
    # every stack of the script's thread that starts at a module body starts at the script's (the
    # start-up's stacks start in the importer; the .pth lines site runs are '<string>' inside them)
    outer = q(db, "SELECT f.text, count(*) FROM offcpu_interval o JOIN thread t ON t.id = o.thread_id"
                  " JOIN python_frame f ON f.stack_id = o.python_stack_id"
                  " WHERE t.tid = ? AND f.depth = (SELECT max(depth) FROM python_frame g WHERE g.stack_id = f.stack_id)"
                  " AND f.qualname = '<module>' GROUP BY 1", (pid,))
    assert outer and all(text.startswith("<module>() at modlevel.py:") for text, _ in outer), outer
    lines = dict(outer)
    # the bodies' waits, each at its own body's line: the '<string>' one's while it lived (or
    # unavailable, when resolved after it was freed), the file's all at the file's
    inner = dict(q(db, "SELECT f.text, count(*) FROM offcpu_interval o JOIN thread t ON t.id = o.thread_id"
                       " JOIN python_frame f ON f.stack_id = o.python_stack_id"
                       " WHERE t.tid = ? AND f.depth = 0 AND f.qualname = '<module>' GROUP BY 1", (pid,)))
    body_wait = 3  # BODY's third line, its sleep
    assert inner.get(f"<module>() at body.py:{body_wait}") == 10, inner
    assert inner.get(f"<module>() at <string>:{body_wait}", 0) <= 10, inner
    assert set(inner) <= {f"<module>() at body.py:{body_wait}", f"<module>() at <string>:{body_wait}"} | set(lines), \
        inner
    assert lines.get(f"<module>() at modlevel.py:{wait}", 0) >= 25, outer
    assert lines.get(f"<module>() at modlevel.py:{first}") == 1, outer
