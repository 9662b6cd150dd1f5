"""The layers of a recording, one module (or package) each, every one behind the contract of
recorder/core/layer.py. The session (recorder/session.py) creates them in `Session.layer_order()`.

Layers never import the session or each other (checked by `lint-imports`, see pyproject.toml).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from recorder.core.layer import BpfSource

if TYPE_CHECKING:  # the type checker holds every layer class to the Layer protocol (make lint)
    from recorder.core.layer import Layer
    from recorder.layers.checkpoint import CheckpointLayer
    from recorder.layers.cuda.layer import CudaLayer
    from recorder.layers.gpu import GpuLayer
    from recorder.layers.io.layer import IoLayer
    from recorder.layers.kmsg.layer import KernelLog
    from recorder.layers.sched import SchedLayer
    from recorder.layers.task import TaskLayer
    from recorder.layers.workload.layer import WorkloadLayer

    CHECKED: tuple[type[Layer], ...] = (SchedLayer, TaskLayer, CudaLayer, CheckpointLayer, WorkloadLayer, KernelLog,
                                        GpuLayer)
    # its finish() returns how many requests went to `loss` (finish() -> None in the contract): the
    # contract's fix, not a cast here (then this ignore is reported unused and goes)
    CHECKED_IO: type[Layer] = IoLayer  # type: ignore[assignment]


def bpf_sources() -> tuple[BpfSource, ...]:
    """Every layer's BPF sources in compile order (what `recorder doctor` checks up front)."""
    from recorder.layers import checkpoint, cuda, sched, task
    from recorder.layers.io import layer as io

    return sched.SOURCES + task.SOURCES + cuda.SOURCES + io.SOURCES + checkpoint.SOURCES
