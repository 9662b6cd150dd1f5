"""Hangs read from imported NCCL Flight Recorder dumps (collective_record, one dump per rank, imported
together into one database): per process group, the collective some ranks wait in (state 'started':
launched and waiting for their peers) and the ranks that never entered it (their last record is an
earlier one), never started it (only 'scheduled') or never finished an earlier one the others did.

The n-th collective of a group (collective_seq_id) is the same operation on every rank, which is how
the ranks' dumps line up; point-to-point operations (send/recv, numbered apart) are left out.
"""

from __future__ import annotations

import json
import zlib

from store.db import Store
from store.units import utc

P2P = ("send", "recv")


def _group_ranks(store: Store) -> dict[str, list[int]]:
    """Each process group's ranks, from the dumps' pg_config."""
    out: dict[str, list[int]] = {}
    for r in store.query("SELECT distributed FROM trace_import WHERE format = 'flight_recorder'"
                         " AND distributed IS NOT NULL"):
        try:
            config = json.loads(r["distributed"])
        except ValueError:
            continue
        for name, cfg in config.items():
            if isinstance(cfg, dict):
                try:
                    ranks = json.loads(str(cfg.get("ranks")))
                except ValueError:
                    continue
                if isinstance(ranks, list) and all(isinstance(x, int) for x in ranks):
                    out.setdefault(str(cfg.get("name", name)), sorted(ranks))
    return out


def _label(rec: dict) -> str:
    return f"{rec['profiling_name']} #{rec['collective_seq_id']}"


def flight_hang(store: Store, session: dict) -> dict | None:
    """The hang part of a report (store/models.py Hang) from the Flight Recorder dumps in the
    database, when `session` is one of them and some collective did not complete; else None."""
    if store.one("SELECT 1 AS x FROM trace_import WHERE session_id = ? AND format = 'flight_recorder'",
                 (session["id"],)) is None:
        return None
    rows = [r for r in store.query(
        "SELECT rank, pg_name, pg_desc, collective_seq_id, profiling_name, state, ts, started_ts, completed_ts"
        " FROM collective_record WHERE collective_seq_id IS NOT NULL AND collective_seq_id > 0"
        " ORDER BY pg_name, rank, collective_seq_id")
        if not r["profiling_name"].split(":")[-1].lower().startswith(P2P)]
    dumped = {r["rank"] for r in store.query("SELECT DISTINCT rank FROM trace_import WHERE format = 'flight_recorder'")}
    members = _group_ranks(store)
    collectives = []
    blamed: dict[int, str] = {}
    for pg in sorted({r["pg_name"] for r in rows}):
        recs = [r for r in rows if r["pg_name"] == pg]
        by_rank: dict[int, dict[int, dict]] = {}
        for r in recs:
            by_rank.setdefault(r["rank"], {})[r["collective_seq_id"]] = r
        waiting = [r for r in recs if r["state"] == "started"]
        if not waiting:
            pending = [r for r in recs if r["state"] == "scheduled"]
            if not pending:
                continue  # every collective of the group completed on every dumped rank
            waiting = pending
        seq = max(r["collective_seq_id"] for r in waiting)
        stuck = next(r for r in waiting if r["collective_seq_id"] == seq)
        ranks = members.get(pg) or sorted(by_rank)
        inside = sorted(x for x in ranks if by_rank.get(x, {}).get(seq, {}).get("state") == "started")
        missing = []
        for rank in ranks:
            if rank in inside:
                continue
            mine = by_rank.get(rank, {})
            unfinished = [r for s, r in sorted(mine.items()) if s < seq and r["state"] != "completed"]
            where = f"process group {pg}"
            if seq in mine and mine[seq]["state"] == "completed":
                continue  # it finished the collective: not what the others wait for
            if rank not in dumped:
                doing, short = "no dump from this rank was imported: import its file too", f"has no dump ({where})"
            elif unfinished:
                doing = f"never finished {_label(unfinished[0])} ({unfinished[0]['state']})"
                short = f"never finished {_label(unfinished[0])} ({where})"
            elif seq in mine:
                doing = f"enqueued it but never started it (state {mine[seq]['state']})"
                short = f"never started {_label(stuck)} ({where})"
            else:
                last = mine[max(mine)] if mine else None
                doing = (f"never entered it: its last is {_label(last)}, {last['state']}"
                         + (f" at {utc(last['completed_ts'])}" if last["completed_ts"] else "")) if last \
                    else "never entered it: no collective of this group in its dump"
                short = f"never entered {_label(stuck)} ({where})"
            missing.append({"rank": rank, "recorded": rank in dumped, "doing": doing})
            blamed.setdefault(rank, f"{short}, which rank{'s' if len(inside) != 1 else ''} "
                                    f"{', '.join(map(str, inside)) or 'none'} wait{'' if len(inside) != 1 else 's'} in")
        since = min((r["started_ts"] or r["ts"] or 0) for r in waiting if r["collective_seq_id"] == seq)
        desc = f" ({stuck['pg_desc']})" if stuck["pg_desc"] else ""
        collectives.append({
            "api": stuck["profiling_name"], "comm_hash": zlib.crc32(pg.encode()), "nranks": len(ranks),
            "inside_ranks": inside, "missing_ranks": [m["rank"] for m in missing], "missing": missing,
            "since_utc": utc(since) if since else "?",
            "text": (f"{_label(stuck)} of process group {pg}{desc}, {len(ranks)} ranks: waiting in it: "
                     f"{', '.join(map(str, inside)) or 'none'}; not in it: "
                     + ("; ".join(f"rank {m['rank']} {m['doing']}" for m in missing) if missing else "none")),
        })
    if not collectives:
        return None
    names = "; ".join(f"rank {rank} {why}" for rank, why in sorted(blamed.items()))
    summary = (f"Flight Recorder dumps of {len(dumped)} rank{'s' if len(dumped) != 1 else ''}: "
               + (names if names else "collectives in flight, every rank inside them (none is missing)"))
    return {"summary": summary, "open_calls": [], "collectives": collectives}
