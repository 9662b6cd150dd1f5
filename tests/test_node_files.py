"""Files the root recorder writes in folders other users can write: the metrics file of
--metrics-file (a textfile collector's folder is often shared). Real files and real symlinks."""

from __future__ import annotations

import os
import stat

from recorder.metrics import write_atomically


def test_the_metrics_file_is_never_written_through_a_planted_symlink(tmp_path):
    """Another user plants symlinks to a file of root's under the temporary name the recorder used
    (fixed: .NAME.PID.tmp) and at the final name: the recorder writes a new file of its own and
    renames it over the final name, so the files the links point to are left as they were."""
    folder = tmp_path / "textfile"
    folder.mkdir()
    victim = tmp_path / "shadow"
    victim.write_text("root's file\n")
    path = folder / "stall_recorder.prom"
    planted = folder / f".{path.name}.{os.getpid()}.tmp"
    planted.symlink_to(victim)
    write_atomically(path, "stall_recorder_up 1\n")
    assert victim.read_text() == "root's file\n"
    assert path.read_text() == "stall_recorder_up 1\n" and not path.is_symlink()
    assert stat.S_IMODE(path.stat().st_mode) == 0o644  # node_exporter runs as a user of its own
    assert planted.is_symlink()  # not followed, not removed
    # a symlink at the final name is replaced, its target untouched
    path.unlink()
    path.symlink_to(victim)
    write_atomically(path, "stall_recorder_up 0\n")
    assert victim.read_text() == "root's file\n" and path.read_text() == "stall_recorder_up 0\n"
    assert not path.is_symlink()
    assert sorted(p.name for p in folder.iterdir()) == sorted([path.name, planted.name])  # no temporary left

