"""`recorder cluster explain|steps|demo`: the command line of the cluster view (store/cluster/__init__.py)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from store.errors import UserError
from store.objectstore import ExportLimits

EXAMPLES = (
    "recorder cluster explain /shared/run42/recordings/          # a folder of node-*.db, the worst step\n"
    "  recorder cluster explain node-*.db --step 80042 --json\n"
    "  recorder cluster explain /shared/run42/parquet/            # an export of many nodes (export --parquet)\n"
    "  recorder cluster explain s3://stall-recordings/run42       # the same, in an object store (AWS_* variables)\n"
    "  recorder cluster steps node-*.db --slow\n"
    "  recorder cluster demo /tmp/job --nodes 4 && recorder cluster explain /tmp/job"
)


def add_parser(subs) -> None:
    text = "explain a step across the ranks of a multi-host job, from one recording per node"
    p = subs.add_parser("cluster", help=text, description=text, epilog="examples:\n  " + EXAMPLES,
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    cs = p.add_subparsers(dest="cluster_command", required=True, metavar="SUBCOMMAND")
    inputs = ("recordings (SQLite, one per node), folders of them, or Parquet exports (recorder export --parquet), "
              "local or s3://BUCKET/PREFIX")
    e = cs.add_parser("explain", help="which rank was late in a stalled step, on which node, and why",
                      description="Name the rank(s) that entered the stalled step's collective late (or never), "
                                  "with node and database, and explain each from its own recording.")
    e.add_argument("paths", nargs="+", metavar="DB_OR_DIR", help=inputs)
    g = e.add_mutually_exclusive_group()
    g.add_argument("--step", type=int, metavar="N", help="explain step N (stalled or not)")
    g.add_argument("--worst", action="store_true", help="the worst step (the default): a hang, else the worst stall")
    e.add_argument("-j", "--json", action="store_true", help="the report as JSON (same content)")
    _limit_options(e)
    s = cs.add_parser("steps", help="every step of the job across ranks: duration, baseline, latest arrival",
                      description="Every step across the ranks: median duration, rolling baseline, and the rank "
                                  "that entered the step's collective last.")
    s.add_argument("paths", nargs="+", metavar="DB_OR_DIR", help=inputs)
    s.add_argument("--slow", action="store_true", help="only the stalled steps")
    s.add_argument("--limit", type=int, default=0, metavar="N", help="at most N steps (default: all)")
    s.add_argument("-j", "--json", action="store_true", help="machine-readable output")
    _limit_options(s)
    d = cs.add_parser("demo", help="write synthetic node recordings of a job with one late rank (no root, no BPF)",
                      description="Write one synthetic recording per node (node-00.db, ...) of a data-parallel "
                                  "job whose rank --late-rank waits 3.4 s on an NVMe timeout in step 80042.")
    d.add_argument("folder", type=Path, help="folder to write node-NN.db into (created if missing)")
    d.add_argument("--nodes", type=int, default=4, help="nodes (default 4)")
    d.add_argument("--ranks-per-node", type=int, default=8, help="ranks per node (default 8)")
    d.add_argument("--steps", type=int, default=60, help="steps from 80000 (default 60)")
    d.add_argument("--late-rank", type=int, default=17, help="the rank made late (default 17)")
    d.add_argument("--hang", action="store_true", help="the late rank never comes back (a hang)")
    d.add_argument("--skew", action="append", default=[], metavar="NODE=MS",
                   help="shift node NODE's wall clock by MS milliseconds (repeatable)")


def _limit_options(p) -> None:
    """How much of an export is read: an export is input from whoever can write its folder or bucket."""
    d = ExportLimits()
    p.add_argument("--max-export-size", metavar="SIZE", default=f"{d.max_bytes >> 30}GiB",
                   help=f"read at most SIZE of Parquet files from each export (default {d.max_bytes >> 30}GiB)")
    p.add_argument("--max-export-objects", type=int, metavar="N", default=d.max_objects,
                   help=f"read at most N Parquet files from each export (default {d.max_objects})")
    p.add_argument("--memory", metavar="SIZE", default=d.memory,
                   help=f"DuckDB's memory limit; beyond it, it spills to a private temporary folder "
                        f"(default {d.memory})")


def _limits(args) -> ExportLimits:
    from recorder.flight import parse_size

    size = parse_size(args.max_export_size)
    memory = parse_size(args.memory)
    if size < 1 or args.max_export_objects < 1 or memory < 16 << 20:
        raise UserError("--max-export-size and --max-export-objects must be positive and --memory at least 16MB: "
                        "pass e.g. --max-export-size 20GiB --max-export-objects 50000 --memory 8GB")
    return ExportLimits(max_bytes=size, max_objects=args.max_export_objects, memory=f"{memory // (1 << 20)}MiB")


def cmd_cluster(args) -> int:
    from store import cluster

    if args.cluster_command == "demo":
        return _demo(args)
    if args.cluster_command == "steps":
        result = cluster.steps_paths(args.paths, slow_only=args.slow, limit=args.limit, limits=_limits(args))
        print(json.dumps(result, indent=1) if args.json else cluster.render_steps(result))
        return 0
    report = cluster.explain_paths(args.paths, step=args.step, worst=args.worst, limits=_limits(args))
    print(json.dumps(report, indent=1) if args.json else cluster.render_explain(report))
    return 1 if report["verdict"] == "clock_skew_too_large" else 0


def _demo(args) -> int:
    from recorder.cluster_demo import ClusterSpec, write_cluster

    skew = {}
    for item in args.skew:
        node, _, value = item.partition("=")
        try:
            skew[int(node)] = float(value)
        except ValueError:
            raise UserError(f"cannot read --skew {item!r}: write NODE=MS, e.g. --skew 2=5000") from None
    if args.nodes < 1 or args.ranks_per_node < 1 or args.steps < 25:
        raise UserError("give at least 1 node, 1 rank per node and 25 steps (the stall is step 80042)")
    if not 0 <= args.late_rank < args.nodes * args.ranks_per_node:
        raise UserError(f"--late-rank must be a rank of the job: 0..{args.nodes * args.ranks_per_node - 1}")
    spec = ClusterSpec(nodes=args.nodes, ranks_per_node=args.ranks_per_node, steps=args.steps,
                       late_rank=args.late_rank, hang=args.hang, skew_ms=skew)
    paths = write_cluster(args.folder, spec)
    print(f"wrote {len(paths)} node recordings into {args.folder} (rank {args.late_rank} on "
          f"{spec.node_name(args.late_rank // args.ranks_per_node)} is late in step {spec.stall_step}): "
          f"recorder cluster explain {args.folder}")
    return 0
