"""Regenerates docs/PERFORMANCE.md: runs the serving comparison (continuous vs static vs one request at a time,
through the gateway) and renders its JSON into the report, plots included. About 13 minutes on 2 cores.

    .venv/bin/python scripts/perf_report.py                 # measure, then write docs/PERFORMANCE.md
    .venv/bin/python scripts/perf_report.py --from-json docs/serving/serving_compare.json   # re-render only

Every flag of scripts/bench_serving_compare.py is accepted and passed on.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

import jinja2

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_serving_compare import parse_args, run_comparison  # noqa: E402

TEMPLATE = Path(__file__).resolve().parent / "templates" / "PERFORMANCE.md.j2"


def render(report: dict, figures_dir: str) -> str:
    environment = jinja2.Environment(
        loader=jinja2.FileSystemLoader(TEMPLATE.parent),
        undefined=jinja2.StrictUndefined,  # a figure missing from the JSON is an error, not an empty cell
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    environment.filters["ms"] = lambda value: f"{value:,.0f} ms" if value < 10_000 else f"{value / 1e3:,.1f} s"
    environment.filters["num"] = lambda value, digits=0: f"{value:,.{digits}f}"
    # Cut, not rounded: 2.997 shown as "3.00x" beside "not met" would read as a contradiction.
    environment.filters["ratio"] = lambda value: f"{math.floor(value * 100) / 100:.2f}"
    return environment.get_template(TEMPLATE.name).render(r=report, figures_dir=figures_dir).rstrip() + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--from-json", type=Path, help="render this comparison's JSON instead of measuring")
    parser.add_argument("--report", type=Path, default=Path("docs/PERFORMANCE.md"))
    own, rest = parser.parse_known_args()
    args = parse_args(rest)
    if own.from_json:
        report = json.loads(own.from_json.read_text())
        out_dir = own.from_json.parent
    else:
        report = run_comparison(args)
        out_dir = args.out_dir
    figures_dir = os.path.relpath(Path(out_dir).resolve(), own.report.resolve().parent)
    own.report.write_text(render(report, Path(figures_dir).as_posix()))
    print(f"wrote {own.report} from {Path(out_dir) / 'serving_compare.json'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
