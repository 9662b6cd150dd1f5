"""stall-recorder. Training scripts use the markers: `recorder.step(n)`, `recorder.lineage(label)`,
`recorder.checkpoint(path)`; importing them pulls in nothing but the standard library."""

from recorder.markers import checkpoint, current_tag, lineage, native_markers, step, tag_of

__all__ = ["checkpoint", "current_tag", "lineage", "native_markers", "step", "tag_of"]
__version__ = "0.1.0"
