"""--ship: every incident saved is uploaded to an object store (its file and its Parquet export,
store/exports/parquet.py `ship_incident`), by one thread in turn (an export is CPU work: never
several at once); what the store does not take stays in the spool beside the recording for the
next incident. At the stop the uploads still under way get SHIP_WAIT_S in all."""

from __future__ import annotations

import queue
import socket
import sqlite3
import threading
import time
from collections.abc import Callable
from pathlib import Path

from store.errors import UserError

SHIP_WAIT_S = 60.0  # at stop, how long the incidents still to upload are waited for, in all


class Shipper:
    """Uploads the incidents queued with ship(), oldest first, from a thread started with the first."""

    def __init__(self, url: str, db_path: Path, note_error: Callable[[str], None]) -> None:
        self.url = url
        self.db_path = db_path  # the spool is the recording's (store/objectstore.py spool_folder)
        self.note_error = note_error
        self._to_ship: queue.Queue[Path | None] = queue.Queue()
        self._shipper: threading.Thread | None = None

    def ship(self, out: Path) -> None:
        """Queue the incident for the shipper thread (started with the first one)."""
        self._to_ship.put(out)
        if self._shipper is None:
            self._shipper = threading.Thread(target=self._ship_all, name="stall-ship", daemon=True)
            self._shipper.start()

    def _ship_all(self) -> None:
        """Upload each queued incident (its file and its Parquet export), oldest first."""
        from store.exports.parquet import ship_incident
        from store.objectstore import spool_folder

        spool = spool_folder(self.db_path)
        while (out := self._to_ship.get()) is not None:
            began = time.monotonic()
            try:
                result = ship_incident(out, self.url, socket.gethostname(), spool)
            except (UserError, sqlite3.Error, OSError, ValueError) as e:  # this incident; the thread goes on
                self.note_error(f"shipping {out.name}: {e}")
                continue
            for line in result.get("quarantined", []):  # an entry that failed a check, set aside
                self.note_error(f"shipping: {line}")
            if result["pending"]:
                self.note_error(f"shipping {out.name}: the store did not take it ({result['error']}); "
                                f"{result['pending']} upload(s) kept in {result['spool']} for the next incident")
            else:
                print(f"recorder: incident shipped: {out.name} to {result['url']} in "
                      f"{time.monotonic() - began:.1f} s"
                      + (f" (and {len(result['uploaded']) - 2} spooled upload(s))" if len(result["uploaded"]) > 2
                         else ""), flush=True)

    def finish(self) -> None:
        """At stop: uploads still under way get their retries; what the store does not take stays spooled."""
        if self._shipper is None:
            return
        self._to_ship.put(None)
        self._shipper.join(timeout=SHIP_WAIT_S)
        left = []
        while not self._to_ship.empty():
            out = self._to_ship.get_nowait()
            if out is not None:
                left.append(out)
        if self._shipper.is_alive() or left:
            names = ", ".join(o.name for o in left) or "the one under way"
            self.note_error(f"--ship: not all incidents were uploaded within {SHIP_WAIT_S:g} s of the stop "
                            f"({names}): upload each with 'recorder export --parquet {self.url} "
                            f"--db INCIDENT'")
