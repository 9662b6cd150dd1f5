"""CPython stacks captured in BPF at a uprobe (bpf/pystack.h + recorder/core/pyframes.py), checked
against the ground truth each workload records itself, frame by frame, for every event, under every
installed interpreter. Real probes: needs root, BCC and BTF (skipped with the reason otherwise)."""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "pyframes"))  # not a package
import harness  # noqa: E402
from recorder.core import pyframes  # noqa: E402
from recorder.core.pyframes import (  # noqa: E402
    MAX_FRAMES,
    PyStackEvent,
    PyStackProbe,
    StackResolver,
    Unsupported,
    detect,
    parse_pystack_event,
)

INSTALLED = harness.INTERPRETERS  # a key not installed is a case that skips (harness.interpreter_params)
NO_BPF = harness.bpf_unavailable()
bpf_only = pytest.mark.skipif(NO_BPF is not None, reason=NO_BPF or "")


class Recording:
    """The probe loaded once for the module; events collected per run."""

    def __init__(self, bpf: Any, probe: PyStackProbe) -> None:
        self.bpf = bpf
        self.probe = probe
        self.stacks: list[PyStackEvent] = []
        self.calls: list[tuple[int, int, int, int]] = []  # (ts, pid, tid, seq)

        def on_stack(_cpu: int, data: int, size: int) -> None:
            self.stacks.append(parse_pystack_event(ctypes.string_at(data, size)))

        def on_call(_cpu: int, data: int, _size: int) -> None:
            e = ctypes.cast(data, ctypes.POINTER(harness.CallEvent)).contents
            self.calls.append((e.ts, e.pid, e.tid, e.seq))

        bpf["pystacks"].open_ring_buffer(on_stack)
        bpf["calls"].open_ring_buffer(on_call)

    def drain(self) -> None:
        self.bpf.ring_buffer_consume()

    def for_pid(self, pid: int) -> tuple[list[PyStackEvent], list[tuple[int, int, int, int]]]:
        self.drain()
        return ([s for s in self.stacks if s.pid == pid], [c for c in self.calls if c[1] == pid])


@pytest.fixture(scope="module")
def native(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], tuple[Path, Path]]:
    out = tmp_path_factory.mktemp("native")

    def build(python: str) -> tuple[Path, Path]:
        return harness.build_native(out, python)

    return build


@pytest.fixture(scope="module")
def recording(native: Callable[[str], tuple[Path, Path]]) -> Iterator[Recording]:
    lib, _ = native(sys.executable)
    bpf = harness.load_probe(lib)
    probe = PyStackProbe(bpf)
    probe.install()
    yield Recording(bpf, probe)
    bpf.cleanup()


def _truth_key(frames: list[list[Any]]) -> list[tuple[str, str, int | None]]:
    return [(f[0], f[1], f[2]) for f in frames]


def _run(recording: Recording, native: Callable[[str], tuple[Path, Path]], python: str,
         mode: str, tmp_path: Path, poll: Callable[[Recording, int], None] | None = None,
         ) -> tuple[harness.Workload, StackResolver]:
    lib, gildir = native(python)
    w = harness.start_workload(python, lib, gildir, tmp_path, mode)
    try:
        target = recording.probe.configure(w.pid)
        assert not isinstance(target, Unsupported), target
        resolver = StackResolver(recording.probe.targets)
        w.go()
        if poll is not None:
            poll(recording, w.pid)
        w.wait_line("done")
        w.truth = json.loads(w.truth_path.read_text())
        return w, resolver
    except BaseException:
        w.proc.kill()
        raise


@bpf_only
@pytest.mark.bpf
@pytest.mark.parametrize("interp", harness.interpreter_params())
def test_stacks_equal_ground_truth(recording: Recording, native: Callable[[str], tuple[Path, Path]],
                                   interp: str, tmp_path: Path) -> None:
    w, resolver = _run(recording, native, INSTALLED[interp], "stacks", tmp_path)
    try:
        stacks, calls = recording.for_pid(w.pid)
        by_key = {(s.ts, s.pid, s.tid): s for s in stacks}
        by_seq = {c[3]: c for c in calls}
        assert len(w.truth) > 100 and len(calls) == len(w.truth) == len(stacks)
        vias = set()
        truncated = 0
        for t in w.truth:
            call = by_seq[t["seq"]]
            assert call[2] == t["tid"], "call attributed to another thread"
            ev = by_key[call[:3]]  # joined on (ts, pid, tid), as the store joins them
            expected = _truth_key(t["frames"])
            if len(expected) > MAX_FRAMES:
                assert ev.status == pyframes.STATUS_TRUNCATED
                expected = expected[:MAX_FRAMES]
                truncated += 1
            else:
                assert ev.status == pyframes.STATUS_OK, ev.status_name
            got = [(f.filename, f.qualname, f.line) for f in resolver.resolve(w.pid, ev.frames)]
            assert got == expected, f"seq {t['seq']} via {t['via']}"
            vias.add(t["via"])
        assert vias == {"ctypes", "gil"} and truncated == 1
        # the stack of large frames that spans data-stack chunks was among those compared
        assert sum(1 for t in w.truth if [f[1] for f in t["frames"]].count("wide") == 31) == 1
    finally:
        w.finish()
    # after exit: frames come back marked unavailable, nothing raises
    gone = StackResolver().resolve(w.pid, stacks[0].frames)
    assert gone and all(not f.available and f.error for f in gone)


@bpf_only
@pytest.mark.bpf
@pytest.mark.parametrize("interp", harness.interpreter_params())
def test_generated_code_never_misattributed(recording: Recording,
                                            native: Callable[[str], tuple[Path, Path]],
                                            interp: str, tmp_path: Path) -> None:
    """exec/compile in a loop: addresses of freed code objects are reused by code with other
    names and lines. Every frame resolves to its own code object or is marked unavailable."""
    resolved: dict[int, list[pyframes.PyFrame]] = {}  # seq -> frames, resolved while live
    stop = threading.Event()

    def poll(rec: Recording, pid: int) -> None:
        resolver = StackResolver(rec.probe.targets)
        seen = 0

        def loop() -> None:
            nonlocal seen
            while not stop.is_set():
                rec.drain()
                stacks = [s for s in rec.stacks[seen:] if s.pid == pid]
                seen = len(rec.stacks)
                for s in stacks:
                    resolved[s.ts] = resolver.resolve(pid, s.frames)
                time.sleep(0.001)

        threading.Thread(target=loop, daemon=True).start()

    w, _ = _run(recording, native, INSTALLED[interp], "exec", tmp_path, poll)
    try:
        time.sleep(0.05)
        stop.set()
        _, calls = recording.for_pid(w.pid)
        by_seq = {c[3]: c for c in calls}
        right = unavailable = 0
        for t in w.truth:
            frames = resolved.get(by_seq[t["seq"]][0])
            assert frames is not None
            top, expected = frames[0], _truth_key(t["frames"])[0]
            if top.available:
                assert (top.filename, top.qualname, top.line) == expected, f"seq {t['seq']}"
                right += 1
            else:
                unavailable += 1
        # most are resolved while alive; the rest are honest about it
        assert right > len(w.truth) // 2, (right, unavailable)
    finally:
        w.finish()


def _stripped_copy(tmp_path: Path) -> Path | None:
    """A `strip --strip-all` copy of pyenv's 3.12 executable and libpython."""
    src = Path("/root/.pyenv/versions/3.12.1")
    if not src.exists() or shutil.which("strip") is None:
        return None
    (tmp_path / "lib").mkdir()
    lib = tmp_path / "lib" / "libpython3.12.so.1.0"
    exe = tmp_path / "python3.12"
    shutil.copy(src / "lib" / lib.name, lib)
    shutil.copy(src / "bin" / "python3.12", exe)
    subprocess.run(["strip", "--strip-all", str(lib), str(exe)], check=True)
    return exe


def test_stripped_interpreter_is_still_walkable(tmp_path: Path) -> None:
    """Stripping removes .symtab, not .dynsym: libpython must export _PyRuntime to its own
    relocations and to extension modules, so a stripped build is still detected (renaming the
    symbol to simulate its absence makes the interpreter itself fail to load)."""
    exe = _stripped_copy(tmp_path)
    if exe is None:
        pytest.skip("pyenv 3.12.1 or strip not available")
    proc = subprocess.Popen([str(exe), "-c", "import sys;sys.stdin.read()"], stdin=subprocess.PIPE,
                            env={**os.environ, "LD_LIBRARY_PATH": str(exe.parent / "lib"),
                                 "PYTHONHOME": "/root/.pyenv/versions/3.12.1"})
    try:
        time.sleep(0.3)
        target = detect(proc.pid)
        assert not isinstance(target, Unsupported), target
        assert target.version == (3, 12, 1) and target.elf_path.startswith(str(tmp_path))
    finally:
        proc.kill()
        proc.wait()


@bpf_only
@pytest.mark.bpf
def test_unsupported_targets_still_get_status_records(
        recording: Recording, native: Callable[[str], tuple[Path, Path]], tmp_path: Path) -> None:
    lib, _ = native(sys.executable)
    cprog = tmp_path / "caller.c"
    cprog.write_text(
        "#include <stdio.h>\n#include <dlfcn.h>\n"
        "int main(int c, char **v) { int (*f)(void **, unsigned long) = "
        "(int (*)(void **, unsigned long))dlsym(dlopen(v[1], RTLD_NOW), \"cudaMalloc\");\n"
        "  char b[8]; void *p; puts(\"ready\"); fflush(stdout);\n"
        "  for (int i = 0; i < 2; i++) { fgets(b, 8, stdin); f(&p, 1000 + i); "
        "puts(\"done\"); fflush(stdout); }\n  fgets(b, 8, stdin); return 0; }\n")
    exe = tmp_path / "caller"
    subprocess.run(["gcc", "-o", str(exe), str(cprog), "-ldl"], check=True)
    snippet = ("import ctypes,sys;f=ctypes.CDLL(sys.argv[1]).cudaMalloc;p=ctypes.c_void_p();"
               "print('ready');sys.stdout.flush()\nfor i in range(2):\n sys.stdin.readline();"
               "f(ctypes.byref(p),ctypes.c_size_t(1000+i));print('done');sys.stdout.flush()\n"
               "sys.stdin.readline()\n")
    cases: list[tuple[str, list[str], dict[str, str]]] = [("C program", [str(exe), str(lib)], {})]
    for old in ("2.7.18", "3.9.18"):
        py = f"/root/.pyenv/versions/{old}/bin/python{old.rsplit('.', 1)[0]}"
        if os.access(py, os.X_OK):
            cases.append((f"python {old}", [py, "-c", snippet, str(lib)], {}))
    for name, argv, env in cases:
        proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                env={**os.environ, **env})
        w = harness.Workload(proc, tmp_path / "unused")
        try:
            w.wait_line("ready")
            w.go()  # first call before the recorder has looked at the process
            w.wait_line("done")
            target = recording.probe.configure(proc.pid)
            assert isinstance(target, Unsupported) and target.reason, name
            w.go()
            w.wait_line("done")
            stacks, _ = recording.for_pid(proc.pid)
            assert [s.status for s in stacks] == [
                pyframes.STATUS_NOT_CONFIGURED, pyframes.STATUS_UNSUPPORTED], name
            assert all(not s.frames for s in stacks)
            assert not any(f.available for f in StackResolver().resolve(proc.pid, [(1, 2, 3)]))
            print(f"{name}: {target.reason}")
        finally:
            proc.kill()
            proc.wait()
            recording.probe.forget(proc.pid)


@bpf_only
def test_counts_and_forget(recording: Recording) -> None:
    counts = recording.probe.counts()
    assert set(counts) == set(pyframes.COUNT_NAMES.values())
    recording.probe.forget(1)  # never configured: no error


def test_detect_non_python_and_dead_processes() -> None:
    sleeper = subprocess.Popen(["sleep", "30"])
    try:
        time.sleep(0.05)
        result = detect(sleeper.pid)
        assert isinstance(result, Unsupported) and "not a CPython process" in result.reason
    finally:
        sleeper.kill()
        sleeper.wait()
    dead = detect(sleeper.pid)
    assert isinstance(dead, Unsupported) and dead.reason.startswith("cannot inspect")


@pytest.mark.parametrize("interp", harness.interpreter_params())
def test_detect_finds_version_and_build(interp: str) -> None:
    proc = subprocess.Popen([INSTALLED[interp], "-c", "import sys;sys.stdin.read()"],
                            stdin=subprocess.PIPE)
    try:
        deadline = time.time() + 10
        while time.time() < deadline:
            target = detect(proc.pid)
            if not isinstance(target, Unsupported):
                break
            time.sleep(0.05)
        assert not isinstance(target, Unsupported), target
        out = subprocess.run([INSTALLED[interp], "-c", "import sys;print(sys.version_info[:3])"],
                             capture_output=True, text=True, check=True).stdout
        if interp == "3.10":  # no Py_Version before 3.11: the file name gives major.minor only
            assert target.version == (3, 10, 0)
        else:
            assert str(target.version) == out.strip()
        if interp == "debian-3.11":
            assert target.load_bias == 0 and target.elf_path == "/usr/bin/python3.11"
        else:
            assert target.load_bias > 0 and "libpython" in target.elf_path
    finally:
        proc.kill()
        proc.wait()


def _measured_offsets(python: str, tmp_path: Path) -> dict[str, int]:
    inc = subprocess.run([python, "-c", "import sysconfig;print(sysconfig.get_paths()['include'])"],
                         capture_output=True, text=True, check=True).stdout.strip()
    exe = tmp_path / "offsets"
    src = Path(harness.__file__).parent / "offsets.c"
    subprocess.run(["gcc", f"-I{inc}", f"-I{inc}/internal", "-o", str(exe), str(src)], check=True)
    lines = subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout
    return {k: int(v) for k, v in (line.split() for line in lines.splitlines())}


@pytest.mark.parametrize("interp", harness.interpreter_params(harness.VERSIONS))
def test_offsets_match_interpreter_headers(interp: str, tmp_path: Path) -> None:
    measured = _measured_offsets(INSTALLED[interp], tmp_path)
    minor = (3, int(interp.split(".")[1]))
    if minor in pyframes.OFFSETS:
        table = pyframes.OFFSETS[minor]
    else:  # 3.13+: what detect() parsed out of a live interpreter's _Py_DebugOffsets
        proc = subprocess.Popen([INSTALLED[interp], "-c", "import sys;sys.stdin.read()"],
                                stdin=subprocess.PIPE)
        try:
            time.sleep(0.3)
            target = detect(proc.pid)
        finally:
            proc.kill()
            proc.wait()
        assert not isinstance(target, Unsupported), target
        table = target.offsets
    for name, value in measured.items():
        assert getattr(table, name) == value, name


def test_layout_matches_c_header(tmp_path: Path) -> None:
    """sizeof/offsetof of the header's structs, compiled with gcc, equal the Python mirror."""
    lines = ["#include <stdio.h>", "#include <stddef.h>", "#include <stdint.h>",
             "typedef uint64_t u64; typedef uint32_t u32; typedef uint16_t u16; "
             "typedef uint8_t u8;", "#define PYSTACK_LAYOUT_ONLY",
             f'#include "{harness.BPF_DIR / "pystack.h"}"', "int main(void) {"]
    mirrors = {
        "pystack_event": pyframes.EVENT_HEADER_FIELDS,
        "pystack_frame": pyframes.FRAME_FIELDS,
        "pystack_proc": pyframes.PROC_FIELDS,
    }
    for struct_name, fields in mirrors.items():
        lines.append(f'printf("{struct_name} size %zu\\n", sizeof(struct {struct_name}));')
        for name, _ in fields:
            lines.append(f'printf("{struct_name} {name} %zu\\n", '
                         f"offsetof(struct {struct_name}, {name}));")
    consts = {f"STATUS_{n}": getattr(pyframes, f"STATUS_{n}") for n in
              ("OK", "TRUNCATED", "NOT_CONFIGURED", "UNSUPPORTED", "NO_THREAD_STATE",
               "READ_ERROR", "NOT_INSTALLED")}
    consts |= {"F_CFRAME": pyframes.F_CFRAME, "F_LASTI_INT": pyframes.F_LASTI_INT,
               "F_NAME_HASH": pyframes.F_NAME_HASH, "PROG_FIND": pyframes.PROG_FIND,
               "PROG_WALK": pyframes.PROG_WALK, "PROG_SCAN": pyframes.PROG_SCAN,
               "MAX_FRAMES": pyframes.MAX_FRAMES}
    for name in consts:
        c_name = "PYSTACK_" + name.removeprefix("STATUS_")
        lines.append(f'printf("const {name} %d\\n", (int){c_name});')
    lines.append("return 0; }")
    src = tmp_path / "layout.c"
    src.write_text("\n".join(lines) + "\n")
    subprocess.run(["gcc", "-Wall", "-o", str(tmp_path / "layout"), str(src)], check=True)
    out = subprocess.run([str(tmp_path / "layout")], capture_output=True, text=True,
                         check=True).stdout.split("\n")
    got = {tuple(line.split()[:2]): int(line.split()[2]) for line in out if line}
    for struct_name, fields in mirrors.items():
        import struct as st

        at = 0
        for name, fmt in fields:
            assert got[(struct_name, name)] == at, (struct_name, name)
            at += st.calcsize("=" + fmt)
        expected = at if struct_name != "pystack_event" else pyframes.EVENT_SIZE
        assert got[(struct_name, "size")] == expected, struct_name
    for name, value in consts.items():
        assert got[("const", name)] == value, name


def test_parse_event_reads_only_sent_frames() -> None:
    import struct as st

    head = st.pack("=QIIIIQ", 123, 4, 5, 2, pyframes.STATUS_READ_ERROR, 0x1234)
    frames = st.pack("=QQII", 0x1000, 0x2000, 7, 0) + st.pack("=QQII", 0x3000, 9, 8, 0)
    ev = parse_pystack_event(head + frames)
    assert (ev.ts, ev.pid, ev.tid, ev.status_name, ev.digest) == (123, 4, 5, "read error", 0x1234)
    assert ev.frames == ((0x1000, 0x2000, 7), (0x3000, 9, 8))
    # a record cut short never yields frames that were not sent
    assert parse_pystack_event(head + frames[:30]).frames == ((0x1000, 0x2000, 7),)


def _sample_code() -> Any:
    ns: dict[str, Any] = {}
    exec(compile(_sample_src(), "<sample>", "exec"), ns)
    return ns["f"].__code__


@pytest.mark.skipif(sys.version_info[:2] < (3, 11), reason="location table is 3.11+")
def test_location_table_decoder_matches_co_lines() -> None:
    code = _sample_code()
    for start, end, line in code.co_lines():
        for addr in range(start, end, 2):
            assert pyframes.line_311(code.co_linetable, code.co_firstlineno, addr) == line


@pytest.mark.parametrize("interp", harness.interpreter_params(("3.10", "3.12", "3.13")))
def test_line_decoders_match_each_interpreter(interp: str) -> None:
    """Every instruction offset of a sample under that interpreter, decoded here."""
    script = (
        "import json,sys\n" + f"src={_sample_src()!r}\n" +
        "ns={};exec(compile(src,'<s>','exec'),ns);c=ns['f'].__code__\n"
        "print(json.dumps([list(c.co_linetable),c.co_firstlineno,"
        "[[s,e,l] for s,e,l in c.co_lines()]]))\n"
    )
    out = subprocess.run([INSTALLED[interp], "-c", script], capture_output=True, text=True,
                         check=True).stdout
    table, first, ranges = json.loads(out)
    decode = pyframes.line_310 if interp == "3.10" else pyframes.line_311
    for start, end, line in ranges:
        for addr in range(start, end, 2):
            assert decode(bytes(table), first, addr) == line, (addr, line)


def _sample_src() -> str:
    return ("def f(a):\n    x = [i\n         for i in a]\n\n    if x:\n        return g(\n  x)\n"
            "    while a:\n        a = a[1:]\n    return None\n")


@contextlib.contextmanager
def _stacks_by_call(recording: Recording, argv: list[str], tmp_path: Path) -> Iterator[tuple[int, dict[int, Any]]]:
    """Run a snippet that prints 'ready', waits for a line, makes its calls, prints 'done' and waits
    again; configure its process once it is ready; yield (pid, its stack records keyed by the
    sequence number of the call that captured them). The process is killed and forgotten after."""
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    w = harness.Workload(proc, tmp_path / "unused")
    try:
        w.wait_line("ready")
        assert not isinstance(recording.probe.configure(proc.pid), Unsupported)
        w.go()
        w.wait_line("done")
        stacks, calls = recording.for_pid(proc.pid)
        seq_of = {c[:3]: c[3] for c in calls}
        yield proc.pid, {seq_of[(s.ts, s.pid, s.tid)]: s for s in stacks}
    finally:
        proc.kill()
        proc.wait()
        recording.probe.forget(proc.pid)


@bpf_only
@pytest.mark.bpf
def test_thread_without_python_gets_no_thread_state(
        recording: Recording, native: Callable[[str], tuple[Path, Path]], tmp_path: Path) -> None:
    lib, _ = native(sys.executable)
    helper = tmp_path / "libnopy.so"
    src = Path(harness.__file__).parent / "nopython_thread.c"
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(helper), str(src), "-lpthread"],
                   check=True)
    snippet = ("import ctypes,sys;c=ctypes.CDLL(sys.argv[1]);h=ctypes.CDLL(sys.argv[2]);"
               "print('ready',flush=True);sys.stdin.readline()\n"
               "h.call_from_new_thread(ctypes.cast(c.cudaMalloc,ctypes.c_void_p))\n"
               "c.cudaMalloc(ctypes.byref(ctypes.c_void_p()),ctypes.c_size_t(1))\n"
               "print('done',flush=True);sys.stdin.readline()\n")
    with _stacks_by_call(recording, [sys.executable, "-c", snippet, str(lib), str(helper)],
                         tmp_path) as (pid, by_seq):
        assert by_seq[4242].status == pyframes.STATUS_NO_THREAD_STATE
        assert by_seq[4242].tid != pid and not by_seq[4242].frames
        main = by_seq[1]  # the main thread right after: its own stack, found again
        assert main.status == pyframes.STATUS_OK and main.tid == pid
        frames = StackResolver(recording.probe.targets).resolve(pid, main.frames)
        assert [(f.filename, f.qualname, f.line) for f in frames] == [("<string>", "<module>", 3)]



_PREBOUND_SNIPPET = (
    "import ctypes,sys\n"
    "sys.path.insert(0,sys.argv[2]);import _gilcall;_gilcall.open(sys.argv[1])\n"
    "c=ctypes.CDLL(sys.argv[1])\n"
    "print('ready',flush=True);sys.stdin.readline()\n"
    "_gilcall.run_in_prebound_thread(4242,lambda:c.cudaMalloc(ctypes.byref(ctypes.c_void_p()),2))\n"
    "c.cudaMalloc(ctypes.byref(ctypes.c_void_p()),ctypes.c_size_t(1))\n"
    "print('done',flush=True);sys.stdin.readline()\n"
)


@bpf_only
@pytest.mark.bpf
@pytest.mark.parametrize("interp", harness.interpreter_params(("3.10", "3.11", "debian-3.11")))
def test_thread_state_bound_after_a_call_is_found(
        recording: Recording, native: Callable[[str], tuple[Path, Path]], interp: str,
        tmp_path: Path) -> None:
    """3.10 and 3.11 start a thread with a state that carries its creator's id until the thread
    sets its own: a call made before then has no thread state, the thread's next call (its state
    now bound) has its own stack, and its creator's stack is still its own."""
    lib, gildir = native(INSTALLED[interp])
    with _stacks_by_call(recording, [INSTALLED[interp], "-c", _PREBOUND_SNIPPET, str(lib), str(gildir)],
                         tmp_path) as (pid, by_seq):
        assert sorted(by_seq) == [1, 2, 4242]
        before, after, creator = by_seq[4242], by_seq[2], by_seq[1]
        assert before.status == pyframes.STATUS_NO_THREAD_STATE and not before.frames
        assert after.tid == before.tid != pid
        assert after.status == pyframes.STATUS_OK, after.status_name
        resolver = StackResolver(recording.probe.targets)
        got = [(f.filename, f.qualname, f.line) for f in resolver.resolve(pid, after.frames)]
        assert got == [("<string>", "<lambda>", 5)]
        assert creator.status == pyframes.STATUS_OK and creator.tid == pid
        got = [(f.filename, f.qualname, f.line) for f in resolver.resolve(pid, creator.frames)]
        assert got == [("<string>", "<module>", 6)]


_FREED_SNIPPET = (
    "import ctypes,gc,sys\n"
    "m=ctypes.CDLL(sys.argv[1]).cudaMalloc\n"
    "ns={'m':m,'ref':ctypes.byref,'v':ctypes.c_void_p}\n"
    "exec(compile('def gen():\\n    m(ref(v()), 7)\\n','<gen>','exec'),ns)\n"
    "print(id(ns['gen'].__code__),flush=True);sys.stdin.readline()\n"
    "ns['gen']();ns['gen']()\n"
    "print('called',flush=True);sys.stdin.readline()\n"
    "del ns;gc.collect()\n"
    "print('freed',flush=True);sys.stdin.readline()\n"
)


def _cached(recording: Recording, pid: int, code: int) -> list[Any]:
    return [v for v in recording.bpf["pystack_code_cache"].values()
            if v.pid == pid and v.code == code and v.tag]


@bpf_only
@pytest.mark.bpf
@pytest.mark.parametrize("interp", harness.interpreter_params())
def test_code_checksums_kept_across_walks_until_the_code_is_freed(
        recording: Recording, native: Callable[[str], tuple[Path, Path]], interp: str,
        tmp_path: Path) -> None:
    """The walker keeps each code object's checksum across walks (no read of its head at every
    call) only while the code object lives: the probe on PyCode_Type's deallocator clears it."""
    lib, _ = native(INSTALLED[interp])
    proc = subprocess.Popen([INSTALLED[interp], "-c", _FREED_SNIPPET, str(lib)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    w = harness.Workload(proc, tmp_path / "unused")
    try:
        assert proc.stdout is not None
        code = int(proc.stdout.readline())
        assert not isinstance(recording.probe.configure(proc.pid), Unsupported)
        assert recording.probe.code_cache[proc.pid] is None  # the deallocator is probed
        assert not _cached(recording, proc.pid, code)
        w.go()
        w.wait_line("called")
        stacks, _ = recording.for_pid(proc.pid)
        tops = [s.frames[0] for s in stacks if s.status == pyframes.STATUS_OK]
        assert len(tops) == 2 and tops[0] == tops[1] and tops[0][0] == code
        entry = _cached(recording, proc.pid, code)
        assert len(entry) == 1 and entry[0].checksum == tops[0][2]
        frames = StackResolver(recording.probe.targets).resolve(proc.pid, stacks[-1].frames)
        assert (frames[0].filename, frames[0].qualname, frames[0].line) == ("<gen>", "gen", 2)
        w.go()
        w.wait_line("freed")
        assert not _cached(recording, proc.pid, code)  # cleared before the address is reused
    finally:
        proc.kill()
        proc.wait()
        recording.probe.forget(proc.pid)


# pasted before bpf/pystack.h: the probe's in-flight record and the walker's digest sink
_DIGEST_SINK = r"""
struct digest_inflight { u64 ts; u64 seq; u64 digest; };
BPF_HASH(digest_inflight, u64, struct digest_inflight);
static __always_inline int digest_sink(u64 key, u64 ts, u64 digest)
{
    struct digest_inflight *in = digest_inflight.lookup(&key);
    if (!in || in->ts != ts)
        return 0;
    in->digest = digest;
    return 1;
}
#define PYSTACK_DIGEST_SINK digest_sink
"""
_DIGEST_PROBE = r"""
struct digest_event { u64 ts; u64 seq; u64 digest; };
BPF_RINGBUF_OUTPUT(digest_events, 64);

int on_call_by_digest(struct pt_regs *ctx)
{
    u64 key = (u32)bpf_get_current_pid_tgid();
    struct digest_inflight in = {.ts = bpf_ktime_get_ns(), .seq = PT_REGS_PARM2(ctx)};
    digest_inflight.update(&key, &in);
    PYSTACK_CAPTURE_BY_DIGEST(ctx, in.ts, key);
}

int on_return_by_digest(struct pt_regs *ctx)
{
    u64 key = (u32)bpf_get_current_pid_tgid();
    struct digest_inflight *in = digest_inflight.lookup(&key);
    if (!in)
        return 0;
    struct digest_event *e = digest_events.ringbuf_reserve(sizeof(*e));
    if (e) {
        e->ts = in->ts;
        e->seq = in->seq;
        e->digest = in->digest;
        digest_events.ringbuf_submit(e, 0);
    }
    digest_inflight.delete(&key);
    return 0;
}
"""

_TWO_SITES = (
    "import ctypes,sys\n"
    "m=ctypes.CDLL(sys.argv[1]).cudaMalloc;p=ctypes.c_void_p()\n"
    "def site_a(i):\n    m(ctypes.byref(p),i)\n"
    "def site_b(i):\n    m(ctypes.byref(p),i)\n"
    "print('ready',flush=True)\n"
    "for line in sys.stdin:\n"
    "    site,lo,hi=line.split()\n"
    "    for i in range(int(lo),int(hi)):\n"
    "        (site_a if site=='a' else site_b)(i)\n"
    "    print('done',flush=True)\n"
)


@bpf_only
@pytest.mark.bpf
def test_a_confirmed_stack_is_sent_as_its_digest(
        native: Callable[[str], tuple[Path, Path]], tmp_path: Path) -> None:
    """PYSTACK_CAPTURE_BY_DIGEST: a stack user space has confirmed sends no record, only its
    digest (into the probe's in-flight record, for its return program); a new stack, or the same
    frames after the process is configured again (a new image's code may sit at the same
    addresses), sends its record."""
    from bcc import BPF

    lib, _ = native(sys.executable)
    harness.ensure_kernel_headers()
    bpf = BPF(text=_DIGEST_SINK + pyframes.bpf_source() + harness.PROBE_TEXT + _DIGEST_PROBE,
              cflags=["-Wno-unused-function"])
    proc = None
    try:
        bpf.attach_uprobe(name=str(lib), sym="cudaMalloc", fn_name="on_call_by_digest")
        bpf.attach_uretprobe(name=str(lib), sym="cudaMalloc", fn_name="on_return_by_digest")
        probe = PyStackProbe(bpf)
        probe.install()
        stacks: list[PyStackEvent] = []
        calls: dict[int, tuple[int, int]] = {}  # seq -> (ts, digest)
        bpf["pystacks"].open_ring_buffer(
            lambda _c, d, s: stacks.append(parse_pystack_event(ctypes.string_at(d, s))))
        bpf["digest_events"].open_ring_buffer(
            lambda _c, d, s: calls.__setitem__(*_digest_event(ctypes.string_at(d, s))))
        proc = subprocess.Popen([sys.executable, "-c", _TWO_SITES, str(lib)], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True)
        w = harness.Workload(proc, tmp_path / "unused")
        w.wait_line("ready")
        assert not isinstance(probe.configure(proc.pid), Unsupported)

        def run(site: str, lo: int, hi: int) -> list[PyStackEvent]:
            assert proc.stdin is not None
            proc.stdin.write(f"{site} {lo} {hi}\n")
            proc.stdin.flush()
            w.wait_line("done")
            before = len(stacks)
            bpf.ring_buffer_consume()
            return [s for s in stacks[before:] if s.pid == proc.pid]

        first = run("a", 1, 4)  # not confirmed yet: every call sends its record
        assert len(first) == 3 and len({(s.frames, s.digest) for s in first}) == 1
        digest = first[0].digest
        assert digest and first[0].status == pyframes.STATUS_OK
        assert [calls[i] for i in (1, 2, 3)] == [(s.ts, 0) for s in first]  # joined by key

        probe.confirm([digest])
        assert run("a", 4, 7) == []  # no record: the digest instead
        assert [calls[i][1] for i in (4, 5, 6)] == [digest] * 3
        assert probe.counts()["sent as digest"] == 3

        other = run("b", 7, 8)  # another call site: another stack, its record sent
        assert len(other) == 1 and other[0].digest not in (0, digest) and calls[7][1] == 0
        assert other[0].frames[1:] == first[0].frames[1:] and other[0].frames != first[0].frames

        assert not isinstance(probe.configure(proc.pid), Unsupported)  # a new generation
        again = run("a", 8, 9)
        assert len(again) == 1 and again[0].frames == first[0].frames
        assert again[0].digest not in (0, digest) and calls[8][1] == 0
    finally:
        if proc is not None:
            proc.kill()
            proc.wait()
        bpf.cleanup()


def _digest_event(raw: bytes) -> tuple[int, tuple[int, int]]:
    import struct as st

    ts, seq, digest = st.unpack_from("=QQQ", raw)
    return seq, (ts, digest)


_FREED_CODE = (
    "import gc,sys\n"
    "ns={};exec(compile('def victim():\\n    return 1\\n','<victim>','exec'),ns)\n"
    "c=ns['victim'].__code__;keep=[c.co_name]\n"
    "print(id(c),c.co_firstlineno,hash(c.co_name),id(c.co_filename),flush=True)\n"
    "del ns,c;gc.collect()\n"
    "print('freed',flush=True);sys.stdin.readline()\n"
)


@pytest.mark.skipif(os.geteuid() != 0, reason="reads another process's memory: needs root")
def test_a_freed_code_object_is_not_resolved_from_its_leftover_fields() -> None:
    """The allocator overwrites only a freed block's first word (its free-list link): the fields
    the resolver checks are still there, so a code object freed before it was read must be
    recognised by its reference count, or a frame would get the freed code's name with whatever
    now lies at its line table's address."""
    proc = subprocess.Popen([sys.executable, "-c", _FREED_CODE], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        addr, first, name_hash, filename = map(int, proc.stdout.readline().split())
        assert proc.stdout.readline().strip() == "freed"
        target = detect(proc.pid)
        assert not isinstance(target, Unsupported), target
        version = None  # Debian's 3.11 (sys.executable): no co_version, the name's hash instead
        frames = StackResolver({proc.pid: target}).resolve(
            proc.pid, [(addr, 0, pyframes.checksum(first, version, name_hash, filename))])
        assert not frames[0].available, frames[0]
    finally:
        proc.kill()
        proc.wait()


# A module body exec'd and freed (as site does with each line of a .pth file at start-up), then
# another module's body at the same address (the script's): same first line, same name '<module>'
# and, before 3.12, no co_version. `replace` makes the second the same size, so the allocator
# hands it the freed block.
_REUSED_MODULE = (
    "import sys\n"
    "t=compile('import os\\nx = 1\\n','<template>','exec')\n"
    "def show(c):print(id(c),c.co_firstlineno,hash(c.co_name),id(c.co_filename),flush=True)\n"
    "c=t.replace(co_filename='<string>');show(c);sys.stdin.readline()\n"
    "addr=id(c);del c;keep=[]\n"
    "for i in range(100000):\n"
    "    d=t.replace(co_filename='/srv/train/script.py')\n"
    "    if id(d)==addr:break\n"
    "    keep.append(d)\n"
    "show(d);sys.stdin.readline()\n"
)


@pytest.mark.skipif(os.geteuid() != 0, reason="reads another process's memory: needs root")
def test_a_module_body_at_a_freed_module_bodys_address_is_its_own() -> None:
    """The resolver caches code objects by (pid, address, checksum): the checksum must tell two
    module bodies apart, or every frame of the script's module gets the freed .pth line's file
    (`<module>() at <string>:6`) once a stack of the start-up was resolved."""
    proc = subprocess.Popen([sys.executable, "-c", _REUSED_MODULE], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdin is not None and proc.stdout is not None
        seen: list = []
        for _ in range(2):
            addr, first, name_hash, filename = map(int, proc.stdout.readline().split())
            if not seen:  # it runs: its interpreter is mapped
                target = detect(proc.pid)
                assert not isinstance(target, Unsupported), target
                assert target.offsets.code_version is None  # Debian's 3.11: the case without co_version
                resolver = StackResolver({proc.pid: target})
            instr = addr + target.offsets.code_adaptive  # the first instruction
            seen.append((addr, pyframes.checksum(first, None, name_hash, filename)))
            seen.append(resolver.resolve(proc.pid, [(addr, instr, seen[-1][1])])[0])
            proc.stdin.write("\n")
            proc.stdin.flush()
        (a, sum_a), first_body, (b, sum_b), second_body = seen
        assert a == b and sum_a != sum_b  # the same address, told apart by the checksum
        assert (first_body.filename, first_body.qualname) == ("<string>", "<module>"), first_body
        assert (second_body.filename, second_body.qualname) == ("/srv/train/script.py", "<module>"), second_body
    finally:
        proc.kill()
        proc.wait()


def test_a_pointer_beyond_user_space_is_an_unreadable_frame_not_a_crash() -> None:
    """A code object freed and reused between the capture and its resolution can hold any bytes:
    a name pointer past 2**63 must read as unreadable (OSError), not stop the recorder."""
    from recorder.core.pyframes import StackResolver

    resolver = StackResolver({})
    try:
        assert len(resolver._read(os.getpid(), id(resolver), 8)) == 8  # a real address reads
        with pytest.raises(OSError, match="not a user address"):
            resolver._read(os.getpid(), (1 << 64) - 8, 8)
    finally:
        resolver.close()
