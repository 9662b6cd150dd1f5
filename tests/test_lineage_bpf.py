"""Lineage tags and steps on real events (store/views/0006_inferred_lineage.sql): a checkpoint
shard written and fsync'd inside recorder.lineage() on an ext4 loop device, and an untagged write
in the next step. Skipped with the reason where root, BPF or loop devices are missing."""

from __future__ import annotations

import sys

import pytest
from conftest import ROOT, needs_bpf, q, run_recorder, workload_output
from test_io_bpf import ext4_loop  # noqa: F401 - the loop-device fixture

from recorder import _markers
from recorder.core.int64 import signed64

pytestmark = [needs_bpf, pytest.mark.bpf]
WORKLOAD = str(ROOT / "tests" / "workloads" / "tagged_io.py")


def test_tagged_checkpoint_write_carries_tag_label_and_step(tmp_path, native, ext4_loop):  # noqa: F811
    mnt, _, loop = ext4_loop
    db = tmp_path / "lineage.db"
    res = run_recorder("record", "--db", str(db), "--cuda-lib", str(native["libcudart.so.12"]),
                       "--cuda-lib", _markers.__file__, "--",
                       sys.executable, WORKLOAD, "--dir", str(mnt), "--libdir", str(native["dir"]), timeout=300)
    assert res.returncode == 0, res.stderr
    truth = workload_output(res.stdout)
    tag = signed64(truth["tagged"]["tag"])

    def requests(tid: int) -> list[tuple]:
        return q(db, "SELECT l.step, l.tag, l.label, l.tag_source, l.size_bytes FROM block_request_lineage l"
                     " JOIN thread t ON t.id = l.thread_id WHERE t.tid = ? AND l.device = ? AND l.op = 'write'",
                     (tid, loop))

    tagged = requests(truth["tagged"]["tid"])
    threads = q(db, "SELECT id, tid, name, first_ts, exit_ts, traced FROM thread WHERE tid IN (?, ?)",
                (truth["tagged"]["tid"], truth["untagged"]["tid"]))
    assert len(threads) == 2, threads  # one identity per thread, however late its last rows were read
    assert len(tagged) >= 2 and sum(r[4] for r in tagged) >= 1 << 20, tagged  # the shard, written back by the fsync
    assert {r[:4] for r in tagged} == {(7, tag, truth["label"], "thread")}, tagged
    untagged = requests(truth["untagged"]["tid"])
    assert len(untagged) >= 2 and sum(r[4] for r in untagged) >= 1 << 20, untagged
    assert {r[:4] for r in untagged} == {(8, None, None, None)}, untagged
    # the journal's commits (jbd2, a kernel thread) carry no tag without the kernel patch series
    kernel = q(db, "SELECT count(*), count(tag), count(step) FROM block_request_lineage"
                   " WHERE submitter_kind = 'kernel_thread' AND device = ?", (loop,))
    assert kernel[0][1:] == (0, 0)
    # the CUDA call made inside the scope carries the tag; the other thread's does not
    calls = q(db, "SELECT t.tid, l.step, l.tag, l.label FROM cuda_call_lineage l JOIN thread t ON t.id = l.thread_id"
                  " WHERE l.api = 'cudaMalloc' ORDER BY l.ts")
    assert calls == [(truth["tagged"]["tid"], 7, tag, truth["label"]),
                     (truth["untagged"]["tid"], 8, None, None)]
