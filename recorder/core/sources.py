"""What a layer compiles: its BPF files and the tracepoints each needs. A module of its own because
both sides use it: a layer declares its sources (recorder/core/layer.py) and the loader compiles
them (recorder/core/loader.py), and the loader knows no layer."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BpfSource:
    """One BPF file of a layer: compiled when every `required` tracepoint exists (else the layer is
    recorded as absent); `optional` tracepoints get HAVE_TP_<system>_<event> when present;
    `not_recorded` ones are listed in `capability` so a reader knows they were not used;
    `optional_fields` (tracepoint, field) get HAVE_TPF_<system>_<event>_<field> when the running
    kernel's format has that field. `filename` is a file of bpf/, or an absolute path (a layer
    package's own file)."""

    layer: str
    filename: str
    required: tuple[str, ...] = ()
    optional: tuple[str, ...] = ()
    not_recorded: tuple[str, ...] = ()
    optional_fields: tuple[tuple[str, str], ...] = ()
