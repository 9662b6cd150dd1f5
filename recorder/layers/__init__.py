"""The layers of a recording, one module (or package) each, every one behind the contract of
recorder/core/layer.py. The session (recorder/session.py) creates them in `Session.layer_order()`.

Layers never import the session or each other (checked by `lint-imports`, see pyproject.toml).
"""

from __future__ import annotations

from recorder.core.layer import BpfSource


def bpf_sources() -> tuple[BpfSource, ...]:
    """Every layer's BPF sources in compile order (what `recorder doctor` checks up front)."""
    from recorder.layers import checkpoint, cuda, sched, task
    from recorder.layers.io import layer as io

    return sched.SOURCES + task.SOURCES + cuda.SOURCES + io.SOURCES + checkpoint.SOURCES
