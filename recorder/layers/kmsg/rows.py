"""Rows for the tables of store/migrations/0002_kernel_log.sql from what the reader yields."""

from __future__ import annotations

from typing import Any

from recorder.layers.kmsg.parsers import _field_names
from recorder.layers.kmsg.parsers.common import KernelEvent, UnknownSubsystemLine
from recorder.layers.kmsg.reader import KernelLogEntry, _event_key
from recorder.layers.kmsg.record import _INT64_MAX

# --------------------------------------------------------------------------------------------
# Rows for the store
# --------------------------------------------------------------------------------------------

def _sql_value(value: Any) -> Any:
    # SQLite integers are signed 64-bit: addresses >= 2^63 are stored two's-complement (as
    # Perfetto does); a number too large even for that is left NULL (the text keeps it).
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int) and value > _INT64_MAX:
        return value - 2**64 if value < 2**64 else None
    if isinstance(value, int) and value < -_INT64_MAX - 1:
        return None
    return value


def _event_row(event: KernelEvent) -> dict[str, Any]:
    cls = type(event)
    row = {name: _sql_value(getattr(event, name)) for name in _field_names(cls)}
    row["kind"] = event.kind
    vendor = getattr(cls, "vendor", None)
    if vendor is not None:
        row["vendor"] = vendor
    return row


def rows_for(entry: KernelLogEntry, session_id: int,
             kernel_log_id: int | None = None) -> list[tuple[str, dict[str, Any]]]:
    """Rows to insert for one entry: always the `kernel_log` row first, then the typed row when
    the line parsed. A batched writer passes `kernel_log_id` (the id it assigns to the
    `kernel_log` row, which the typed row then references); without it the typed row's
    `kernel_log_id` is None and the writer sets it to the `cursor.lastrowid` of the first row.
    `TABLE_COLUMNS` gives a fixed column order for positional inserts."""
    record, event = entry.record, entry.event
    subsystem = device = event_kind = None
    if isinstance(event, UnknownSubsystemLine):
        subsystem, event_kind = event.subsystem, event.kind
    elif event is not None:
        subsystem, event_kind, device = event.subsystem, _event_key(event), event.device_name
    if device is None:
        device = record.properties.get("DEVICE")
    props = record.properties
    log_row: dict[str, Any] = {
        "id": kernel_log_id,
        "session_id": session_id,
        "ts": entry.ts_ns,
        "printk_ts": record.ts_ns,
        "seq": _sql_value(record.seq),
        "level": record.level,
        "facility": _sql_value(record.facility),
        "flag": record.flag or None,
        "caller": record.caller,
        "subsystem": subsystem,
        "event_kind": event_kind,
        "device": device,
        "text": record.text,
        "properties": "\n".join(f"{k}={v}" for k, v in props.items()) if props else None,
        "malformed": int(record.malformed),
        "raw": record.raw if record.malformed else None,
    }
    rows: list[tuple[str, dict[str, Any]]] = [("kernel_log", log_row)]
    if isinstance(event, KernelEvent):
        typed = _event_row(event)
        typed.update(session_id=session_id, kernel_log_id=kernel_log_id, ts=entry.ts_ns)
        rows.append((event.table, typed))
    return rows


def _table_columns() -> dict[str, tuple[str, ...]]:
    kernel_log = ("id", "session_id", "ts", "printk_ts", "seq", "level", "facility", "flag",
                  "caller", "subsystem", "event_kind", "device", "text", "properties",
                  "malformed", "raw")
    out: dict[str, list[str]] = {}
    for model in KernelEvent.__subclasses__():
        cols = out.setdefault(model.table, ["session_id", "kernel_log_id", "ts", "kind"])
        if hasattr(model, "vendor") and "vendor" not in cols:
            cols.append("vendor")
        cols.extend(name for name in _field_names(model) if name not in cols)
    return {"kernel_log": kernel_log, **{table: tuple(cols) for table, cols in out.items()}}


# Columns rows_for can fill, per table (typed tables: without `id`, which SQLite assigns).
TABLE_COLUMNS: dict[str, tuple[str, ...]] = _table_columns()
