"""The `recorder` command line: a thin layer over recorder.* and store.* functions."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sqlite3
import sys
from pathlib import Path

from recorder.core.settings import DEFAULT_PROFILE_HZ, MAX_PROFILE_HZ, Settings
from recorder.flight import TRIGGERS
from store.errors import UserError

EXAMPLES = {
    "doctor": "recorder doctor\n  recorder doctor --json",
    "start": ("recorder start -p 4242                 # one process and its children\n"
              "  recorder start -p 4242 -p 4243 --db /var/tmp/incident.db\n"
              "  recorder start -p $(pgrep -f train.py)   # several: -p 1 2, -p 1,2 or -p 1 -p 2\n"
              "  recorder start --tree $(pgrep -o torchrun)   # a launcher, its ranks and their workers\n"
              "  recorder start -c /sys/fs/cgroup/unified/job42   # a cgroup v2 subtree\n"
              "  recorder start --all --cuda-lib "
              "/opt/venv/lib/python3.11/site-packages/nvidia/cuda_runtime/lib/libcudart.so.12\n"
              "  recorder start --all --keep 10m --max-size 2GB --db /var/lib/stall/flight.db   # always on\n"
              "  recorder start --all --keep 10m --foreground --metrics-file "
              "/var/lib/node_exporter/textfile_collector/stall_recorder.prom   # under systemd\n"
              "  recorder start --all --keep 10m --on-incident '/usr/local/bin/page-oncall --team ml'\n"
              "  recorder start --all --keep 10m --ship s3://stall-recordings/run42   # incidents to the shared store"),
    "stop": "recorder stop\n  recorder stop --db /var/tmp/incident.db",
    "status": "recorder status\n  recorder status --json",
    "dump": ("recorder dump                          # the kept window of a flight recording, now\n"
             "  recorder dump --db /var/lib/stall/flight.db --last 60s -o /tmp/what-i-saw.db\n"
             "  kill -USR1 $(cat /var/lib/stall/flight.db.lock)   # the same, into flight.db.incidents/"),
    "record": ("recorder record -- python train.py --epochs 1\n"
               "  recorder record --db run.db -- torchrun --nproc-per-node 2 train.py"),
    "explain": ("recorder explain                       # the latest session, whole\n"
                "  recorder explain --worst               # only the worst stall\n"
                "  recorder explain --since 5m --json\n"
                "  recorder explain --window 12..20       # seconds after the session start\n"
                "  recorder explain --window 2026-04-28T22:14:40Z..2026-04-28T22:15:10Z\n"
                "  recorder explain --step 80042 --stack  # one step, with the Python stack"),
    "import": ("recorder import rank0.pt.trace.json.gz --db job.db     # a torch.profiler trace: one session\n"
               "  recorder explain --db job.db --step 551                   # device busy share, top kernels, host\n"
               "  recorder import trace/*.pt.trace.json.gz --db job.db     # one session per rank\n"
               "  recorder cluster explain job.db --step 551               # the rank whose collectives started last\n"
               "  recorder import nccl_trace_rank_* --db hang.db && recorder explain --db hang.db   # Flight Recorder\n"
               "  recorder import rank0.pt.trace.json.gz --db run.db --join   # into the latest recorded session"),
    "steps": ("recorder steps                         # every step with its baseline\n"
              "  recorder steps --slow --json           # only the stalls"),
    "top": "recorder top\n  recorder top --limit 10 --json",
    "verify-checkpoints": ("recorder verify-checkpoints                 # the latest session\n"
                           "  recorder verify-checkpoints --db run.db --session 3 --json"),
    "upgrade": ("recorder upgrade --db run.db           # migrate an earlier version's recording in place\n"
                "  recorder upgrade --db /archive/h200.db --json\n"
                "read commands need no upgrade: they read an earlier version's recording through a migrated\n"
                "copy in ~/.cache/stall-recorder (or $STALL_RECORDER_CACHE_DIR) and leave the file as it is"),
    "export": ("recorder export --perfetto trace.pftrace          # the latest session, whole\n"
               "  recorder export --db run.db --step 412 --perfetto step412.pftrace\n"
               "  recorder export --window 12..20 --perfetto stall.pftrace   # seconds after the start\n"
               "  recorder export --db run.db --datasette-metadata metadata.json; datasette run.db -m metadata.json\n"
               "  recorder export --parquet /shared/run42/parquet --db node-03.db   # every session, by node\n"
               "  recorder export --parquet s3://stall-recordings/run42 --db node-03.db   # to the shared store\n"
               "open a trace in ui.perfetto.dev (it is loaded in the browser, not uploaded)"),
    "report": ("recorder report --html stall.html             # the latest session\n"
               "  recorder report --db run.db --session 3 --html session3.html\n"
               "  recorder report --step 412 --html step412.html\n"
               "  recorder report --window 12..20 --html stall.html   # seconds after the start"),
    "demo": ("recorder demo --no-gpu --list\n"
             "  recorder demo --no-gpu nvme-timeout-checkpoint\n"
             "  recorder demo --no-gpu nccl-straggler --db /tmp/straggler.db --json"),
}


def _db_arg(p: argparse.ArgumentParser, default: Path) -> None:
    p.add_argument("--db", default=default, type=Path,
                   help=f"recording database (default {default}, or ${Settings.variable('db')})")


def pid_list(text: str) -> list[int]:
    """'4242' or '4242,4243' (argparse's type of -p and --tree)."""
    try:
        pids = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        pids = []
    if not pids or any(pid <= 0 for pid in pids):
        raise argparse.ArgumentTypeError(f"{text!r} is not a process id: give numbers, as -p 1 2, -p 1,2 or -p 1 -p 2")
    return pids


def _sub(subs, name: str, help_text: str) -> argparse.ArgumentParser:
    return subs.add_parser(name, help=help_text, description=help_text,
                           epilog="examples:\n  " + EXAMPLES[name],
                           formatter_class=argparse.RawDescriptionHelpFormatter)


def build_parser(settings: Settings | None = None) -> argparse.ArgumentParser:
    """The command line; its defaults come from `settings` (the environment's by default)."""
    db = (settings or Settings.from_environment(only=("db",))).db
    ap = argparse.ArgumentParser(
        prog="recorder",
        description="Record the scheduler, CUDA and kernel layers around a training job into "
                    "SQLite, and explain why a step stalled.",
        epilog="examples:\n  recorder doctor\n  recorder record -- python train.py\n"
               "  recorder start --tree $(pgrep -o -f train.py); sleep 60; recorder stop\n"
               "  recorder explain --worst",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    subs = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = _sub(subs, "doctor", "check that this machine can record, one line per requirement")
    p.add_argument("-p", "--pid", type=int, action="append", default=[],
                   help="also look for CUDA/NCCL libraries mapped by this process")
    p.add_argument("-j", "--json", action="store_true", help="machine-readable output")

    for name, text in (("start", "start recording in the background; returns once probes are attached"),
                       ("record", "run a command under recording (children included) until it exits")):
        p = _sub(subs, name, text)
        _db_arg(p, db)
        p.add_argument("--cuda-lib", action="append", default=[], metavar="PATH",
                       help="attach to this CUDA or NCCL library now (for processes that load it later)")
        p.add_argument("--profile-hz", type=int, metavar="N",
                       help="sample where the traced threads' CPU time goes N times a second on each CPU "
                            f"(the on-CPU profile; default {DEFAULT_PROFILE_HZ}, or STALL_RECORDER_PROFILE_HZ; "
                            f"1-{MAX_PROFILE_HZ}, 0: off; attached seconds after the recording began)")
        p.add_argument("--launch-rows", action="store_true",
                       help="one cuda_call row per kernel launch, with its duration (a return probe on every "
                            "launch: ~2x its cost; or STALL_RECORDER_LAUNCH_ROWS=1); by default launches are "
                            "counted per thread between its blocking calls, one in 64 kept as a sample with its stacks")
        if name == "start":
            p.add_argument("-p", "--pid", type=pid_list, nargs="+", action="extend", default=[],
                           help="process to record, with its threads and the children it forks from now on "
                                "(several: -p 1 2, -p 1,2 or -p 1 -p 2)")
            p.add_argument("--tree", type=pid_list, nargs="+", action="extend", default=[], metavar="PID",
                           help="a process and every descendant: those running now and those forked later")
            p.add_argument("-c", "--cgroup", metavar="CGROUP_PATH",
                           help="record every task in this cgroup v2 folder and below")
            p.add_argument("--all", action="store_true", help="record every process on the host")
            p.add_argument("--foreground", action="store_true",
                           help="record in this process until SIGTERM or Ctrl-C (for systemd or a container) "
                                "instead of forking a background recorder")
            p.add_argument("-j", "--json", action="store_true", help="machine-readable output")
        else:
            p.add_argument("cmd", nargs=argparse.REMAINDER, help="-- COMMAND [ARGS...]")
        f = p.add_argument_group("flight recorder (docs/flight-recorder.md)")
        f.add_argument("--keep", metavar="DURATION",
                       help="record continuously but keep only the last DURATION (10m, 1h); incidents are "
                            "saved by themselves into DB.incidents/")
        f.add_argument("--max-size", metavar="SIZE", help="with --keep: at most SIZE on disk, the database and "
                                                          "its log (500MB, 2GB); the window kept shrinks to fit")
        f.add_argument("--before", metavar="DURATION", default="60s",
                       help="an incident recording starts this long before its trigger (default 60s)")
        f.add_argument("--after", metavar="DURATION", default="30s",
                       help="and ends this long after it (default 30s)")
        f.add_argument("--hang", metavar="DURATION", default="30s",
                       help="a CUDA/NCCL call in flight this long is a hang (default 30s)")
        f.add_argument("--cooldown", metavar="DURATION", default="5m",
                       help="a trigger saves at most one incident per DURATION (default 5m; and 12 an hour in all)")
        f.add_argument("--triggers", metavar="LIST", default=",".join(TRIGGERS),
                       help=f"the triggers that save an incident (default {','.join(TRIGGERS)}; '' for none)")
        f.add_argument("--on-incident", metavar="CMD",
                       help="with --keep: run CMD for every incident saved, with the incident's path and a one-line "
                            "summary as its last two arguments (and in $STALL_RECORDER_INCIDENT, "
                            "$STALL_RECORDER_INCIDENT_SUMMARY); split like a shell line, run without a shell")
        f.add_argument("--ship", metavar="URL",
                       help="with --keep: upload every incident saved to the object store s3://BUCKET/PREFIX: the "
                            "recording to URL/incidents/HOST/NAME.db, its Parquet export (stalls, causes, reports) "
                            "to URL/incidents/HOST/NAME/; AWS_* variables (AWS_ENDPOINT_URL for a non-AWS store); "
                            "kept in DB.spool/ while the store is down")
        f.add_argument("--on-incident-shell", action="store_true",
                       help="run --on-incident through /bin/sh -c (the path is $1, the summary $2)")
        f.add_argument("--on-incident-timeout", metavar="DURATION", default="60s",
                       help="kill an --on-incident command still running after DURATION (default 60s)")
        f.add_argument("--on-incident-env", metavar="NAME", action="append", default=[],
                       help="pass the recorder's variable NAME (or NAME=VALUE) to --on-incident; repeat for "
                            "more. Otherwise it gets only PATH, LANG and the STALL_RECORDER_INCIDENT* variables")
        p.add_argument("--metrics-file", type=Path, metavar="PATH",
                       help="rewrite PATH every 5 s with Prometheus metrics (node_exporter textfile format): "
                            "events, drops, CPU, database size, incidents, and each rank's step times, "
                            "collective waits and lost time by cause kind (docs/flight-recorder.md)")
        p.add_argument("--metrics-listen", metavar="HOST:PORT",
                       help="serve the same metrics at http://HOST:PORT/metrics for Prometheus (bound to HOST "
                            "only); an address that is not loopback needs --metrics-token-file and "
                            "--metrics-certfile/--metrics-keyfile (HTTPS with a bearer token, as recorder mcp --http)")
        p.add_argument("--metrics-token-file", type=Path, metavar="FILE",
                       help="with --metrics-listen: every scrape must send 'Authorization: Bearer TOKEN' with "
                            "the token in FILE (mode 600, at least 16 characters)")
        p.add_argument("--metrics-certfile", type=Path, metavar="FILE",
                       help="with --metrics-listen: serve HTTPS with this PEM certificate ...")
        p.add_argument("--metrics-keyfile", type=Path, metavar="FILE", help="... and this PEM private key")

    p = _sub(subs, "stop", "stop the background recorder: flush, build indexes, mark complete")
    _db_arg(p, db)
    p.add_argument("-j", "--json", action="store_true", help="machine-readable output")

    p = _sub(subs, "status", "live counters of the background recorder")
    _db_arg(p, db)
    p.add_argument("-j", "--json", action="store_true", help="machine-readable output")

    p = _sub(subs, "dump", "save the kept window of a recording (a flight recording while it records) as a "
                           "recording of its own")
    _db_arg(p, db)
    p.add_argument("-o", "--output", type=Path, metavar="FILE",
                   help="the recording to write (default DB.incidents/<UTC time>-dump.db)")
    p.add_argument("--last", metavar="DURATION", help="only the last DURATION (default: all that is kept)")
    p.add_argument("--session", type=int, help="session id (default: the latest)")
    p.add_argument("-j", "--json", action="store_true", help="say what was written as JSON")

    p = _sub(subs, "explain", "explain a stall: the slowest step (or slow CUDA calls) and what caused it")
    _db_arg(p, db)
    p.add_argument("--session", type=int, help="session id (default: the latest)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--window", metavar="A..B",
                   help="seconds after the session start (5..12.5) or UTC times A..B")
    g.add_argument("--since", metavar="DURATION", help="the last DURATION of the session (30s, 5m)")
    g.add_argument("--worst", action="store_true", help="only the worst stall")
    g.add_argument("--step", type=int, metavar="N", help="explain step N (stalled or not)")
    p.add_argument("-j", "--json", action="store_true", help="the report as JSON (same content)")
    p.add_argument("--stack", action="store_true", help="print the whole Python stack under each Python line")

    p = _sub(subs, "import", "read PyTorch profiler traces and NCCL Flight Recorder dumps into a recording "
                             "(a session per file), to explain, list, export and serve like a recorded one")
    _db_arg(p, db)
    p.add_argument("files", nargs="+", type=Path, metavar="FILE",
                   help="Chrome trace JSON (.json, .json.gz) from torch.profiler, or a Flight Recorder dump (pickle "
                        "or JSON); all are imported or none")
    p.add_argument("--join", nargs="?", type=int, const=-1, metavar="SESSION",
                   help="line each trace up with recorded session SESSION of --db (default: the latest) by their "
                        "runtime calls, and import it into that session on its clock; said when it does not line up")
    p.add_argument("-j", "--json", action="store_true", help="say what was imported as JSON")

    p = _sub(subs, "steps", "list the steps of a session with their rolling baseline; --slow for the stalls")
    _db_arg(p, db)
    p.add_argument("--session", type=int, help="session id (default: the latest)")
    p.add_argument("--slow", action="store_true", help="only the stalled steps")
    p.add_argument("--limit", type=int, default=0, metavar="N", help="at most N steps (default: all)")
    p.add_argument("-j", "--json", action="store_true", help="machine-readable output")

    p = _sub(subs, "top", "the worst stalls, the Python lines and the devices that cost the most")
    _db_arg(p, db)
    p.add_argument("--session", type=int, help="session id (default: the latest)")
    p.add_argument("--limit", type=int, default=5, metavar="N", help="rows per table (default 5)")
    p.add_argument("-j", "--json", action="store_true", help="machine-readable output")

    p = _sub(subs, "verify-checkpoints", "hash a recording's checkpoint files again and say which changed "
                                         "(stored as 'recheck' rows where this user can write the recording)")
    _db_arg(p, db)
    p.add_argument("--session", type=int, help="session id (default: the latest)")
    p.add_argument("-j", "--json", action="store_true", help="machine-readable output")

    p = _sub(subs, "upgrade", "migrate a recording made by an earlier version to this version's schema, in place")
    _db_arg(p, db)
    p.add_argument("-j", "--json", action="store_true", help="say what was done as JSON")

    p = _sub(subs, "export", "write a recording in another format: a Perfetto timeline (--perfetto), "
                             "Datasette metadata (--datasette-metadata), Parquet for DuckDB, Spark, Trino (--parquet)")
    _db_arg(p, db)
    p.add_argument("--session", type=int,
                   help="session id (default: the latest; for --parquet, every session)")
    p.add_argument("--perfetto", type=Path, metavar="FILE",
                   help="a Perfetto trace: tracks per thread and disk, counters, flows for the causal links")
    p.add_argument("--datasette-metadata", type=Path, metavar="FILE",
                   help="metadata.json for 'datasette DB -m FILE': descriptions, units, canned queries")
    p.add_argument("--parquet", metavar="DIR",
                   help="write each table, the key views and the causal model's answers (stalls, causes, reports, "
                        "hangs) as Parquet under DIR/TABLE/node=HOST/session=ID/; DIR may be s3://BUCKET/PREFIX "
                        "(AWS_* variables; AWS_ENDPOINT_URL for a non-AWS store), spooled in DB.spool/ while the "
                        "store is down")
    p.add_argument("--reports", type=int, default=16, metavar="N",
                   help="with --parquet: the full report of the N worst stalled steps of each session "
                        "(default 16; every stall gets its cause, up to 256 a session)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--window", metavar="A..B",
                   help="only A..B: seconds after the session start (5..12.5) or UTC times")
    g.add_argument("--step", type=int, metavar="N", help="only step N (on every thread that marks it)")
    p.add_argument("-j", "--json", action="store_true", help="say what was written as JSON")

    p = _sub(subs, "report", "write the stall report as one self-contained HTML page with plots (--html)")
    _db_arg(p, db)
    p.add_argument("--session", type=int, help="session id (default: the latest)")
    p.add_argument("--html", type=Path, metavar="FILE", required=True,
                   help="the page to write: no scripts, nothing fetched; opens offline")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--window", metavar="A..B",
                   help="the worst stall in A..B (seconds after the session start, 5..12.5, or UTC times)")
    g.add_argument("--step", type=int, metavar="N", help="step N (stalled or not)")
    p.add_argument("-j", "--json", action="store_true", help="say what was written as JSON")

    p = _sub(subs, "demo", "write a synthetic recording of a known stall (no root, no BPF, no GPU) and explain it")
    p.add_argument("--no-gpu", action="store_true", help="synthetic scenarios (the only kind there is)")
    p.add_argument("--list", action="store_true", help="name the scenarios")
    p.add_argument("scenario", nargs="?", help="scenario name (see --list)")
    p.add_argument("--db", type=Path, help="database to write (default demo-SCENARIO.db; a new session is added)")
    p.add_argument("-j", "--json", action="store_true", help="print the report as JSON")

    from recorder.cluster_cli import add_parser as add_cluster_parser

    add_cluster_parser(subs)

    mcp_help = "serve a recording to MCP clients (Claude Code, Cursor): stdio, or HTTPS with --http"
    p = subs.add_parser("mcp", help=mcp_help, description=mcp_help,
                        formatter_class=argparse.RawDescriptionHelpFormatter, epilog=(
                            "examples:\n  recorder mcp --db run.db                # stdio, started by the client\n"
                            "  claude mcp add stall-recorder -- /abs/.venv/bin/recorder mcp --db /abs/run.db\n"
                            "  recorder mcp --db run.db --http 127.0.0.1:8765 --certfile cert.pem "
                            "--keyfile key.pem --token-file token\n"
                            "the token is read from --token-file (chmod 600) or $STALL_RECORDER_MCP_TOKEN, "
                            "never from the command line"))
    _db_arg(p, db)
    p.add_argument("--http", metavar="HOST:PORT", help="serve HTTPS (streamable HTTP at /mcp) instead of stdio")
    p.add_argument("--certfile", type=Path, help="TLS certificate (PEM) for --http")
    p.add_argument("--keyfile", type=Path, help="TLS private key (PEM) for --http")
    p.add_argument("--token-file", type=Path, help="file holding the bearer token clients must send (--http)")
    p.add_argument("--allow-host", action="append", default=[], metavar="NAME",
                   help="another Host name clients use to reach --http (repeatable)")
    return ap


def _print_summary(summary: dict) -> None:
    rows = summary["rows"]
    print(f"session {summary['session_id']} {summary['status']}: {summary['duration_s']:.1f} s, "
          f"{rows['cuda_call']} CUDA calls"
          + (f" and {rows['kernel_launches_counted']:,} kernel launches counted" if rows.get("kernel_launches_counted")
             else "")
          + f", {rows['offcpu_interval']} off-CPU intervals, "
          f"{rows['thread']} threads, {summary['dropped']} events dropped; "
          f"{summary['db']} ({summary['db_bytes'] / 1e6:.1f} MB)")
    if summary.get("stop_reason"):
        print(f"  recording stopped early: {summary['stop_reason']}")


def cmd_doctor(args) -> int:
    from recorder import doctor

    checks = doctor.run_checks(tuple(args.pid))
    if args.json:
        print(json.dumps(doctor.as_json(checks), indent=1))
    else:
        print(doctor.render(checks))
    return 0 if doctor.can_record(checks) else 1


def _flight_options(args):
    """--keep and its companions as FlightOptions, or None without --keep."""
    from recorder.flight import FlightOptions, parse_size
    from recorder.incident_hook import HookOptions
    from store.db.session import parse_duration

    if not args.keep:
        if args.max_size:
            raise UserError("--max-size bounds a flight recording: add --keep DURATION (e.g. --keep 10m)")
        if args.on_incident or args.on_incident_env:
            raise UserError("--on-incident runs for the incidents of a flight recording: add --keep DURATION "
                            "(e.g. --keep 10m)")
        if args.ship:
            raise UserError("--ship uploads the incidents of a flight recording: add --keep DURATION "
                            "(e.g. --keep 10m)")
        return None
    hook = None
    if args.on_incident_env and args.on_incident is None:
        raise UserError("--on-incident-env passes variables to the --on-incident command: add --on-incident CMD")
    if args.on_incident is not None:
        hook = HookOptions(args.on_incident, shell=args.on_incident_shell,
                           timeout_s=parse_duration(args.on_incident_timeout) / 1e9, env=tuple(args.on_incident_env))
    options = FlightOptions(
        keep_ns=parse_duration(args.keep), max_bytes=parse_size(args.max_size) if args.max_size else None,
        before_ns=parse_duration(args.before), after_ns=parse_duration(args.after),
        hang_ns=parse_duration(args.hang), cooldown_ns=parse_duration(args.cooldown),
        triggers=frozenset(t.strip() for t in args.triggers.split(",") if t.strip()), hook=hook, ship=args.ship)
    options.check()
    if args.ship:  # a spool someone else made or can write is refused now, not at the first incident
        from store import objectstore

        objectstore.check_spool(objectstore.spool_folder(args.db))
    return options


def _profile_hz(args) -> None:
    """--profile-hz: checked, then handed to the session (and a background recorder) through its
    setting's variable."""
    if args.profile_hz is None:
        return
    if not 0 <= args.profile_hz <= MAX_PROFILE_HZ:
        raise UserError(f"--profile-hz {args.profile_hz}: give samples a second from 1 to {MAX_PROFILE_HZ}, "
                        "or 0 for no on-CPU profile")
    os.environ[Settings.variable("profile_hz")] = str(args.profile_hz)


def _launch_rows(args) -> None:
    """--launch-rows: handed to the session (and a background recorder) through its setting's variable."""
    if args.launch_rows:
        os.environ[Settings.variable("launch_rows")] = "1"


def _metrics_file(args) -> Path | None:
    from recorder.metrics import check_metrics_path

    if args.metrics_file is None:
        return None
    path = args.metrics_file.resolve()
    check_metrics_path(path)
    return path


def _metrics_listen(args):
    """--metrics-listen and its token and TLS files, checked now (one line, before anything starts)."""
    from recorder.metrics_http import ListenOptions

    if args.metrics_listen is None:
        if args.metrics_token_file or args.metrics_certfile or args.metrics_keyfile:
            raise UserError("--metrics-token-file, --metrics-certfile and --metrics-keyfile go with "
                            "--metrics-listen HOST:PORT")
        return None
    options = ListenOptions(args.metrics_listen, *(f.resolve() if f else None for f in (
        args.metrics_token_file, args.metrics_certfile, args.metrics_keyfile)))
    options.check()
    return options


def cmd_start(args) -> int:
    from recorder.core.loader import TargetSpec, cgroup_identity, check_privileges
    from recorder.core.processes import check_target_pid
    from recorder.daemon import start_background

    chosen = sum(bool(x) for x in (args.pid or args.tree, args.cgroup, args.all))
    if chosen != 1:
        raise UserError("say what to record: -p PID... and/or --tree PID..., -c CGROUP_PATH or --all")
    flight = _flight_options(args)
    metrics = _metrics_file(args)
    listen = _metrics_listen(args)
    _profile_hz(args)
    _launch_rows(args)
    check_privileges()
    # each word of -p/--tree is a list (-p 1,2 3: [[1, 2], [3]]); a PID given twice counts once
    pids = tuple(dict.fromkeys(pid for word in args.pid for pid in word))
    trees = tuple(dict.fromkeys(pid for word in args.tree for pid in word))
    for pid in (*pids, *trees):
        check_target_pid(pid)
    if args.cgroup:
        cgroup_identity(args.cgroup)  # refused here, in one line, rather than by the recorder it forks
    target = TargetSpec(pids=pids, cgroup=args.cgroup, everything=args.all, trees=trees)
    if args.foreground:
        from recorder.daemon import run_foreground

        summary = run_foreground(args.db.resolve(), target, tuple(args.cuda_lib), shlex.join(sys.argv), flight,
                                 metrics, listen, on_started=lambda reply: _print_started(args, reply, flight))
        if args.json:
            print(json.dumps(summary, indent=1))
        else:
            _print_summary(summary)
        return 0
    reply = start_background(args.db.resolve(), target, tuple(args.cuda_lib), shlex.join(sys.argv), flight,
                             metrics, listen)
    _print_started(args, reply, flight)
    return 0


def _print_started(args, reply: dict, flight) -> None:
    if args.json:
        print(json.dumps(reply, indent=1), flush=True)
        return
    print(f"recording session {reply['session_id']} into {reply['db']} (recorder pid "
          f"{reply['recorder_pid']}, target {reply['target']})")
    layers: dict[str, int] = {}
    for name in reply["attached"]:
        layer = name.split(":", 1)[0]
        layers[layer] = layers.get(layer, 0) + 1
    print(f"attached {len(reply['attached'])} probes: "
          + ", ".join(f"{layer} {n}" for layer, n in sorted(layers.items()))
          + " (all listed in the capability table)")
    for lib in reply["libraries"]:
        print(f"  library {lib}")
    for miss in reply["not_attached"]:
        print(f"  not attached: {miss}")
    if not reply["libraries"]:
        print("recorder: warning: no CUDA library is mapped by the target yet; its calls are traced once it "
              "loads one (dlopen is watched), or pass --cuda-lib PATH", file=sys.stderr)
    if flight:
        print(f"flight recorder: keeping the last {args.keep}"
              + (f", at most {args.max_size}" if args.max_size else "")
              + f"; incidents ({args.before} before to {args.after} after a trigger) go into "
              f"{reply['db']}.incidents/" + (f" and to {args.ship}" if args.ship else "")
              + f"; recorder dump --db {reply['db']} saves the window now")
    if reply.get("metrics_url"):
        print(f"metrics: {reply['metrics_url']} (Prometheus; rules and a dashboard in packaging/)")
    print(f"stop with: recorder stop --db {reply['db']}", flush=True)


def cmd_record(args) -> int:
    from recorder.core.loader import check_privileges
    from recorder.daemon import record_command

    argv = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not argv:
        raise UserError("nothing to run: recorder record [--db PATH] -- COMMAND [ARGS...]")
    flight = _flight_options(args)
    metrics = _metrics_file(args)
    listen = _metrics_listen(args)
    _profile_hz(args)
    _launch_rows(args)
    check_privileges()
    code, summary = record_command(args.db.resolve(), argv, tuple(args.cuda_lib), shlex.join(sys.argv),
                                   flight=flight, metrics_file=metrics, metrics_listen=listen)
    _print_summary(summary)
    return code


def cmd_stop(args) -> int:
    from recorder.daemon import stop_background

    summary = stop_background(args.db.resolve())
    if args.json:
        print(json.dumps(summary, indent=1))
    else:
        _print_summary(summary)
    return 0


def cmd_status(args) -> int:
    from recorder.daemon import read_status

    st = read_status(args.db.resolve())
    if args.json:
        print(json.dumps(st, indent=1))
        return 0
    print(f"session {st.get('session_id', '?')} recording for {st.get('running_s', 0)} s "
          f"(recorder pid {st['recorder_pid']}, target {st.get('target', '?')})")
    for kind, n in st.get("events", {}).items():
        rate = st.get("events_per_s", {}).get(kind, 0)
        print(f"  {kind:8s} {n:>10d} events  {rate:>10.1f}/s")
    print(f"  dropped  {st.get('dropped', 0):>10d}")
    print(f"  database {st.get('db_bytes', 0) / 1e6:.1f} MB  {st.get('db')}")
    flight = st.get("flight")
    if flight:
        cap = f", at most {flight['max_bytes'] / 1e6:.0f} MB" if flight["max_bytes"] else ""
        oldest = ("no off-CPU interval kept yet" if flight["oldest_event_s"] is None
                  else f"the oldest off-CPU interval kept is {flight['oldest_event_s']:g} s old")
        print(f"  flight recorder: keeps the last {flight['keep_s']:g} s{cap} (now {flight['kept_s']:g} s; "
              f"{oldest}); incidents {flight['before_s']:g} s before to "
              f"{flight['after_s']:g} s after a trigger ({', '.join(flight['triggers']) or 'none'})")
        if flight.get("short_by_size"):
            print(f"  window shorter than --keep: {flight['max_bytes'] / 1e6:.0f} MB holds {flight['kept_s']:g} s "
                  f"at this event rate (the shortest so far {flight['shortest_kept_s']:g} s)")
        for inc in flight["incidents"]:
            print(f"  incident {inc['file']} ({inc['bytes'] / 1e6:.1f} MB): {inc['detail']}")
        for p in flight["pending"]:
            print(f"  incident waiting: {p['trigger']}, saved in {p['due_in_s']:g} s")
        for trigger, n in flight["suppressed"].items():
            print(f"  {n} {trigger} trigger(s) not saved (rate limit: one per {flight['cooldown_s']:g} s per kind, "
                  f"{flight['max_per_hour']} an hour)")
        for err in flight["errors"]:
            print(f"  error: {err}")
        if flight.get("hook"):
            print(f"  --on-incident {flight['on_incident']}: run {flight['hook']['runs']} times, "
                  f"{flight['hook']['failures']} failed")
        print(f"  incidents folder {flight['incidents_dir']}")
    return 0


def cmd_dump(args) -> int:
    from recorder.flight import incident_name, save_incident
    from store.db import open_store
    from store.flight import incidents_dir
    from store.report.build import parse_duration, session_end, session_row

    db = args.db.resolve()
    with open_store(db, readonly=True) as store:
        session = session_row(store, args.session)
        end = session_end(store, session)
        if session["stopped_ts"] is None:  # still recording: up to now
            from recorder.core.clock import now_ns

            end = max(end, now_ns())
        start = session["started_ts"]
        first = store.one("SELECT min(ts) AS ts FROM offcpu_interval WHERE session_id = ?", (session["id"],))
        if first and first["ts"]:
            start = max(start, first["ts"])
        if args.last:
            start = max(start, end - parse_duration(args.last))
    out = args.output
    if out is None:
        folder = incidents_dir(db)
        folder.mkdir(exist_ok=True)
        out = folder / incident_name(end + session["wall_offset_ns"], "dump")
    row = save_incident(db, out.resolve(), session["id"], start, end, trigger="dump",
                        detail=f"recorder dump{' --last ' + args.last if args.last else ''}", ts=end)
    if args.json:
        print(json.dumps(row, indent=1))
    else:
        print(f"wrote {row['file']} ({row['bytes'] / 1e6:.1f} MB): session {row['session_id']}, "
              f"{(row['end_ts'] - row['start_ts']) / 1e9:.1f} s, {row['rows']} rows; explain it with: "
              f"recorder explain --db {shlex.quote(row['file'])}")
    return 0


def cmd_explain(args) -> int:
    from store.db import open_store
    from store.report.build import explain, render_text

    with open_store(args.db, readonly=True) as store:
        report = explain(store, args.session, args.window, args.since, args.worst, args.step)
    print(json.dumps(report, indent=1) if args.json else render_text(report, stack=args.stack))
    return 0


def cmd_import(args) -> int:
    from store.traces import import_files

    result = import_files(args.db, args.files, join=True if args.join == -1 else args.join)
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    for r in result:
        rank = ""
        if r["rank"] is not None:
            rank = f", rank {r['rank']}" + (f" of {r['world_size']}" if r["world_size"] else "")
        if r["format"] == "chrome_trace":
            steps = r["steps"]
            span = f"steps {steps[0]}..{steps[-1]}" if steps else "no ProfilerStep#N (no steps)"
            print(f"session {r['session_id']}: {r['file']}{rank}: {r['host_ops']} host ops, {r['device_activities']} "
                  f"device activities ({r['kernels']} kernels on {r['runtime'] or 'no device'}), {span}")
        else:
            print(f"session {r['session_id']}: {r['file']}{rank}: Flight Recorder dump, {r['records']} collectives, "
                  f"{r['not_completed']} not completed")
        if r.get("join"):
            j = r["join"]
            print(f"  joined to session {j['session_id']}: {j['note']}" if j["aligned"] else
                  f"  not joined to session {j['session_id']}: {j['note']}")
    first = result[0]
    print(f"explain it with: recorder explain --db {shlex.quote(str(args.db))} --session {first['session_id']}"
          + (f" --step {first['steps'][0]}" if first.get("steps") else ""))
    return 0


def cmd_steps(args) -> int:
    from store.db import open_store
    from store.report.listing import render_steps, steps

    with open_store(args.db, readonly=True) as store:
        result = steps(store, args.session, slow_only=args.slow, limit=args.limit)
    print(json.dumps(result, indent=1) if args.json else render_steps(result))
    return 0


def cmd_top(args) -> int:
    from store.db import open_store
    from store.report.listing import render_top, top

    with open_store(args.db, readonly=True) as store:
        result = top(store, args.session, limit=args.limit)
    print(json.dumps(result, indent=1) if args.json else render_top(result))
    return 0


def _can_store_rechecks(db: Path) -> bool:
    """Whether verify-checkpoints may write its rows into `db`: a file of this version's schema that
    this user can write, which no recorder is writing."""
    import sqlite3

    from store.db import SCHEMA_VERSION, being_written, sqlite_uri

    if not db.is_file() or not os.access(db, os.W_OK) or not os.access(db.parent, os.W_OK) or being_written(db):
        return False
    try:
        conn = sqlite3.connect(sqlite_uri(db, mode="ro"), uri=True)
        try:
            return conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
        finally:
            conn.close()
    except sqlite3.Error:
        return True  # the writable open says what is wrong with it


def cmd_verify_checkpoints(args) -> int:
    from recorder.layers.checkpoint import render_verification, verify_checkpoints
    from store.db import open_store

    # each look is stored as a 'recheck' row where the recording can take it (this version's schema,
    # writable, no recorder writing it); elsewhere the files are hashed all the same and nothing is stored
    with open_store(args.db, readonly=not _can_store_rechecks(args.db)) as store:
        results = verify_checkpoints(store, args.session)
        stored = not store.readonly
    print(json.dumps(results, indent=1) if args.json else render_verification(results))
    if results and not stored:
        print(f"recorder: the results are not stored in {args.db} (it is read-only to this user, being recorded "
              "or of an earlier version: 'recorder upgrade' migrates it)", file=sys.stderr)
    return 0 if all(r["matches"] for r in results) else 1


def cmd_upgrade(args) -> int:
    from store.db.older import upgrade

    result = upgrade(args.db)
    if args.json:
        print(json.dumps(result, indent=1))
    elif result["from_version"] == result["to_version"]:
        print(f"{args.db} already has schema v{result['to_version']}: nothing to do")
    else:
        print(f"upgraded {args.db} from schema v{result['from_version']} to v{result['to_version']}: "
              f"{sum(result['tables'].values())} rows in {len(result['tables'])} tables kept")
    return 0


def cmd_export(args) -> int:
    from store.db import open_store

    if not (args.perfetto or args.datasette_metadata or args.parquet):
        raise UserError("say what to write: recorder export --perfetto FILE, --datasette-metadata FILE or "
                        "--parquet DIR")
    if (args.window or args.step is not None) and not args.perfetto:
        raise UserError("--window and --step choose what --perfetto FILE exports: add --perfetto FILE")
    written = []
    if args.parquet:
        from store.exports.parquet import export_parquet

        result = export_parquet(args.db, args.parquet, args.session, args.reports)
        written.append({"format": "parquet", **result})
    elif args.reports != 16:
        raise UserError("--reports sets what --parquet DIR exports: add --parquet DIR")
    with open_store(args.db, readonly=True) as store:
        if args.perfetto:
            from store.exports.perfetto import export_perfetto

            written.append({"format": "perfetto", **export_perfetto(store, args.perfetto, args.session,
                                                                     args.window, args.step)})
        if args.datasette_metadata:
            from store.exports.datasette import export_datasette_metadata

            written.append({"format": "datasette-metadata",
                            **export_datasette_metadata(store, args.datasette_metadata)})
    shipped = next((w["shipped"] for w in written if w.get("shipped")), None)
    code = 1 if shipped and shipped["pending"] else 0
    if args.json:
        print(json.dumps(written, indent=1))
        return code
    for w in written:
        if w["format"] == "parquet":
            stalls = sum(a["stalls"] for a in w["answers"].values())
            explained = sum(a["stalls_explained"] for a in w["answers"].values())
            reports = sum(a["reports"] for a in w["answers"].values())
            print(f"exported {args.db} (sessions {', '.join(map(str, w['sessions']))}, node "
                  f"{', '.join(w['nodes'])}) into {w['out']}: {len(w['rows'])} tables, views and answers, "
                  f"{sum(w['rows'].values())} rows; {stalls} stalls, {explained} with their cause"
                  + (f" (the worst {explained}: at most 256 a session)" if explained < stalls else "")
                  + f", {reports} full reports (the worst steps' reports: --reports {args.reports}); "
                  f"export schema {w['schema_version']}")
            if w.get("skipped_tables"):
                print(f"recorder: left out {len(w['skipped_tables'])} table(s) whose names are not of the recorder's "
                      f"shape (letters, digits, _): {', '.join(repr(n[:60]) for n in w['skipped_tables'][:5])}",
                      file=sys.stderr)
            if w.get("shipped"):
                sh = w["shipped"]
                for line in sh.get("quarantined", []):
                    print(f"recorder: {line}", file=sys.stderr)
                if sh["pending"]:
                    print(f"recorder: the store did not take it ({sh['error']}): {sh['pending']} upload(s) kept in "
                          f"{w['spool']}, sent by the next export to {w['out']} that reaches the store",
                          file=sys.stderr)
                elif len(sh["uploaded"]) > 1:
                    print(f"uploaded {len(sh['uploaded']) - 1} earlier upload(s) from the spool {w['spool']} too")
                if sh.get("waiting"):
                    print(f"{sh['waiting']} earlier upload(s) to other destinations wait in the spool {w['spool']}: "
                          "each goes with the next export to its own URL")
        elif w["format"] == "perfetto":
            print(f"wrote {w['file']} ({w['bytes'] / 1e6:.1f} MB): session {w['session_id']}, {w['tracks']} tracks, "
                  f"{w['slices']} slices, {w['instants']} instants, {w['counter_values']} counter values, "
                  f"{w['flows']} causal flows; open it in ui.perfetto.dev")
        else:
            browse = (f"browse with: datasette {shlex.quote(w['database_file'])} -m {shlex.quote(w['file'])}"
                      if w["database_file"] else
                      "Datasette reads the file itself, and no migrated copy of it is kept here (no private cache "
                      "folder: set STALL_RECORDER_CACHE_DIR): browse a copy of it made current with "
                      "'recorder upgrade --db COPY'")
            if w["database_file"] not in (None, str(args.db)):
                browse += (f" (the copy of {args.db} migrated to this version's schema; 'recorder upgrade --db "
                           f"{shlex.quote(str(args.db))}' migrates the file itself)")
            print(f"wrote {w['file']}: {w['tables']} tables and views, {w['columns']} column descriptions, "
                  f"{w['queries']} canned queries; {browse}")
    return code


def cmd_report(args) -> int:
    from store.db import open_store
    from store.report.html import write_html

    with open_store(args.db, readonly=True) as store:
        info = write_html(store, args.html, args.session, args.window, args.step)
    if args.json:
        print(json.dumps(info, indent=1))
    else:
        print(f"wrote {info['file']} ({info['bytes'] / 1e3:.0f} kB): session {info['session_id']}, "
              f"{'a stall' if info['stall'] else 'no stall'}; open it in any browser")
    return 0


def cmd_demo(args) -> int:
    from recorder.demo import SCENARIOS, write_scenario
    from store.db import open_store
    from store.report.build import explain, render_text

    if args.list:
        width = max(map(len, SCENARIOS))
        for s in SCENARIOS.values():
            print(f"{s.name:{width}}  {s.summary}")
        return 0
    if not args.no_gpu:
        raise UserError("recorder demo writes synthetic recordings: pass --no-gpu SCENARIO "
                        "('make demo' records a live one with real probes)")
    if not args.scenario:
        raise UserError("name a scenario: recorder demo --no-gpu SCENARIO (--list names them)")
    if args.scenario not in SCENARIOS:
        raise UserError(f"no scenario {args.scenario!r}: choose one of {', '.join(SCENARIOS)}")
    db = args.db or Path(f"demo-{args.scenario}.db")
    session_id = write_scenario(args.scenario, db)
    with open_store(db, readonly=True) as store:
        report = explain(store, session_id)
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        print(render_text(report))
        print(f"\n(session {session_id} written to {db}: recorder explain --db {shlex.quote(str(db))} --json, "
              f"recorder steps --db {shlex.quote(str(db))} --slow, or sqlite3 {shlex.quote(str(db))} "
              "'SELECT * FROM step_cause')")
    return 0


def cmd_cluster(args) -> int:
    from recorder.cluster_cli import cmd_cluster as run

    return run(args)


def cmd_mcp(args) -> int:
    if args.http:
        from mcp_server.https import serve_https

        serve_https(args.db, args.http, args.certfile, args.keyfile, args.token_file, args.allow_host,
                    Settings.from_environment(only=("mcp_token",)).mcp_token)
    else:
        if args.certfile or args.keyfile or args.token_file:
            raise UserError("--certfile, --keyfile and --token-file go with --http HOST:PORT")
        from mcp_server.server import serve_stdio

        serve_stdio(args.db)
    return 0


COMMANDS = {
    "doctor": cmd_doctor, "start": cmd_start, "record": cmd_record, "stop": cmd_stop,
    "status": cmd_status, "dump": cmd_dump, "explain": cmd_explain, "import": cmd_import, "steps": cmd_steps,
    "top": cmd_top,
    "demo": cmd_demo,
    "export": cmd_export, "report": cmd_report, "cluster": cmd_cluster,
    "verify-checkpoints": cmd_verify_checkpoints, "upgrade": cmd_upgrade,
    "mcp": cmd_mcp,
}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except UserError as e:
        print(f"recorder: {e}", file=sys.stderr)
        return 2
    except sqlite3.DatabaseError as e:  # a page read while reporting that is damaged: said, not a traceback
        from store.db import damaged, damaged_message

        if not damaged(e):
            raise
        print(f"recorder: {damaged_message(getattr(args, 'db', None) or 'the recording', e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # the reader went away (recorder steps | head): not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141


if __name__ == "__main__":
    sys.exit(main())
