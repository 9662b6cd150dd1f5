"""The `schema://tables` resource: every table and view with its columns, generated from the store's SQL.

The documentation lives once, as ``-- `` comments in store/migrations/*.sql and store/views/*.sql
(``-- table: NAME`` / ``-- view: NAME`` headers, a description, one comment per column). Column lists
come from SQLite itself (the migrations and views applied to an in-memory database), so a column the
comments forget still appears; a view column without its own comment borrows the comment of the
column of that name in the table or view it selects from.
"""

from __future__ import annotations

import functools
import re
import sqlite3
from dataclasses import dataclass, field

from store.db import MIGRATIONS, _numbered, migrate

_HEADER = re.compile(r"^--\s*(table|view):\s*(\w+)\s*$")
_CREATE = re.compile(r"^CREATE\s+(?:TEMP\s+)?(TABLE|VIEW)\s+(\w+)", re.I)
# `name TYPE ... -- comment` in a table, `expr AS name, -- comment` or `alias.name, -- comment` in a view
_TABLE_COL = re.compile(r"^\s*(\w+)\s+\w+.*?--\s*(.+)$")
_VIEW_COL = re.compile(r"(?:\bAS\s+|\.|^\s*)(\w+)\s*,?\s*--\s*(.+)$", re.I)
# a later migration's `ALTER TABLE t ADD COLUMN name TYPE ...; -- comment`
_ADD_COL = re.compile(r"^ALTER\s+TABLE\s+(\w+)\s+ADD\s+COLUMN\s+(\w+)\b.*?--\s*(.+)$", re.I)


@dataclass
class DbObject:
    kind: str  # 'table' or 'view'
    name: str
    description: list[str] = field(default_factory=list)
    comments: dict[str, str] = field(default_factory=dict)
    sources: list[str] = field(default_factory=list)  # tables and views a view reads, in order
    columns: list[tuple[str, str]] = field(default_factory=list)  # (name, declared type)


def _parse(text: str, objects: dict[str, DbObject]) -> list[str]:
    """Objects documented in one SQL file; returns the file's leading comment lines."""
    preamble: list[str] = []
    current: DbObject | None = None
    in_body = False
    above: list[str] = []
    for line in text.splitlines():
        added = _ADD_COL.match(line)
        if added and added.group(1) in objects:
            objects[added.group(1)].comments.setdefault(added.group(2), added.group(3).strip())
            continue
        header = _HEADER.match(line)
        if header:
            current = DbObject(header.group(1), header.group(2))
            objects[current.name] = current
            in_body = False
            continue
        if current is None:
            if line.startswith("--"):
                preamble.append(line[2:].strip())
            continue
        if not in_body:
            if _CREATE.match(line):
                in_body = True
            elif line.startswith("--"):
                current.description.append(line[2:].strip())
            continue
        code = line.split("--", 1)[0]
        if current.kind == "view":
            current.sources += re.findall(r"\b(?:FROM|JOIN)\s+(\w+)", code)
        elif "--" not in line and "REFERENCES" in code:
            m = re.match(r"^\s*(\w+)\s.*REFERENCES\s+(\w+\(\w+\))", code)
            if m:
                current.comments.setdefault(m.group(1), f"references {m.group(2)}")
        if line.lstrip().startswith("--"):
            above.append(line.lstrip()[2:].strip())
            continue
        pattern = _TABLE_COL if current.kind == "table" else _VIEW_COL
        m = pattern.search(line)
        if m and m.group(1).upper() not in ("UNIQUE", "PRIMARY"):
            current.comments.setdefault(m.group(1), m.group(2).strip())
        elif above and current.kind == "view":  # a comment on the lines above `... AS name`
            names = re.findall(r"\bAS\s+(\w+)", code)
            if names:
                current.comments.setdefault(names[-1], " ".join(above))
        above = []  # only a comment directly above the line names its column
    return preamble


@functools.lru_cache(maxsize=1)
def objects() -> tuple[list[str], dict[str, DbObject]]:
    found: dict[str, DbObject] = {}
    conventions: list[str] = []
    for folder in ("migrations", "views"):
        for _, path in _numbered(folder):
            lines = _parse(path.read_text(), found)
            if not conventions:
                conventions = lines
    conn = sqlite3.connect(":memory:")
    migrate(conn, 0)
    real = conn.execute("SELECT type, name FROM sqlite_master WHERE type IN ('table', 'view')"
                        " AND name NOT LIKE 'sqlite_%' ORDER BY rowid").fetchall()
    ordered: dict[str, DbObject] = {}
    for kind, name in real:
        obj = found.get(name) or DbObject(kind, name, ["(no description in the SQL files)"])
        obj.columns = [(r[1], r[2] or "") for r in conn.execute(f'PRAGMA table_info("{name}")')]
        ordered[name] = obj
    conn.close()
    return conventions, ordered


def column_comment(obj: DbObject, column: str, known: dict[str, DbObject]) -> str:
    if column in obj.comments:
        return obj.comments[column]
    if obj.kind == "table":  # tables document their own columns; no guessing from other tables
        return "row id" if column == "id" else ""
    for name in obj.sources:
        source = known.get(name)
        if source is not None and source is not obj and any(c == column for c, _ in source.columns):
            borrowed = column_comment(source, column, known)
            if borrowed:
                return borrowed
    for other in known.values():  # e.g. tid, pid, thread_name passed through from thread_info
        if other is not obj and other.kind == "view" and column in other.comments:
            return other.comments[column]
    return ""


def schema_text() -> str:
    """The resource body: conventions, then each table and view with one line per column."""
    conventions, known = objects()
    out = ["# stall-recorder database schema", f"schema version {MIGRATIONS[-1][0] if MIGRATIONS else 0}", ""]
    out += [c for c in conventions if c] + [""]
    for obj in known.values():
        out.append(f"## {obj.kind} {obj.name}")
        out += [d for d in obj.description if d]
        for name, kind in obj.columns:
            comment = column_comment(obj, name, known)
            out.append(f"- {name}{' ' + kind if kind else ''}{': ' + comment if comment else ''}")
        out.append("")
    return "\n".join(out)
