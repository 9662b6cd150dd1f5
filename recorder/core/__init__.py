"""The recorder's machinery that knows no layer: the BPF loader, ring readers, record layouts,
thread identity, Python and native stacks, ELF and BTF readers, library discovery, the clock,
settings and the layer contract. Nothing here imports `recorder.layers` or the session."""
