"""The workload layer: what the traced program says about itself, through NCCL (nccl.py: the APIs
and their generated BPF programs) and the recorder's markers (layer.py: attaching and rows)."""
