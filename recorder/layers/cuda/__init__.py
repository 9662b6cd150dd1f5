"""The CUDA layer: the runtime and driver APIs it traces and their generated BPF programs (apis.py),
their uprobes and rows (layer.py)."""

from recorder.layers.cuda.apis import (
    API_INDEX,
    APIS,
    ARG_LAYOUTS,
    Api,
    bpf_programs,
    is_launch,
    library_kind,
    return_program,
)
from recorder.layers.cuda.layer import CUDA_COLUMNS, SOURCES, CudaLayer, cuda_stack_key

__all__ = ["API_INDEX", "APIS", "ARG_LAYOUTS", "Api", "CUDA_COLUMNS", "CudaLayer", "SOURCES", "bpf_programs",
           "cuda_stack_key", "is_launch", "library_kind", "return_program"]
