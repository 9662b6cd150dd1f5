"""The layers of a recording, one module (or package) each, every one behind the contract of
recorder/core/layer.py, and their registry: `LAYERS`, the one list the session (recorder/session.py)
creates its layers from. Its order is the order they compile their BPF, attach, open their rings,
and, within a flush phase, write their rows.

Layers never import the session or each other (checked by `lint-imports`, see pyproject.toml).
Adding one is a package here, its migration in store/migrations and one line below (docs/architecture.md,
"Adding a layer").
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from recorder.core.events import Definitions
from recorder.core.layer import BpfSource
from recorder.layers.checkpoint import CheckpointLayer
from recorder.layers.cuda.layer import CudaLayer
from recorder.layers.gpu import GpuLayer
from recorder.layers.io.layer import IoLayer
from recorder.layers.kmsg.layer import KernelLog
from recorder.layers.profile import ProfileLayer
from recorder.layers.sched import SchedLayer
from recorder.layers.task import TaskLayer
from recorder.layers.workload.layer import WorkloadLayer

LAYERS = (
    SchedLayer,
    TaskLayer,
    CudaLayer,
    WorkloadLayer,  # its BPF text after the CUDA layer's: it uses what the layers before define
    CheckpointLayer,
    IoLayer,
    ProfileLayer,  # its samples' Python stacks use the walker's perf event copy (bpf/pystack.h)
    KernelLog,
    GpuLayer,  # sampling starts once the rings are open
)


if TYPE_CHECKING:  # the type checker holds every registered layer class to the Layer protocol (make lint)
    from recorder.core.layer import Layer

    _CHECKED: tuple[type[Layer], ...] = LAYERS


def bpf_sources() -> tuple[BpfSource, ...]:
    """Every layer's BPF sources in compile order (what `recorder doctor` checks up front)."""
    return tuple(source for layer in LAYERS for source in layer.sources)


def definitions() -> Definitions:
    """Every layer's record layouts, constants and drop counters (prepended to the BPF programs)."""
    return Definitions.gather(layer.records for layer in LAYERS)
