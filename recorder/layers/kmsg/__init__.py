"""The kernel log layer: /dev/kmsg read from the session start, its lines parsed into typed events,
and their rows.

parse.py splits records and parses lines; layer.py (`KernelLog`) is the session's layer.
"""

from recorder.errors import NotPrivileged
from recorder.layers.kmsg.parse import *  # noqa: F403
from recorder.layers.kmsg.parse import __all__ as _parse_all
from recorder.layers.kmsg.parse import _subsystem_of  # noqa: F401  (tests read the subsystem rule)

__all__ = [*_parse_all, "NotPrivileged"]
