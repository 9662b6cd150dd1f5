"""The kernel log layer: /dev/kmsg of a session, opened at the session start and polled without
blocking, into the tables of store/migrations/0002_kernel_log.sql."""

from __future__ import annotations

from recorder.core.clock import now_ns
from recorder.core.layer import BaseLayer, Context, Observation, Phase
from recorder.layers import kmsg


class KernelLog(BaseLayer):
    """/dev/kmsg of a session: opened at the session start, polled without blocking."""

    name = "kmsg"
    tables = tuple(kmsg.TABLE_COLUMNS)
    losses = ()  # records the kernel overwrote before they were read are counted by the reader only
    observes = (Observation("kmsg", "kernel log (NVMe, I/O errors, IOMMU, AER, Xid, OOM)"),)
    flush_phase = Phase.DEVICES

    def __init__(self, context: Context) -> None:
        super().__init__(context)
        self.writer = context.writer
        self.session_id = context.session_id
        self.reader: kmsg.KmsgReader | None = None
        self.capability: list[tuple[str, str, str]] = []  # (probe, status, detail)

    def prepare(self) -> None:
        for table, cols in kmsg.TABLE_COLUMNS.items():
            self.writer.table(table, cols)

    def attach(self) -> None:
        """Open /dev/kmsg from the session start; what it could do goes to `capability` now."""
        self.open(self.context.store, self.context.started_ts)
        for probe, status, detail in self.capability:
            self.writer.add("capability", (self.session_id, "kmsg", probe, "", status, detail, now_ns()))

    def open(self, store, start_ns: int) -> None:
        self._next_id = (store.one("SELECT max(id) AS m FROM kernel_log")["m"] or 0) + 1
        try:
            self.reader = kmsg.KmsgReader(start_ns).open()
        except (OSError, kmsg.NotPrivileged) as e:
            self.capability.append(("/dev/kmsg", "failed", str(e)))
            return
        try:
            off = self.reader.calibrate()
            self.capability.append(("/dev/kmsg", "attached",
                                    f"printk clock offset {off.offset_ns} ns +/- {off.uncertainty_ns} ns"))
        except (OSError, RuntimeError, kmsg.NotPrivileged) as e:
            self.capability.append(("/dev/kmsg", "attached", f"printk clock not calibrated ({e})"))

    def flush(self) -> None:
        self.poll()

    def poll(self) -> int:
        """Read every record available now into rows; returns how many."""
        if self.reader is None:
            return 0
        entries = self.reader.read_available()
        cols = kmsg.TABLE_COLUMNS
        for entry in entries:
            log_id = self._next_id
            self._next_id += 1
            for table, row in kmsg.rows_for(entry, self.session_id, log_id):
                self.writer.add(table, tuple(row.get(c) for c in cols[table]))
        return len(entries)

    def finish(self, ts: int = 0) -> None:
        """At the stop: the lines logged up to now."""
        self.close_reader()

    def close_reader(self) -> None:
        if self.reader is not None:
            self.poll()
            self.reader.close()
