"""The user's line on real BPF: the report's "Python:" line is the innermost frame of the user's own
code, not the standard library, an installed package or the recorder's marker glue (user_code_rule,
store/migrations/0013_open_calls_user_code.sql), with the whole stack under --stack; the same in
--json and through a real MCP client; and the rule is the table's rows (a package marked as the
user's own moves the line into it).

The job: a training script (in a temporary folder, the user's code) whose steps allocate through an
installed package (a folder named site-packages) and, at one step, wait 400 ms in queue.get() for a
producer thread (the wait is in the standard library's threading.py)."""

from __future__ import annotations

import json
import sqlite3
import sys
import textwrap

import pytest
from conftest import ROOT, needs_bpf, q, run_recorder, workload_output
from test_mcp_tools import over_stdio

pytestmark = [needs_bpf, pytest.mark.bpf]
SLOW_STEP = 20

PACKAGE = """\
import ctypes


def allocate(rt, size):
    ptr = ctypes.c_void_p()
    return rt.cudaMalloc(ctypes.byref(ptr), size)  # the package's line
"""

SCRIPT = f"""\
import ctypes, json, os, queue, sys, threading, time
sys.path.insert(0, {str(ROOT)!r})
sys.path.insert(0, sys.argv[2])
import recorder
import fakelib

rt = ctypes.CDLL(sys.argv[1])
rt.cudaMalloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t]
batches = queue.Queue()


def producer():
    time.sleep(0.4)
    batches.put("batch")


def train():
    time.sleep(0.5)  # the recorder reads the new interpreter
    for step in range(40):
        recorder.step(step)
        fakelib.allocate(rt, 1 << 20)  # the user's allocation line
        if step == {SLOW_STEP}:
            threading.Thread(target=producer).start()
            batches.get()  # the user's wait line
        time.sleep(0.01)


train()
sys.stdout.write(json.dumps({{"pid": os.getpid()}}) + "\\n")
"""


def _line(text: str, marker: str) -> int:
    return next(n for n, t in enumerate(text.splitlines(), 1) if marker in t)


def test_the_python_line_is_the_users_own(tmp_path, native):
    pkg = tmp_path / "lib" / "site-packages"
    (pkg / "fakelib").mkdir(parents=True)
    (pkg / "fakelib" / "__init__.py").write_text(PACKAGE)
    script = tmp_path / "train_user.py"
    script.write_text(textwrap.dedent(SCRIPT))
    db = tmp_path / "r.db"
    res = run_recorder("record", "--db", str(db), "--", sys.executable, str(script), str(native["libcudart.so.12"]),
                       str(pkg), timeout=300)
    assert res.returncode == 0, res.stderr
    workload_output(res.stdout)
    alloc_line, wait_line = _line(SCRIPT, "the user's allocation line"), _line(SCRIPT, "the user's wait line")

    # every cudaMalloc is made in the package; its line is the script's that called the package
    sites = q(db, "SELECT python_line, count(*) FROM cuda_call_python GROUP BY 1")
    assert sites == [(f"train() at train_user.py:{alloc_line}", 40)], sites
    frames = q(db, "SELECT f.file, f.user_code FROM cuda_call c JOIN python_frame f ON f.stack_id = c.python_stack_id"
                   " WHERE f.depth = 0 LIMIT 1")
    assert frames == [("__init__.py", 0)]  # the innermost frame is the package's, not the user's

    # the step report of the wait: the user's queue.get() line, the standard library's frames below it
    report = json.loads(run_recorder("explain", "--db", str(db), "--step", str(SLOW_STEP), "--json",
                                     check=True).stdout)
    # the wait is followed to its end (the producer's sleep): each hop at the user's own line
    cause = report["primary_cause"]
    sleep_line = _line(SCRIPT, "time.sleep(0.4)")
    assert cause["kind"] == "wait_chain", cause
    assert cause["python"] == f"producer() at train_user.py:{sleep_line}", cause
    assert [hop["python"] for hop in cause["chain"][:2]] == [
        f"train() at train_user.py:{wait_line}", f"producer() at train_user.py:{sleep_line}"], cause["chain"]
    assert f"via the futex() in train() at train_user.py:{wait_line}" in cause["summary"], cause
    assert cause["python_stack"][0] == cause["python"], cause  # the sleep is made in C: no frame below
    text = run_recorder("explain", "--db", str(db), "--step", str(SLOW_STEP), check=True).stdout
    assert f"Python: producer() at train_user.py:{sleep_line}" in text, text
    assert "threading.py" not in text and "queue.py" not in text  # the standard library's frames: under --stack
    stacked = run_recorder("explain", "--db", str(db), "--step", str(SLOW_STEP), "--stack", check=True).stdout
    assert "threading.py" in stacked  # the producer thread's frames below its own line
    (mcp,) = over_stdio(db, [("explain_stall", {"step": SLOW_STEP})])
    assert mcp["primary_cause"]["python"] == cause["python"]

    # the rule is the table's: with the package marked as the user's own, the line is the package's
    conn = sqlite3.connect(db)
    conn.execute("INSERT INTO user_code_rule (pattern, user, why) VALUES ('%/site-packages/fakelib/%', 1, 'ours')")
    conn.commit()
    conn.close()
    pkg_line = _line(PACKAGE, "the package's line")
    sites = q(db, "SELECT python_line, count(*) FROM cuda_call_python GROUP BY 1")
    assert sites == [(f"allocate() at __init__.py:{pkg_line}", 40)], sites
