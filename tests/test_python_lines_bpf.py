"""Python lines at recorded CUDA calls, end to end with real BPF: `recorder record` a workload, then
compare every cuda_call's stored Python stack with the ground truth the workload wrote itself,
frame by frame, under every installed CPython; the report names the call site; a process without
Python is reported absent and its calls are still recorded. Skipped with the reason without root.
"""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
from conftest import RECORDER, ROOT, needs_bpf, run_recorder, workload_output

sys.path.insert(0, str(ROOT / "tests" / "pyframes"))  # not a package
sys.path.insert(0, str(ROOT / "tests" / "workloads"))
from exec_children import SPIN_LINE  # noqa: E402

import harness  # noqa: E402

pytestmark = [needs_bpf, pytest.mark.bpf]
INSTALLED = harness.INTERPRETERS  # a key not installed is a case that skips (harness.interpreter_params)
MAX_FRAMES = 64
# A Python that maps libpython after its exec is detected once the loader has mapped it; these
# workloads make their first call after this pause, so that every call has its stack.
SETTLE_S = 1.5
TRAIN_STEPS = ROOT / "tests" / "workloads" / "train_steps.py"


def q(db: Path, sql: str, params: tuple = ()) -> list[tuple]:
    conn = sqlite3.connect(db)
    try:
        return conn.execute(sql, params).fetchall()
    finally:
        conn.close()


def stacks_by_call(db: Path) -> dict[int, dict]:
    """cuda_call id -> its size, tid, Python stack status and frames (file, qualname, line)."""
    rows = q(db, "SELECT c.id, c.size_bytes, t.tid, s.status, f.depth, pc.filename, pc.qualname, f.line"
                 " FROM cuda_call c JOIN thread t ON t.id = c.thread_id"
                 " LEFT JOIN python_stack s ON s.id = c.python_stack_id"
                 " LEFT JOIN python_stack_frame f ON f.stack_id = s.id"
                 " LEFT JOIN python_code pc ON pc.id = f.code_id ORDER BY c.id, f.depth")
    out: dict[int, dict] = {}
    for cid, size, tid, status, depth, filename, qualname, line in rows:
        call = out.setdefault(cid, {"size": size, "tid": tid, "status": status, "frames": []})
        if depth is not None:
            call["frames"].append((filename, qualname, line))
    return out


def wait_for_rows(db: Path, calls: int, timeout_s: float = 60) -> None:
    """Until the recording being written has `calls` cuda_call rows (read-only, beside the writer)."""
    deadline = time.monotonic() + timeout_s
    seen = 0
    while time.monotonic() < deadline:
        try:
            conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5)
            try:
                seen = conn.execute("SELECT count(*) FROM cuda_call").fetchone()[0]
            finally:
                conn.close()
        except sqlite3.OperationalError:  # not created yet
            seen = 0
        if seen >= calls:
            return
        time.sleep(0.1)
    raise AssertionError(f"the recorder wrote {seen} of {calls} calls in {timeout_s} s")


@pytest.fixture(scope="module")
def natives(tmp_path_factory: pytest.TempPathFactory):
    out = tmp_path_factory.mktemp("native")
    return lambda python: harness.build_native(out, python)


@pytest.mark.parametrize("interp", harness.interpreter_params())
def test_every_call_has_the_stack_the_workload_saw(interp: str, natives, tmp_path: Path) -> None:
    """tests/pyframes/workload.py (threads, generators, nested calls, methods, a recursion deeper
    than 64 frames; ctypes with the GIL released and an extension holding it) under the recorder:
    each cudaMalloc's size is the workload's sequence number, so each row meets its ground truth."""
    python = INSTALLED[interp]
    lib, gildir = natives(python)
    db, truth_path = tmp_path / "r.db", tmp_path / "truth.json"
    proc = subprocess.Popen(
        [*RECORDER, "record", "--db", str(db), "--cuda-lib", str(lib), "--",
         python, str(harness.WORKLOAD), str(lib), str(gildir), str(truth_path), "stacks"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(SETTLE_S)
        proc.stdin.write("go\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == "done"
        # stacks are resolved from the live process: it exits once the recorder has written every
        # call, which it does after resolving the calls' stacks
        wait_for_rows(db, len(json.loads(truth_path.read_text())))
        _, err = proc.communicate("go\n", timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    truth = json.loads(truth_path.read_text())
    calls = {c["size"]: c for c in stacks_by_call(db).values()}
    assert len(truth) > 100 and len(calls) == len(truth)
    truncated = 0
    for t in truth:
        call = calls[t["seq"]]
        assert call["tid"] == t["tid"], "call attributed to another thread"
        expected = [tuple(f) for f in t["frames"]]
        if len(expected) > MAX_FRAMES:
            expected, truncated = expected[:MAX_FRAMES], truncated + 1
            assert call["status"] == "truncated"
        else:
            assert call["status"] == "ok", (t["seq"], call["status"])
        assert call["frames"] == expected, f"seq {t['seq']} via {t['via']}"
    assert truncated == 1
    # deduplicated: far fewer stacks than calls, and the call-site view agrees with frame 0
    assert q(db, "SELECT count(DISTINCT python_stack_id) FROM cuda_call")[0][0] < len(truth)
    sites = q(db, "SELECT python_function, python_lineno, python_file FROM cuda_call_python")
    assert {(f, ln) for f, ln, _ in sites} == {(t["frames"][0][1], t["frames"][0][2]) for t in truth}
    cap = q(db, "SELECT status, detail FROM capability WHERE layer = 'python' AND target LIKE 'pid %'")
    assert cap and cap[-1][0] == "attached", cap


def _api_lines(path: Path) -> dict[str, int]:
    lines = {}
    for n, text in enumerate(path.read_text().splitlines(), 1):
        for api in ("cudaMalloc", "cudaLaunchKernel", "cudaStreamSynchronize", "cudaFree"):
            if f"rt.{api}(" in text:
                lines[api] = n
    return lines


def test_train_steps_calls_carry_their_line(tmp_path: Path, native) -> None:
    """The stand-in training loop: every call's innermost frame is main() at the line that makes
    that call, called from the module at main()'s call, and the explain report's JSON agrees.
    Every launch is drawn for its stacks here (STALL_RECORDER_LAUNCH_STACK_SAMPLE=1), with a row per
    launch (--launch-rows), so the stacks taken at a launch's return are checked against the line that
    made it, as the entries' are."""
    db = tmp_path / "r.db"
    steps = 15
    wrapper = (f"import runpy, sys, time; time.sleep({SETTLE_S}); "
               f"sys.argv = [{str(TRAIN_STEPS)!r}, '--libdir', {str(native['dir'])!r}, '--steps', '{steps}'];"
               f" runpy.run_path(sys.argv[0], run_name='__main__')")
    res = run_recorder("record", "--db", str(db), "--cuda-lib", str(native["libcudart.so.12"]), "--",
                       sys.executable, "-c", wrapper, timeout=300,
                       env={**os.environ, "STALL_RECORDER_LAUNCH_STACK_SAMPLE": "1", "STALL_RECORDER_LAUNCH_ROWS": "1"})
    assert res.returncode == 0, res.stderr
    assert workload_output(res.stdout)["steps"] == steps
    lines = _api_lines(TRAIN_STEPS)
    main_call = next(n for n, t in enumerate(TRAIN_STEPS.read_text().splitlines(), 1) if t.strip() == "main()")
    rows = q(db, "SELECT a.name, c.id FROM cuda_call c JOIN cuda_api a ON a.id = c.api_id")
    assert len(rows) == steps * 6
    stacks = stacks_by_call(db)
    for api, cid in rows:
        s = stacks[cid]
        assert s["status"] == "ok"
        assert s["frames"][0] == (str(TRAIN_STEPS), "main", lines[api]), api
        assert s["frames"][1] == (str(TRAIN_STEPS), "<module>", main_call)
        assert s["frames"][-1] == ("<string>", "<module>", 1)
    by_line = q(db, "SELECT python_line, calls FROM python_lines")
    assert dict(by_line) == {f"main() at train_steps.py:{lines[a]}": steps * (3 if a == "cudaLaunchKernel" else 1)
                             for a in lines}
    # one per call site (the session also stores the stacks of the thread's off-CPU waits)
    assert q(db, "SELECT count(DISTINCT python_stack_id) FROM cuda_call")[0][0] == 4
    # the calls' native stacks are symbolised at their innermost frame (the on-CPU profile's samples
    # keep the interpreter's and the C library's frames as object and offset)
    assert q(db, "SELECT count(*) FROM native_stack_frame WHERE depth = 0 AND symbol IS NULL"
                 " AND stack_id IN (SELECT native_stack_id FROM cuda_call)")[0][0] == 0
    assert {r[0] for r in q(db, "SELECT symbol FROM native_stack_frame WHERE depth = 0"
                                " AND stack_id IN (SELECT native_stack_id FROM cuda_call)")} == set(lines)


SLOW_SCRIPT = """\
import ctypes, sys, time
time.sleep({settle})
rt = ctypes.CDLL(sys.argv[1])
rt.cudaMalloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t]
rt.standin_configure(b"cudaMalloc", ctypes.c_uint64(300_000), ctypes.c_uint64(0), 0)


def fast_step():
    rt.cudaMalloc(ctypes.byref(ctypes.c_void_p()), 4096)


def slow_step():
    rt.standin_configure(b"cudaMalloc", ctypes.c_uint64(20_000_000), ctypes.c_uint64(0), 0)
    rt.cudaMalloc(ctypes.byref(ctypes.c_void_p()), 4096)


for _ in range(20):
    fast_step()
slow_step()
time.sleep(1)  # stacks are resolved from the live process
"""


def test_explain_names_the_line_of_the_slow_call(tmp_path: Path, native) -> None:
    script = tmp_path / "slow_call.py"
    script.write_text(SLOW_SCRIPT.format(settle=SETTLE_S))
    text = script.read_text().splitlines()
    slow_line = next(n for n, t in enumerate(text, 1) if "cudaMalloc(" in t and n > text.index("def slow_step():"))
    caller_line = text.index("slow_step()") + 1
    db = tmp_path / "r.db"
    res = run_recorder("record", "--db", str(db), "--cuda-lib", str(native["libcudart.so.12"]), "--",
                       sys.executable, str(script), str(native["libcudart.so.12"]), timeout=300)
    assert res.returncode == 0, res.stderr
    report = json.loads(run_recorder("explain", "--db", str(db), "--json", check=True).stdout)
    first = report["findings"][0]
    assert first["api"] == "cudaMalloc"
    assert first["python"] == f"slow_step() at slow_call.py:{slow_line}"
    assert first["python_stack"] == [f"slow_step() at slow_call.py:{slow_line}",
                                     f"<module>() at slow_call.py:{caller_line}"]
    assert "python" in report["observed_layers"]
    out = run_recorder("explain", "--db", str(db), check=True).stdout
    assert f"  at slow_step() at slow_call.py:{slow_line}" in out
    assert f"<module>() at slow_call.py:{caller_line}" not in out
    out = run_recorder("explain", "--db", str(db), "--stack", check=True).stdout
    assert f"<module>() at slow_call.py:{caller_line}" in out


FORK_SCRIPT = """
import ctypes, json, os, sys, time
time.sleep({settle})
rt = ctypes.CDLL(sys.argv[1])
rt.cudaMalloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t]


def in_child():
    rt.cudaMalloc(ctypes.byref(ctypes.c_void_p()), 2)


rt.cudaMalloc(ctypes.byref(ctypes.c_void_p()), 1)
pid = os.fork()
if pid == 0:
    in_child()  # microseconds after the fork: long before the recorder has read it
    time.sleep(1)  # stacks are resolved from the live process
    os._exit(0)
os.waitpid(pid, 0)
print(json.dumps({{"parent": os.getpid(), "child": pid}}), flush=True)
"""


def test_a_forked_child_has_its_stack_from_its_first_call(tmp_path: Path, native) -> None:
    """A fork inherits its parent's stack-walking recipe in the kernel (bpf/task.bpf.c): the
    child's call made right after the fork has its Python stack, not "not configured"."""
    script = tmp_path / "forker.py"
    script.write_text(FORK_SCRIPT.format(settle=SETTLE_S))
    text = script.read_text().splitlines()
    line = next(n for n, t in enumerate(text, 1) if "cudaMalloc(" in t and "), 2)" in t)
    db = tmp_path / "r.db"
    res = run_recorder("record", "--db", str(db), "--cuda-lib", str(native["libcudart.so.12"]), "--",
                       sys.executable, str(script), str(native["libcudart.so.12"]), timeout=300)
    assert res.returncode == 0, res.stderr
    pids = workload_output(res.stdout)
    rows = q(db, "SELECT c.size_bytes, p.pid, s.status FROM cuda_call c JOIN thread t ON t.id = c.thread_id"
                 " JOIN process p ON p.id = t.process_id LEFT JOIN python_stack s ON s.id = c.python_stack_id"
                 " ORDER BY c.ts")
    assert rows == [(1, pids["parent"], "ok"), (2, pids["child"], "ok")], rows
    child = next(c for c in stacks_by_call(db).values() if c["size"] == 2)
    assert child["frames"][0] == (str(script), "in_child", line)


C_CALLER = r"""
#include <dlfcn.h>
#include <stdio.h>
#include <unistd.h>
int main(int argc, char **argv)
{
    void *h = dlopen(argv[1], RTLD_NOW);
    int (*cuda_malloc)(void **, unsigned long) = h ? dlsym(h, "cudaMalloc") : 0;
    if (!cuda_malloc)
        return 2;
    for (int i = 0; i < 5; i++) {
        void *p;
        cuda_malloc(&p, 1000 + i);
    }
    printf("{\"pid\": %d}\n", getpid());
    fflush(stdout);
    sleep(2); /* live long enough for the recorder to look at the process, as a real job does */
    return 0;
}
"""


def test_program_without_python_is_absent_and_still_recorded(tmp_path: Path, native) -> None:
    src, exe = tmp_path / "caller.c", tmp_path / "caller"
    src.write_text(C_CALLER)
    subprocess.run(["gcc", "-O1", "-o", str(exe), str(src), "-ldl"], check=True)
    db = tmp_path / "r.db"
    res = run_recorder("record", "--db", str(db), "--cuda-lib", str(native["libcudart.so.12"]), "--",
                       str(exe), str(native["libcudart.so.12"]), timeout=300)
    assert res.returncode == 0, res.stderr
    pid = workload_output(res.stdout)["pid"]
    caps = q(db, "SELECT status, detail FROM capability WHERE layer = 'python' AND target = ?", (f"pid {pid}",))
    assert len(caps) == 1 and caps[0][0] == "absent" and "not a CPython process" in caps[0][1], caps
    rows = q(db, "SELECT size_bytes, python_status, python_line FROM cuda_call_python p"
                 " JOIN cuda_call c ON c.id = p.cuda_call_id ORDER BY size_bytes")
    assert [r[0] for r in rows] == [1000, 1001, 1002, 1003, 1004]
    # 'not configured' for calls made before the recorder had looked at the new image
    assert {r[1:] for r in rows} <= {("unsupported interpreter", "<unsupported interpreter>"),
                                     ("not configured", "<not configured>")}
    report = json.loads(run_recorder("explain", "--db", str(db), "--json", check=True).stdout)
    assert "python" not in report["observed_layers"]


EXEC_CHILDREN = ROOT / "tests" / "workloads" / "exec_children.py"
PYENV = ("3.10", "3.11", "3.12", "3.13")


@pytest.mark.parametrize("version", PYENV)
def test_every_new_interpreter_has_its_lines_from_its_start(version: str, tmp_path: Path) -> None:
    """Twenty interpreters exec'd in threads the walker knew in the image before (as a child of
    `recorder record` is: a fork of a Python that waited in Python, then an exec), in one
    recording: every one has Python lines at its waits. A walk that failed once in such a thread
    (its cached thread state belongs to the old image) must not fail for the rest of its life."""
    interpreter = harness.INTERPRETERS[version]
    if not os.access(interpreter, os.X_OK):
        pytest.skip(f"CPython {version} is not installed at {interpreter} (pyenv install {version})")
    db = tmp_path / "children.db"
    res = run_recorder("record", "--db", str(db), "--", interpreter, str(EXEC_CHILDREN), interpreter,
                       "20", "0.4", "0.4", "5", timeout=300)
    assert res.returncode == 0, res.stderr
    children = json.loads(res.stdout.splitlines()[0])
    assert len(children) == 20
    marks = ",".join("?" * len(children))
    # every wait of a child, and whether its stack is spin() at the sleep's line (after the exec)
    rows = q(db, "SELECT p.pid, s.status, s.failure, EXISTS (SELECT 1 FROM python_stack_frame f"
                 " JOIN python_code c ON c.id = f.code_id WHERE f.stack_id = s.id AND c.qualname = 'spin'"
                 " AND c.filename = '<string>' AND f.line = ?)"
                 " FROM offcpu_interval o JOIN thread t ON t.id = o.thread_id JOIN process p ON p.id = t.process_id"
                 f" LEFT JOIN python_stack s ON s.id = o.python_stack_id WHERE p.pid IN ({marks})",
             (SPIN_LINE, *children))
    lines = {pid: 0 for pid in children}
    why: dict[int, Counter] = {pid: Counter() for pid in children}
    for pid, status, failure, at_line in rows:
        lines[pid] += at_line
        if status not in (None, "ok"):
            why[pid][f"{status}: {failure}" if failure else status] += 1
    without = {pid: dict(why[pid]) for pid, n in lines.items() if n == 0}
    assert not without, f"{len(without)} of 20 interpreters without a Python line: {without}"
    # and no walk kept failing in a thread whose interpreter was there all along
    stuck = {pid: n for pid in children if (n := sum(k for w, k in why[pid].items() if w.startswith("read error")))
             > 5}
    assert not stuck, f"read errors at the waits of {stuck}: {dict(why[next(iter(stuck))])}"
