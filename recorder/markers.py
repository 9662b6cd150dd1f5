"""The marker API for training scripts: steps, lineage tags and checkpoint writes.

    import recorder
    for step, batch in enumerate(loader):
        recorder.step(step)
        ...
    with recorder.lineage("checkpoint_write/run42/step80000/shard17"):
        torch.save(state, path)
    with recorder.checkpoint("/ckpt/step80000/shard17.pt"):
        torch.save(state, "/ckpt/step80000/shard17.pt")

Importing this module loads only the standard library and the small `recorder._markers` extension
(no bcc, mcp, sqlite-utils or pydantic). Each marker is a call into an exported C function that a
recorder attaches a uprobe to; when nothing records, a marker costs a C call (measured in
benchmarks/bench_markers.py). Without the extension (a build without a C compiler) the markers do
nothing and `native_markers()` is False.

Defined behaviour at the edges:
- labels may be str (encoded UTF-8; lone surrogates kept with 'surrogatepass') or bytes (used as
  they are, so non-UTF-8 labels work); the tag is the first 8 bytes of BLAKE2b of the label bytes,
  stable across processes, hosts and versions; tag 0 means "no tag" and is never produced;
- labels longer than MAX_LABEL_BYTES raise ValueError (a label is a name, not a payload);
- lineage scopes nest per thread: leaving a scope restores the enclosing tag, also on exceptions;
  scopes left out of order (a generator suspended inside one) restore what was current when that
  scope was entered;
- every thread has its own scope stack; markers are safe from any number of threads;
- checkpoint(path) works whether or not the path exists or later disappears: it marks the writing
  thread's interval, it does not touch the file.
"""

from __future__ import annotations

import hashlib
import os
import threading
from types import TracebackType

try:
    from recorder import _markers as _native
except ImportError:  # built without a C compiler: markers become no-ops
    _native = None

MAX_LABEL_BYTES = 4096
_local = threading.local()
_labels: dict[bytes, bytes] = {}  # kept alive so a recorder can read them from the process later
_labels_lock = threading.Lock()


def native_markers() -> bool:
    """True when the markers are visible to a recorder (the C extension is loaded)."""
    return _native is not None


def tag_of(label: str | bytes) -> int:
    """The stable 64-bit lineage tag of a label (never 0)."""
    raw = _label_bytes(label)
    tag = int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "little")
    return tag or 1


def _label_bytes(label: str | bytes) -> bytes:
    if isinstance(label, str):
        raw = label.encode("utf-8", "surrogatepass")
    elif isinstance(label, (bytes, bytearray, memoryview)):
        raw = bytes(label)
    else:
        raise TypeError(f"a lineage label is str or bytes, not {type(label).__name__}")
    if len(raw) > MAX_LABEL_BYTES:
        raise ValueError(f"lineage label of {len(raw)} bytes: keep labels under {MAX_LABEL_BYTES} bytes")
    return raw


def step(n: int) -> None:
    """The calling thread now works on training step n (a non-negative integer)."""
    if _native is not None:
        _native.step(n)


class lineage:  # noqa: N801 - used as a function-like context manager, as contextlib's are
    """Tag everything the calling thread does inside the block with the label's lineage tag."""

    __slots__ = ("label", "tag", "_raw", "_previous")

    def __init__(self, label: str | bytes) -> None:
        raw = _label_bytes(label)
        with _labels_lock:
            self._raw = _labels.setdefault(raw, raw)
        self.label = label
        self.tag = tag_of(raw)
        self._previous: tuple[int, bytes | None] = (0, None)

    def __enter__(self) -> lineage:
        self._previous = getattr(_local, "current", (0, None))
        _local.current = (self.tag, self._raw)
        if _native is not None:
            _native.lineage(self.tag, self._raw)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        _local.current = self._previous
        if _native is not None:
            _native.lineage(self._previous[0], self._previous[1])


def current_tag() -> int:
    """The calling thread's lineage tag, 0 outside any lineage scope."""
    return getattr(_local, "current", (0, None))[0]


class checkpoint:  # noqa: N801
    """Mark the block as writing checkpoint file `path` (opts the file into integrity checks)."""

    __slots__ = ("path", "_raw")

    def __init__(self, path: str | os.PathLike | bytes) -> None:
        self.path = path
        self._raw = os.fsencode(os.path.abspath(os.fsdecode(path)))

    def __enter__(self) -> checkpoint:
        if _native is not None:
            _native.checkpoint(self._raw, 1, current_tag())
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if _native is not None:
            _native.checkpoint(self._raw, 2, current_tag())
