"""Fuzzing the kernel-log parsers: no input may raise, and no line of a watched subsystem may be
dropped (it parses or comes back as an UnknownSubsystemLine, and the reader counts it).

The bulk is a fast, deterministically seeded loop of random mutations of the real fixture lines
and records (1,000,000+ lines); hypothesis adds structure: arbitrary bytes and text, edits of
fixture lines, and round trips of each format with generated field values.
"""

from __future__ import annotations

import multiprocessing
import os
import random
import sqlite3
import string
import time
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from recorder.layers import kmsg
from recorder.layers.kmsg import (
    AerStatusMask,
    AmdViEvent,
    BlockIOError,
    DmarFault,
    KernelEvent,
    KernelLogEntry,
    KmsgReader,
    NvmeTimeout,
    OomKilled,
    SwiotlbFull,
    UnknownSubsystemLine,
    XidError,
    classify,
    parse_record,
    rows_for,
    split_dump,
)

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures" / "kmsg"
MIGRATION = ROOT / "store" / "migrations" / "0002_kernel_log.sql"

SEED = 0x5EED_4B4D
TEXT_LINES = 700_000  # mutated message texts through classify()
RECORD_LINES = 320_000  # mutated raw records through KmsgReader.ingest()
DB_SAMPLE_EVERY = 41  # every Nth typed event also goes through rows_for into SQLite

RECORDS = [r for p in sorted(FIXTURES.glob("*.txt")) for r in split_dump(p.read_bytes())]
TEXTS = [parse_record(r).text for r in RECORDS]

# Characters that matter to the parsers (digits, hex, separators, brackets) plus hostile ones.
ALPHABET = (string.digits + "abcdefxABCDEF:,.;()[]=/-_ '\"<>\\" + "\t\n\x00\x7f\u00e9\u2028"
            + "IOQDMARnvmeoAERNV")
NUMBERS = ["0", "1", "-1", "0x0", "0xffffffffffffffff", "18446744073709551616", "4294967295",
           "9" * 25, "0x" + "f" * 20, "00", "-", ""]


def _mutate_text(rng: random.Random, s: str) -> str:
    for _ in range(rng.randint(1, 3)):
        n = len(s)
        op = rng.randrange(9)
        i = rng.randrange(n + 1)
        j = min(n, i + rng.randint(1, 12))
        if op == 0:  # delete a slice
            s = s[:i] + s[j:]
        elif op == 1:  # insert random characters
            s = s[:i] + "".join(rng.choices(ALPHABET, k=rng.randint(1, 6))) + s[i:]
        elif op == 2:  # replace a digit run with an awkward number
            k = i
            while k < n and not s[k].isdigit():
                k += 1
            e = k
            while e < n and s[e].isalnum():
                e += 1
            s = s[:k] + rng.choice(NUMBERS) + s[e:]
        elif op == 3:  # duplicate a slice
            s = s[:j] + s[i:j] + s[j:]
        elif op == 4:  # truncate
            s = s[:i]
        elif op == 5:  # splice with another real line
            other = rng.choice(TEXTS)
            s = s[:i] + other[rng.randrange(len(other) + 1):]
        elif op == 6 and n > 1:  # swap two characters
            a, b = rng.randrange(n), rng.randrange(n)
            chars = list(s)
            chars[a], chars[b] = chars[b], chars[a]
            s = "".join(chars)
        elif op == 7 and n:  # replace one character
            s = s[:i] + rng.choice(ALPHABET) + s[i + 1:]
        else:  # change case of a slice
            s = s[:i] + s[i:j].swapcase() + s[j:]
    return s


def _mutate_record(rng: random.Random, raw: bytes) -> bytes:
    op = rng.randrange(6)
    if op == 0:  # mangle the header
        head, _, body = raw.partition(b";")
        fields = head.split(b",")
        k = rng.randrange(len(fields))
        fields[k] = rng.choice([b"", b"-1", b"x", b"99999999999999999999999", b"c", b"+",
                                b"caller=T1", fields[k] * 2])
        if rng.random() < 0.2:
            fields = fields[: rng.randrange(len(fields) + 1)]
        return b",".join(fields) + (b";" if rng.random() < 0.9 else b"") + body
    if op == 1:  # add or break continuation lines
        return raw + rng.choice([b" SUBSYSTEM=pci\n", b" DEVICE=+pci:0000:01:00.0\n", b" X\n",
                                 b"no leading space\n", b" =v\n", b"\n\n"])
    if op == 2:  # escape sequences, valid and not
        i = rng.randrange(len(raw) + 1)
        return raw[:i] + rng.choice([b"\\x41", b"\\x0a", b"\\x5c", b"\\xff", b"\\x", b"\\xZZ",
                                     b"\\", b"\\xc3\\xa9"]) + raw[i:]
    if op == 3:  # random bytes
        i = rng.randrange(len(raw) + 1)
        return raw[:i] + rng.randbytes(rng.randint(1, 8)) + raw[i:]
    head, sep, body = raw.partition(b";")
    text = body.split(b"\n", 1)[0].decode("utf-8", "replace")
    return head + sep + _mutate_text(rng, text).encode("utf-8", "surrogatepass") + b"\n"


def _check_line(text: str, result: object) -> str:
    """The no-drop invariant for one line; returns the result's counter key."""
    subsystem = kmsg._subsystem_of(text)
    if result is None:
        assert subsystem is None, f"watched-subsystem line dropped: {text!r}"
        return "none"
    if isinstance(result, UnknownSubsystemLine):
        assert (result.subsystem, result.text) == (subsystem, text)
        return "unknown"
    assert isinstance(result, KernelEvent) and result.subsystem == subsystem, (text, result)
    return f"{result.table}.{result.kind}"


def _fresh_db() -> sqlite3.Connection:
    db = sqlite3.connect(":memory:")
    db.execute("CREATE TABLE session(id INTEGER PRIMARY KEY)")
    db.execute("INSERT INTO session(id) VALUES (1)")
    db.executescript(MIGRATION.read_text())
    return db


def _insert(db: sqlite3.Connection, entry: KernelLogEntry, session_id: int = 1) -> None:
    log_id = None
    for table, row in rows_for(entry, session_id):
        if table != "kernel_log":
            row["kernel_log_id"] = log_id
        cur = db.execute(f"INSERT INTO {table} ({', '.join(row)}) VALUES "
                         f"({', '.join('?' * len(row))})", list(row.values()))
        log_id = cur.lastrowid if table == "kernel_log" else log_id


def _fuzz_share(worker: int, workers: int) -> dict[str, object]:
    """One worker's share of the bulk loop: lines n = worker, worker + workers, ... with its own
    deterministic generator, so the whole run is the same on every machine and worker count."""
    rng = random.Random(SEED + worker)
    counts: Counter[str] = Counter()
    db = _fresh_db()
    inserted = 0

    # 1. message texts straight into classify()
    for n in range(worker, TEXT_LINES, workers):
        text = _mutate_text(rng, TEXTS[n % len(TEXTS)])
        result = classify(text)
        counts[_check_line(text, result)] += 1
        if isinstance(result, KernelEvent) and n % DB_SAMPLE_EVERY == 0:
            record = parse_record(b"4,%d,1,-;x\n" % n)
            _insert(db, KernelLogEntry(record=record, event=result, read_ts_ns=1))
            inserted += 1

    # 2. whole records through the reader's counting path
    reader = KmsgReader(start_ns=0)
    seen_unknown = seen_malformed = 0
    for n in range(worker, RECORD_LINES, workers):
        raw = _mutate_record(rng, RECORDS[n % len(RECORDS)])
        entry = reader.ingest(raw)
        assert entry is not None and entry.record.raw == raw
        key = _check_line(entry.record.text, entry.event)
        counts[key] += 1
        seen_unknown += key == "unknown"
        seen_malformed += entry.record.malformed
        if n % DB_SAMPLE_EVERY == 0:
            # the mutated record itself, header and all; a session of its own because mutated
            # headers repeat seqs and UNIQUE (session_id, seq) would refuse them
            db.execute("INSERT INTO session(id) VALUES (?)", (n + 2,))
            _insert(db, entry, session_id=n + 2)
            inserted += isinstance(entry.event, KernelEvent)

    stats = reader.stats
    assert stats.unknown == seen_unknown and stats.malformed == seen_malformed
    typed_rows = sum(db.execute(f"SELECT count(*) FROM {t}").fetchone()[0] for t in (
        "nvme_event", "block_error", "swiotlb_event", "iommu_fault", "aer_event", "gpu_xid",
        "oom_kill"))
    assert typed_rows == inserted
    return {"counts": counts, "records_read": stats.records_read, "malformed": stats.malformed,
            "inserted": inserted}


def test_million_mutated_lines() -> None:
    workers = min(2, os.cpu_count() or 1)
    started = time.perf_counter()
    with multiprocessing.get_context("fork").Pool(workers) as pool:
        shares = pool.starmap(_fuzz_share, [(w, workers) for w in range(workers)])
    elapsed = time.perf_counter() - started

    counts: Counter[str] = sum((s["counts"] for s in shares), Counter())  # type: ignore[misc]
    total = sum(counts.values())
    assert total == TEXT_LINES + RECORD_LINES >= 1_000_000
    assert sum(s["records_read"] for s in shares) == RECORD_LINES  # type: ignore[misc]
    malformed = sum(s["malformed"] for s in shares)  # type: ignore[misc]
    inserted = sum(s["inserted"] for s in shares)  # type: ignore[misc]
    assert malformed > 10_000
    assert counts["unknown"] > 10_000 and counts["none"] > 10_000
    typed = {k: v for k, v in counts.items() if k not in ("unknown", "none")}
    assert len(typed) >= 20, typed  # mutations keep most formats parseable
    assert inserted > 4_000
    print(f"\nfuzzed {total:,} lines in {elapsed:.1f} s on {workers} processes: "
          f"{counts['unknown']:,} unknown kept, {counts['none']:,} other, "
          f"{sum(typed.values()):,} typed in {len(typed)} kinds, {malformed:,} malformed "
          f"records, {inserted:,} typed rows inserted into SQLite")


# ---- hypothesis: structure -------------------------------------------------------------------

FAST = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FAST
@given(st.binary(max_size=600))
def test_parse_record_never_raises(raw: bytes) -> None:
    record = parse_record(raw)
    assert record.raw == raw
    _check_line(record.text, classify(record.text))


@FAST
@given(st.text(max_size=400))
def test_classify_any_text(text: str) -> None:
    _check_line(text, classify(text))


@FAST
@given(st.sampled_from(TEXTS),
       st.lists(st.tuples(st.integers(0, 300), st.integers(0, 12), st.text(max_size=8)),
                max_size=4))
def test_classify_edited_fixture_lines(text: str, edits: list[tuple[int, int, str]]) -> None:
    for pos, cut, insert in edits:
        text = text[:pos] + insert + text[pos + cut:]
    _check_line(text, classify(text))


u8, u16, u32, u64 = (st.integers(0, 2**b - 1) for b in (8, 16, 32, 64))
word = st.text(string.ascii_letters + "_", min_size=1, max_size=12)
name = st.text(string.ascii_letters + string.digits + "_-.", min_size=1, max_size=15)
driver_name = st.text(string.ascii_lowercase + string.digits + "_", min_size=1, max_size=15)


@FAST
@given(u32, u16, u8, u16, st.sampled_from(["aborting", "reset controller", "disable controller"]),
       st.sampled_from(["READ", "WRITE", "FLUSH", "DISCARD"]), u8, u32)
def test_roundtrip_nvme_timeout(tag: int, cid: int, opcode: int, qid: int, action: str, op: str,
                                op_code: int, size: int) -> None:
    text = (f"nvme nvme3: I/O tag {tag} ({cid:04x}) opcode {opcode:#x} (I/O Cmd) QID {qid} "
            f"timeout, {action} req_op:{op}({op_code}) size:{size}")
    assert classify(text) == NvmeTimeout(controller="nvme3", tag=tag, command_id=cid,
                                         opcode=opcode, opcode_name="I/O Cmd", qid=qid,
                                         action=action, req_op=op, req_op_code=op_code,
                                         size_bytes=size)


# the op names the kernel prints (blk_op_str); an arbitrary word could be another subsystem's keyword
BLOCK_OPS = st.sampled_from(["READ", "WRITE", "FLUSH", "DISCARD", "SECURE_ERASE", "ZONE_RESET", "ZONE_RESET_ALL",
                             "ZONE_OPEN", "ZONE_CLOSE", "ZONE_FINISH", "ZONE_APPEND", "WRITE_ZEROES", "DRV_IN",
                             "DRV_OUT", "UNKNOWN"])


@FAST
@given(st.sampled_from(["I/O", "timeout", "critical medium", "critical target", "protection"]),
       name, u64, u8, BLOCK_OPS, u32, u16, st.integers(0, 7))
def test_roundtrip_block_error(err: str, dev: str, sector: int, op_code: int, op: str,
                               flags: int, seg: int, prio: int) -> None:
    text = (f"{err} error, dev {dev}, sector {sector} op {op_code:#x}:({op}) flags {flags:#x} "
            f"phys_seg {seg} prio class {prio}")
    assert classify(text) == BlockIOError(error=err, dev=dev, sector=sector, op_code=op_code,
                                          op=op, flags=flags, phys_seg=seg, prio_class=prio)


@pytest.mark.parametrize("dev", ["swiotlb0", "oom1", "AER:x", "nvme0n1", "NVRM:", "AMD-Vi", "DMAR:2"])
def test_a_block_error_on_a_device_named_like_another_subsystem(dev: str) -> None:
    """The device name is the administrator's: a keyword of another subsystem in it (found by the
    round trip above) does not make the line that subsystem's."""
    text = f"I/O error, dev {dev}, sector 42 op 0x1:(WRITE) flags 0x800 phys_seg 1 prio class 2"
    assert classify(text) == BlockIOError(error="I/O", dev=dev, sector=42, op_code=1, op="WRITE", flags=0x800,
                                          phys_seg=1, prio_class=2)


pci = st.tuples(u16, u8, st.integers(0, 31), st.integers(0, 7)).map(
    lambda t: f"{t[0]:04x}:{t[1]:02x}:{t[2]:02x}.{t[3]}")


@FAST
@given(driver_name, pci, u32, u32, u32)
def test_roundtrip_swiotlb(driver: str, dev: str, size: int, total: int, used: int) -> None:
    text = (f"{driver} {dev}: swiotlb buffer is full (sz: {size} bytes), total {total} (slots), "
            f"used {used} (slots)")
    assert classify(text) == SwiotlbFull(driver=driver, device=dev, size_bytes=size,
                                         total_slots=total, used_slots=used)


@FAST
@given(st.sampled_from(["Read", "Write"]), st.one_of(st.none(), st.integers(0, 2**20 - 1)), u8,
       st.integers(0, 31), st.integers(0, 7), u64, u8, st.booleans())
def test_roundtrip_dmar_fault(access: str, pasid: int | None, bus: int, slot: int, fn: int,
                              addr: int, reason: int, hex_dev: bool) -> None:
    tag = "NO_PASID" if pasid is None else f"PASID {pasid:#x}"
    dev = f"{bus:#04x}:{slot:#04x}.{fn}" if hex_dev else f"{bus:02x}:{slot:02x}.{fn}"
    text = (f"DMAR: [DMA {access} {tag}] Request device [{dev}] fault addr {addr:#x} "
            f"[fault reason {reason:#04x}] PTE access is not set")
    assert classify(text) == DmarFault(access=access.lower(), pasid=pasid,
                                       device=f"{bus:02x}:{slot:02x}.{fn}", address=addr,
                                       fault_reason=reason, reason_text="PTE access is not set")


@FAST
@given(pci, u16, u64, u16)
def test_roundtrip_amd_vi(dev: str, domain: int, addr: int, flags: int) -> None:
    text = (f"AMD-Vi: Event logged [IO_PAGE_FAULT device={dev} domain={domain:#06x} "
            f"address={addr:#018x} flags={flags:#06x}]")
    assert classify(text) == AmdViEvent(event_type="IO_PAGE_FAULT", device=dev, domain=domain,
                                        address=addr, flags=flags)


@FAST
@given(pci, u16, u16, u32, u32)
def test_roundtrip_aer_status(dev: str, vendor: int, device: int, status: int, mask: int) -> None:
    text = (f"pcieport {dev}: AER:   device [{vendor:04x}:{device:04x}] error status/mask="
            f"{status:08x}/{mask:08x}")
    assert classify(text) == AerStatusMask(driver="pcieport", device=dev, vendor_id=vendor,
                                           device_id=device, status=status, mask=mask)


@FAST
@given(u16, u8, st.integers(0, 31), st.integers(0, 200), st.integers(1, 2**22), name,
       st.text(string.printable.strip(), max_size=60))
def test_roundtrip_xid(dom: int, bus: int, slot: int, xid: int, pid: int, proc: str,
                       msg: str) -> None:
    dev = f"{dom:04x}:{bus:02x}:{slot:02x}"
    text = f"NVRM: Xid (PCI:{dev}): {xid}, pid={pid}, name={proc}, {msg}"
    got = classify(text)
    assert isinstance(got, XidError)
    assert (got.device, got.xid, got.pid) == (dev, xid, pid)
    if "," not in proc:
        assert (got.process_name, got.message) == (proc, msg)


@FAST
@given(st.booleans(), st.integers(1, 2**22), name, u32, u32, u32, u32, u32, u32,
       st.integers(-1000, 1000))
def test_roundtrip_oom_killed(memcg: bool, pid: int, comm: str, vm: int, anon: int, file: int,
                              shmem: int, uid: int, pgt: int, adj: int) -> None:
    prefix = "Memory cgroup out of memory" if memcg else "Out of memory"
    text = (f"{prefix}: Killed process {pid} ({comm}) total-vm:{vm}kB, anon-rss:{anon}kB, "
            f"file-rss:{file}kB, shmem-rss:{shmem}kB, UID:{uid} pgtables:{pgt}kB "
            f"oom_score_adj:{adj}")
    assert classify(text) == OomKilled(
        scope="memcg" if memcg else "system", pid=pid, comm=comm, total_vm_bytes=vm * 1024,
        anon_rss_bytes=anon * 1024, file_rss_bytes=file * 1024, shmem_rss_bytes=shmem * 1024,
        uid=uid, pgtables_bytes=pgt * 1024, oom_score_adj=adj)
