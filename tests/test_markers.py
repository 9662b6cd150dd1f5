"""The marker API: importable everywhere without heavy packages, defined at the edges, and visible
to BPF (a real uprobe on the exported marker functions reads what the script said)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from conftest import ROOT, needs_bpf

import recorder

sys.path.insert(0, str(ROOT / "tests" / "pyframes"))  # not a package
import harness  # noqa: E402


def build_markers_for(python: str, dest: Path) -> Path:
    """A copy of the marker package with the extension compiled for `python`."""
    info = subprocess.run([python, "-c", "import sysconfig as s; print(s.get_paths()['include']);"
                           "print(s.get_config_var('EXT_SUFFIX'))"],
                          capture_output=True, text=True, check=True).stdout.split("\n")
    pkg = dest / "recorder"
    pkg.mkdir(parents=True)
    shutil.copy(ROOT / "recorder" / "__init__.py", pkg)
    shutil.copy(ROOT / "recorder" / "markers.py", pkg)
    subprocess.run(["gcc", "-O2", "-fPIC", "-shared", f"-I{info[0]}", "-o", str(pkg / f"_markers{info[1]}"),
                    str(ROOT / "recorder" / "_markers.c")], check=True)
    return dest


@pytest.mark.parametrize("interp", harness.interpreter_params())
def test_markers_import_light_under_every_interpreter(interp, tmp_path):
    python = harness.INTERPRETERS[interp]
    folder = build_markers_for(python, tmp_path)
    code = (
        "import sys, json, recorder\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('bcc', 'mcp', 'sqlite_utils', 'pydantic'))\n"
        "recorder.step(7)\n"
        "with recorder.lineage('checkpoint_write/run42/step80000/shard17') as l:\n"
        "    inner = recorder.current_tag()\n"
        "print(json.dumps({'heavy': heavy, 'native': recorder.native_markers(), 'tag': l.tag, 'inner': inner,"
        " 'after': recorder.current_tag()}))\n"
    )
    out = subprocess.run([python, "-c", code], capture_output=True, text=True, check=True,
                         env={"PYTHONPATH": str(folder), "PATH": os.environ["PATH"]}, cwd=tmp_path).stdout
    result = json.loads(out)
    assert result["heavy"] == [] and result["native"] is True
    # the tag is the same in every interpreter and in this process: stable across processes
    assert result["tag"] == result["inner"] == recorder.tag_of("checkpoint_write/run42/step80000/shard17")
    assert result["after"] == 0


def test_nested_scopes_restore_also_on_exceptions():
    assert recorder.current_tag() == 0
    with recorder.lineage("outer") as outer:
        assert recorder.current_tag() == outer.tag
        with pytest.raises(RuntimeError):
            with recorder.lineage("inner") as inner:
                assert recorder.current_tag() == inner.tag != outer.tag
                raise RuntimeError("boom")
        assert recorder.current_tag() == outer.tag
    assert recorder.current_tag() == 0


def test_threads_have_their_own_tags():
    errors = []
    barrier = threading.Barrier(16)

    def work(i: int) -> None:
        label = f"thread/{i}"
        with recorder.lineage(label) as scope:
            barrier.wait()
            for _ in range(2000):
                recorder.step(i)
                if recorder.current_tag() != scope.tag:
                    errors.append(i)
                    return

    threads = [threading.Thread(target=work, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert recorder.current_tag() == 0


def test_label_edges():
    raw = b"\xff\xfe not utf-8 \x00 inside"
    with recorder.lineage(raw) as scope:
        assert scope.tag == recorder.tag_of(raw) != 0
    # a str with a lone surrogate is kept, not rejected
    assert recorder.tag_of("bad \udcff half") == recorder.tag_of(b"bad \xed\xb3\xbf half")
    with pytest.raises(ValueError, match="under 4096 bytes"):
        recorder.lineage("x" * 5000)
    with pytest.raises(TypeError):
        recorder.lineage(42)


def test_checkpoint_path_that_disappears(tmp_path):
    path = tmp_path / "shard.pt"
    with recorder.checkpoint(path):
        path.write_bytes(b"data")
        path.unlink()
    with recorder.checkpoint(tmp_path / "never" / "created.pt"):
        pass


@needs_bpf
def test_markers_are_visible_to_bpf(tmp_path):
    """A uprobe on the exported marker functions reads step, tag and label from the registers and
    from the script's memory, exactly as the recorder's lineage layer does."""
    import ctypes

    from bcc import BPF

    from recorder import _markers
    from recorder.core import kheaders

    kheaders.locate()
    text = r"""
    #include <uapi/linux/ptrace.h>
    struct marker_t { u64 kind; u64 value; u64 len; u32 tid; u32 pad; char label[64]; };
    BPF_RINGBUF_OUTPUT(marks, 16);
    int on_step(struct pt_regs *ctx) {
        struct marker_t m = {};
        m.kind = 1; m.value = PT_REGS_PARM1(ctx); m.tid = (u32)bpf_get_current_pid_tgid();
        marks.ringbuf_output(&m, sizeof(m), 0);
        return 0;
    }
    int on_lineage(struct pt_regs *ctx) {
        struct marker_t m = {};
        m.kind = 2; m.value = PT_REGS_PARM1(ctx); m.len = PT_REGS_PARM3(ctx);
        m.tid = (u32)bpf_get_current_pid_tgid();
        if (PT_REGS_PARM2(ctx))
            bpf_probe_read_user_str(m.label, sizeof(m.label), (void *)PT_REGS_PARM2(ctx));
        marks.ringbuf_output(&m, sizeof(m), 0);
        return 0;
    }
    """
    b = BPF(text=text)
    lib = _markers.__file__
    b.attach_uprobe(name=lib, sym="stall_recorder_step", fn_name="on_step", pid=os.getpid())
    b.attach_uprobe(name=lib, sym="stall_recorder_lineage", fn_name="on_lineage", pid=os.getpid())
    seen = []

    class Mark(ctypes.Structure):
        _fields_ = [("kind", ctypes.c_uint64), ("value", ctypes.c_uint64), ("len", ctypes.c_uint64),
                    ("tid", ctypes.c_uint32), ("pad", ctypes.c_uint32), ("label", ctypes.c_char * 64)]

    def cb(ctx, data, size):
        m = ctypes.cast(data, ctypes.POINTER(Mark)).contents
        seen.append((m.kind, m.value, m.len, m.tid, m.label))

    b["marks"].open_ring_buffer(cb)
    try:
        recorder.step(80042)
        with recorder.lineage("checkpoint_write/run42/step80000/shard17") as scope:
            pass
        b.ring_buffer_poll(200)
    finally:
        b.cleanup()
    tid = threading.get_native_id()
    label = b"checkpoint_write/run42/step80000/shard17"
    assert (1, 80042, 0, tid, b"") in seen
    assert (2, scope.tag, len(label), tid, label) in seen
    assert (2, 0, 0, tid, b"") in seen  # leaving the scope restores "no tag"


