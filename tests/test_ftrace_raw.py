"""tests/ftrace_raw.py (the reader of the kernel series' boot records) on this kernel's own raw pages.

A private tracefs instance takes trace_marker writes of every length class the ring buffer encodes
differently (a record up to 112 bytes has its length in the event header, a longer one in the next
word), with pauses that need a time-extend entry; its trace_pipe_raw pages, read with the instance's
header_page and ftrace/print format, must give back every string in order with rising timestamps.
"""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path

import pytest

from tests import ftrace_raw

TRACEFS = Path("/sys/kernel/tracing")
needs_instances = pytest.mark.skipif(
    os.geteuid() != 0 or not (TRACEFS / "instances").is_dir(),
    reason="needs root and tracefs instances (mount -t tracefs nodev /sys/kernel/tracing)")


@pytest.fixture
def instance():
    path = TRACEFS / "instances" / f"stall-recorder-test-{uuid.uuid4().hex[:8]}"
    path.mkdir()
    try:
        yield path
    finally:
        (path / "tracing_on").write_text("0")
        path.rmdir()


@needs_instances
def test_raw_pages_of_this_kernel_decode(instance):
    cpu = sorted(os.sched_getaffinity(0))[0]
    before = os.sched_getaffinity(0)
    # short (length in the header), long (length word), near a page, then a pause (time extend)
    texts = [f"short {i}" for i in range(3)] + ["long " + "x" * 300, "page " + "y" * 3000, "after a pause"]
    os.sched_setaffinity(0, {cpu})
    try:
        (instance / "tracing_on").write_text("1")
        fd = os.open(instance / "trace_marker", os.O_WRONLY)
        try:
            for text in texts:
                if text == "after a pause":
                    time.sleep(0.3)  # > 2^27 ns: the delta needs a time-extend entry
                os.write(fd, text.encode())
        finally:
            os.close(fd)
        (instance / "tracing_on").write_text("0")
    finally:
        os.sched_setaffinity(0, before)

    header = ftrace_raw.parse_format("header_page", (instance / "events/header_page").read_text(), "commit")
    print_fmt = ftrace_raw.parse_format("ftrace/print", (TRACEFS / "events/ftrace/print/format").read_text())
    print_id = int((TRACEFS / "events/ftrace/print/id").read_text())
    fd = os.open(instance / f"per_cpu/cpu{cpu}/trace_pipe_raw", os.O_RDONLY | os.O_NONBLOCK)
    pages = b""
    try:
        while True:
            try:
                chunk = os.read(fd, 4096)
            except BlockingIOError:
                break
            if not chunk:
                break
            pages += chunk
    finally:
        os.close(fd)
    got, stamps = [], []
    for ts, record in ftrace_raw.page_records(pages, header):
        fields = print_fmt.decode(record)
        if fields["common_type"] == print_id:
            got.append(str(fields["buf"]).rstrip("\n"))
            stamps.append(ts)
    assert got == texts
    assert stamps == sorted(stamps) and stamps[-1] - stamps[-2] >= 300_000_000
