"""Kernel-log parser throughput: /dev/kmsg records per second through parse_record + classify,
and lines per second through classify alone, over the test fixtures (every format in
tests/fixtures/kmsg/ plus lines of other subsystems, which most of a real log is).

    .venv/bin/python benchmarks/bench_kmsg.py            # default 300000 records
    .venv/bin/python benchmarks/bench_kmsg.py -n 1000000 --json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from recorder.errors import UserError  # noqa: E402
from recorder.layers.kmsg import KmsgReader, classify, parse_record, split_dump  # noqa: E402

FIXTURES = ROOT / "tests" / "fixtures" / "kmsg"


def load_records() -> list[bytes]:
    records: list[bytes] = []
    for path in sorted(FIXTURES.glob("*.txt")):
        records.extend(split_dump(path.read_bytes()))
    return records


def rate(n: int, fn: object, items: list) -> float:
    loop = (items * (n // len(items) + 1))[:n]
    call = fn  # type: ignore[assignment]
    start = time.perf_counter()
    for item in loop:
        call(item)  # type: ignore[operator]
    return n / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-n", type=int, default=300_000, help="records per measurement")
    ap.add_argument("-j", "--json", action="store_true", help="print one JSON object")
    args = ap.parse_args()

    records = load_records()
    texts = [parse_record(r).text for r in records]
    reader = KmsgReader(start_ns=0)
    results: dict[str, float] = {
        "records": len(records),
        "parse_record_per_s": rate(args.n, parse_record, records),
        "classify_lines_per_s": rate(args.n, classify, texts),
        "parse_and_classify_per_s": rate(args.n, lambda r: classify(parse_record(r).text),
                                         records),
        "reader_ingest_per_s": rate(args.n, reader.ingest, records),
    }
    # This machine's own log, mostly lines of other subsystems (the common case), when readable.
    try:
        with KmsgReader(start_ns=0) as live:
            own = [e.record.raw for e in live.read_available()]
    except (OSError, UserError):
        own = []
    if own:
        results["own_log_records"] = len(own)
        results["own_log_ingest_per_s"] = rate(args.n, KmsgReader(start_ns=0).ingest, own)
    if args.json:
        print(json.dumps(results))
        return
    print(f"kernel log parsers over {len(records)} fixture records "
          f"({len(own)} records of this machine's log), {args.n} per measurement:")
    for key, value in results.items():
        if not key.endswith("records"):
            print(f"  {key:28s} {value:12,.0f}")


if __name__ == "__main__":
    main()
