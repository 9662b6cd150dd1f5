"""recorder/core/btf.py against bpftool's reading of the same /sys/kernel/btf/vmlinux."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from recorder.core import btf

pytestmark = [
    pytest.mark.skipif(not Path(btf.VMLINUX_BTF).exists(), reason="kernel has no BTF"),
    pytest.mark.skipif(shutil.which("bpftool") is None, reason="bpftool not installed"),
]

_TYPE = re.compile(r"^\[(\d+)\] (\w+) '([^']*)'")
_MEMBER = re.compile(r"^\s+'([^']*)' type_id=(\d+) bits_offset=(\d+)")


def _bpftool_structs() -> dict[str, list[tuple[str, int, int]]]:
    """struct name -> [(member, type id, bit offset)] from `bpftool btf dump ... format raw`."""
    out = subprocess.run(["bpftool", "btf", "dump", "file", btf.VMLINUX_BTF, "format", "raw"],
                         capture_output=True, text=True, check=True).stdout
    structs: dict[str, list[tuple[str, int, int]]] = {}
    current: list[tuple[str, int, int]] | None = None
    for line in out.splitlines():
        t = _TYPE.match(line)
        if t:
            current = None
            if t.group(2) in ("STRUCT", "UNION") and t.group(3) not in structs:
                current = structs[t.group(3)] = []
            continue
        m = _MEMBER.match(line)
        if m and current is not None:
            current.append((m.group(1), int(m.group(2)), int(m.group(3))))
    return structs


def test_fsbase_offset_matches_bpftool() -> None:
    structs = _bpftool_structs()
    thread = dict((n, bits) for n, _, bits in structs["task_struct"])["thread"]
    fsbase = dict((n, bits) for n, _, bits in structs["thread_struct"])["fsbase"]
    assert btf.member_offset("task_struct.thread.fsbase") == (thread + fsbase) // 8


def test_every_named_member_of_core_structs_matches_bpftool() -> None:
    structs = _bpftool_structs()
    parsed = btf.vmlinux()
    for name in ("task_struct", "thread_struct", "mm_struct", "request", "bio"):
        for member, _type_id, bits in structs[name]:
            if member and member != "(anon)" and bits % 8 == 0:
                assert parsed.member_offset(f"{name}.{member}") == bits // 8, (name, member)


def test_errors_say_what_is_missing() -> None:
    with pytest.raises(btf.BTFError, match="no member 'nope'"):
        btf.member_offset("task_struct.thread.nope")
    with pytest.raises(btf.BTFError, match="no struct or union"):
        btf.member_offset("no_such_struct.x")
    with pytest.raises(btf.BTFError, match="bad BTF magic"):
        btf.BTF(b"\0" * 32)
