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
  thread's interval, it does not touch the file;
- on a kernel with the I/O tag series (kernel-patches/), a lineage scope also sets the thread's
  kernel I/O tag (prctl PR_SET_IO_TAG) to the scope's tag, so the block I/O it causes, writeback of
  the pages it dirties included, completes with that tag; leaving the scope restores the enclosing
  scope's tag, or the tag the thread had before its first scope. One prctl per entry and exit; the
  kernel is checked once per process, and on any other kernel nothing is called.
"""

from __future__ import annotations

import hashlib
import os
import threading
from types import TracebackType
from typing import Any

try:
    from recorder import _markers as _native  # type: ignore[attr-defined]  # the C extension (setup.py)
except ImportError:  # built without a C compiler: markers become no-ops
    _native = None

MAX_LABEL_BYTES = 4096
# The series' prctl numbers (the next free ones in 6.12). Later kernels give 74/75 to other
# operations, so they are only called once the series is known to be there (kernel_io_tags()).
PR_SET_IO_TAG = 74
PR_GET_IO_TAG = 75
TRACEFS_FORMATS = ("/sys/kernel/tracing/events/block/block_rq_complete/format",
                   "/sys/kernel/debug/tracing/events/block/block_rq_complete/format")
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


def series_in_kernel(format_paths: tuple[str, ...] = TRACEFS_FORMATS,
                     config_paths: tuple[str, ...] | None = None) -> bool:
    """Whether the running kernel has the I/O tag series with CONFIG_BLK_IO_TAG: the io_tag field
    in block_rq_complete's format (tracefs, often root only), or the option in the kernel's
    config (/boot/config-<release>, readable by anyone). Only reads files."""
    for path in format_paths:
        try:
            with open(path, "rb") as f:
                if b" io_tag;" in f.read():
                    break
        except OSError:
            continue
    else:
        if config_paths is None:
            config_paths = (f"/boot/config-{os.uname().release}",)
        for path in config_paths:
            try:
                with open(path, "rb") as f:
                    if b"\nCONFIG_BLK_IO_TAG=y\n" in b"\n" + f.read():
                        break
            except OSError:
                continue
        else:
            return False
    return True


class _KernelTag:
    """The prctl, bound once per process; `call` is None on a kernel without the series."""

    checked = False
    call: Any = None  # libc prctl, as a ctypes function


def kernel_io_tags() -> bool:
    """True when lineage scopes set the kernel I/O tag (detected once per process: the series
    must be in the kernel and PR_GET_IO_TAG must succeed)."""
    if not _KernelTag.checked:
        _KernelTag.checked = True
        if series_in_kernel():
            import ctypes  # only on such a kernel: importing the markers stays light elsewhere

            prctl = ctypes.CDLL(None, use_errno=True).prctl
            prctl.argtypes = (ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong)
            cur = ctypes.c_uint64()
            if prctl(PR_GET_IO_TAG, ctypes.addressof(cur), 0, 0, 0) == 0:
                _KernelTag.call = prctl
    return _KernelTag.call is not None


def kernel_io_tag() -> int | None:
    """The calling thread's kernel I/O tag (PR_GET_IO_TAG), None without the series."""
    if not kernel_io_tags():
        return None
    import ctypes

    cur = ctypes.c_uint64()
    _KernelTag.call(PR_GET_IO_TAG, ctypes.addressof(cur), 0, 0, 0)
    return cur.value


def _set_kernel_tag(tag: int) -> None:
    # one syscall; a failure (not expected once detected) leaves the tag as it was
    _KernelTag.call(PR_SET_IO_TAG, tag, 0, 0, 0)


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
        previous = getattr(_local, "current", None)
        self._previous = previous or (0, None)
        if previous is None:  # the thread's first scope
            if _KernelTag.call is not None or (not _KernelTag.checked and kernel_io_tags()):
                # what the thread had before (e.g. a launcher's tag), restored outside all scopes
                _local.base_kernel_tag = kernel_io_tag()
        _local.current = (self.tag, self._raw)
        if _native is not None:
            _native.lineage(self.tag, self._raw)
        if _KernelTag.call is not None:
            _set_kernel_tag(self.tag)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        _local.current = self._previous
        if _native is not None:
            _native.lineage(self._previous[0], self._previous[1])
        if _KernelTag.call is not None:
            _set_kernel_tag(self._previous[0] or getattr(_local, "base_kernel_tag", 0) or 0)


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
