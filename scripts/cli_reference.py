#!/usr/bin/env python3
"""Write docs/cli.md, the command-line reference, from the argparse parser of recorder/cli.py.

    scripts/cli_reference.py            rewrite docs/cli.md
    scripts/cli_reference.py --check    exit 1 when docs/cli.md is not what the code gives (make lint)

The defaults shown are those of an empty environment, so the file does not depend on who runs it.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "docs" / "cli.md"
WIDTH = "100"  # argparse wraps help at $COLUMNS - 2: fixed, so the text is the same on every terminal


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:  # argparse keeps its sub-commands here, with no public accessor
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def render() -> str:
    os.environ["COLUMNS"] = WIDTH
    sys.path.insert(0, str(ROOT))
    from recorder.cli import build_parser
    from recorder.core.settings import Settings

    parser = build_parser(Settings())
    lines = [
        "# Command-line reference",
        "",
        "Generated from `recorder/cli.py` by `scripts/cli_reference.py`; do not edit by hand (`make lint` fails",
        "when this file is stale: run `.venv/bin/python scripts/cli_reference.py` after changing the command line).",
        "Defaults are those of an empty environment; the `STALL_RECORDER_*` settings are listed in",
        "[architecture.md](architecture.md#settings).",
        "",
        "```text",
        parser.format_help().rstrip(),
        "```",
    ]
    for name, sub in _subparsers(parser).items():
        lines += ["", f"## recorder {name}", "", "```text", sub.format_help().rstrip(), "```"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="fail when docs/cli.md is stale instead of writing it")
    args = ap.parse_args(argv)
    text = render()
    if args.check:
        if not OUT.exists() or OUT.read_text() != text:
            print(f"{OUT.relative_to(ROOT)} is stale: run .venv/bin/python scripts/cli_reference.py", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
