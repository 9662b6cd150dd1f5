"""recorder report --html: one self-contained page (nothing fetched, no scripts) with the stall
report and its plots, checked against the recording and rendered in headless Chromium."""

from __future__ import annotations

import html
import json
import re
import shutil
import sqlite3
import subprocess
import tempfile
from html.parser import HTMLParser
from pathlib import Path

import pytest
from conftest import q, run_recorder
from PIL import Image

from recorder.demo import write_scenario
from store.db import open_store
from store.report.build import explain, render_text
from store.report.html import BASE, STALL

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
# Attributes through which a page makes the browser fetch something.
FETCHING = {"src", "href", "xlink:href", "action", "formaction", "poster", "data", "srcset", "background",
            "manifest", "ping", "cite", "longdesc"}


class Refs(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.tags: list[str] = []
        self.refs: list[tuple[str, str, str]] = []

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        for k, v in attrs:
            if k in FETCHING and v is not None and not v.startswith("#"):
                self.refs.append((tag, k, v))
            if k == "style" and v and "url(" in v and "url(#" not in v:
                self.refs.append((tag, k, v))


def external_refs(page: str) -> list:
    p = Refs()
    p.feed(page)
    bad = list(p.refs)
    bad += [t for t in p.tags if t in {"script", "link", "iframe", "object", "embed", "img", "base"}]
    bad += re.findall(r"@import|url\((?!#)[^)]*\)", page)
    return bad


@pytest.fixture(scope="module")
def pages(tmp_path_factory) -> dict[str, tuple[Path, Path, dict]]:
    folder = tmp_path_factory.mktemp("html")
    out = {}
    for name in ("nvme-timeout-checkpoint", "healthy", "nccl-straggler"):
        db = folder / f"{name}.db"
        write_scenario(name, db)
        page = folder / f"{name}.html"
        r = run_recorder("report", "--db", str(db), "--html", str(page), "--json", check=True)
        out[name] = (db, page, json.loads(r.stdout))
    return out


def test_stalled_session_page(pages):
    db, page, info = pages["nvme-timeout-checkpoint"]
    text = page.read_text()
    assert external_refs(text) == []
    assert info["stall"] and info["plots"] == {"steps": True, "breakdown": True, "latency": True, "timeline": True}
    assert text.count("<svg") == 4
    with open_store(db, readonly=True) as store:
        report = explain(store)
    # the same report `recorder explain` prints, and its JSON
    assert html.escape(render_text(report)) in text
    assert html.escape(json.dumps(report, indent=1)) in text
    assert html.escape(report["symptom"]) in text
    # the step plot marks the stall with the chosen step labelled; the timeline is of that step
    (step, dur) = q(db, "SELECT step, dur FROM stall")[0]
    steps_svg = text.split("<svg")[1]
    assert STALL in steps_svg and f"step {step}: {round(dur / 1e6)} ms" in steps_svg
    assert f"Timeline of step {step} ({round(dur / 1e6)} ms)" in text
    assert f"--session 1 --step {step} --perfetto timeline.pftrace</code>" in text
    # percentiles per device and op, as block_latency gives them
    for device, op, n in q(db, "SELECT device, op, requests FROM block_latency"):
        assert f"<td>{device}</td><td>{op}</td><td>{n}</td>" in text
        assert f"{device} {op} ({n})" in text


def test_healthy_session_page(pages):
    _, page, info = pages["healthy"]
    text = page.read_text()
    assert external_refs(text) == []
    assert not info["stall"] and not info["plots"]["breakdown"] and info["plots"]["steps"]
    assert "no step stalled" in text and "class='symptom ok'" in text


def test_straggler_rank_is_on_the_timeline(pages):
    db, page, _ = pages["nccl-straggler"]
    text = page.read_text()
    timeline = text.split("<svg")[4]
    ((rank, pid),) = q(db, "SELECT DISTINCT straggler_rank, straggler_pid FROM step_nccl_wait s JOIN stall t"
                           " ON t.step_mark_id = s.step_mark_id WHERE straggler_rank != rank")
    # the waiting rank's layers and the late rank's, over the same time
    assert f"rank {rank} pid {pid}: off-CPU" in timeline and "pid 4100: NCCL calls" in timeline


def test_session_without_steps(pages, tmp_path):
    db = tmp_path / "nosteps.db"
    db.write_bytes(pages["healthy"][0].read_bytes())
    conn = sqlite3.connect(db)
    conn.execute("DELETE FROM step_mark")
    conn.commit()
    conn.close()
    page = tmp_path / "p.html"
    info = json.loads(run_recorder("report", "--db", str(db), "--html", str(page), "--json", check=True).stdout)
    assert info["plots"] == {"steps": False, "breakdown": False, "latency": True, "timeline": True}
    text = page.read_text()
    assert "No step markers or inferred steps" in text and "Timeline of the report&#x27;s window" in text
    (span,) = q(db, "SELECT stopped_ts - started_ts FROM session")[0]
    assert f"--window 0.000..{-(-span // 1_000_000) / 1e3:.3f} --perfetto" in text
    assert external_refs(text) == []


def test_page_checker_finds_references():
    # the check above is only worth something if it catches what would be fetched
    for bad in ('<script src="x.js"></script>', '<img src="http://h/x.png">', '<link rel=stylesheet href="s.css">',
                "<style>@import 'x.css';</style>", '<div style="background: url(http://h/x)">',
                '<svg><image xlink:href="http://h/x.png"/></svg>'):
        assert external_refs(bad), bad
    assert external_refs('<a href="#steps">x</a><svg><use xlink:href="#m1"/></svg>') == []


def test_bad_input(pages, tmp_path):
    db, _, _ = pages["healthy"]
    r = run_recorder("report", "--db", str(db), "--html", str(tmp_path / "no" / "r.html"))
    assert r.returncode == 2 and "does not exist" in r.stderr
    r = run_recorder("report", "--db", str(db), "--session", "7", "--html", str(tmp_path / "r.html"))
    assert r.returncode == 2 and "no session 7" in r.stderr and not (tmp_path / "r.html").exists()


@pytest.mark.skipif(CHROMIUM is None, reason="needs Chromium to render the page (apt-get install chromium)")
@pytest.mark.parametrize("name", ["nvme-timeout-checkpoint", "healthy"])
def test_renders_offline_in_chromium(pages, tmp_path, name):
    _, page, _ = pages[name]
    shot = tmp_path / "page.png"
    # the network is closed to the browser (no resolver, a dead proxy): the page must render alone
    cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
           "--disable-background-networking", "--disable-component-update", "--disable-sync",
           "--host-resolver-rules=MAP * ~NOTFOUND", "--proxy-server=127.0.0.1:9",
           f"--user-data-dir={tempfile.mkdtemp(dir=tmp_path)}", f"--screenshot={shot}", "--window-size=1400,3000",
           page.as_uri()]
    subprocess.run(cmd, capture_output=True, timeout=120, check=True)
    img = Image.open(shot).convert("RGB")
    assert img.size == (1400, 3000)
    colours = img.getcolors(maxcolors=1 << 20)
    assert len(colours) > 50, "the page rendered blank"
    # the plots were drawn: the step line's colour shows, and the stall marker's where there is one
    rgb = {c: tuple(int(c[i:i + 2], 16) for i in (1, 3, 5)) for c in (BASE, STALL)}
    count = {c: sum(n for n, px in colours if px == v) for c, v in rgb.items()}
    assert count[BASE] > 500
    if name != "healthy":
        assert count[STALL] > 500


def test_names_from_the_traced_machine_are_text_on_the_page(pages, tmp_path):
    """A process named 'p$^$' (mathtext to matplotlib) and a request op with markup in it: the page
    is written and shows both as text."""
    db = tmp_path / "names.db"
    db.write_bytes(pages["nvme-timeout-checkpoint"][0].read_bytes())
    conn = sqlite3.connect(db)
    conn.execute("UPDATE thread SET name = 'p$^$'")
    conn.execute("UPDATE block_request SET op = '<i>w</i>' WHERE op = 'write'")
    conn.commit()
    conn.close()
    page = tmp_path / "p.html"
    res = run_recorder("report", "--db", str(db), "--html", str(page), "--json")
    assert res.returncode == 0, res.stderr
    text = page.read_text()
    assert "p$^$" in text
    assert "<i>w</i>" not in text and "&lt;i&gt;w&lt;/i&gt;" in text
    assert external_refs(text) == []


def test_step_window_stall_table_and_gpu_lane(pages, tmp_path):
    """--step and --window pick what the page explains; every stall is in a table with its cause
    and line; a window's timeline starts at its first recorded event, not at the session start
    (a compile phase before it); GPU utilisation is a lane of the timeline."""
    src, _, info = pages["nvme-timeout-checkpoint"]
    db = tmp_path / "r.db"
    db.write_bytes(src.read_bytes())
    stalls = q(db, "SELECT step FROM stall ORDER BY excess_dur DESC")
    assert info["stalls"] == len(stalls) >= 1
    text = pages["nvme-timeout-checkpoint"][1].read_text()
    table = text.split("<table class=stalls>")[1].split("</table>")[0]
    with open_store(db, readonly=True) as store:
        worst = explain(store)
    assert table.count("<tr>") == len(stalls) + 1
    assert html.escape(worst["primary_cause"]["summary"]) in table
    assert html.escape(worst["primary_cause"]["python"]) in table
    # one step that is not a stall, by number
    (normal,) = q(db, "SELECT step FROM step WHERE step NOT IN (SELECT step FROM stall) ORDER BY step LIMIT 1")[0]
    page = tmp_path / "step.html"
    out = json.loads(run_recorder("report", "--db", str(db), "--html", str(page), "--step", str(normal), "--json",
                                  check=True).stdout)
    assert not out["stall"] and f"Timeline of step {normal} (" in page.read_text()
    assert "not a stall" in page.read_text()
    # GPU samples, and a session that started 60 s (an empty compile phase) before its first event
    (t0, first, end) = q(db, "SELECT started_ts, (SELECT min(ts) FROM offcpu_interval), stopped_ts FROM session")[0]
    conn = sqlite3.connect(db)
    conn.executemany("INSERT INTO gpu_sample (session_id, ts, gpu_index, util_gpu) VALUES (1, ?, 0, ?)",
                     [(ts, 90 - ts % 7) for ts in range(first, end, 100_000_000)])
    conn.execute("UPDATE session SET started_ts = started_ts - 60000000000")
    conn.execute("DELETE FROM step_mark")
    conn.commit()
    conn.close()
    from store.report.html import write_html

    page = tmp_path / "window.html"
    with open_store(db, readonly=True) as store:  # the CLI's --window, in this process (faster)
        write_html(store, page, window=f"{(first - t0) / 1e9 + 60 - 1:.3f}..{(end - t0) / 1e9 + 60:.3f}")
        write_html(store, tmp_path / "all.html")
    text = page.read_text()
    first_ts = q(db, "SELECT min(ts) FROM (SELECT min(ts) AS ts FROM offcpu_interval UNION ALL SELECT min(ts)"
                     " FROM gpu_sample UNION ALL SELECT min(ts) FROM cuda_call UNION ALL SELECT min(ts)"
                     " FROM block_request)")[0][0]
    assert f"from its first recorded event ({round((end - first_ts) / 1e6)} ms)" in text
    assert "GPU 0 utilisation" in text.split("Timeline of")[1]
    assert f"from its first recorded event ({round((end - first_ts) / 1e6)} ms)" in (tmp_path / "all.html").read_text()
