#!/usr/bin/env python3
"""Chaos and fuzz run against a real tokend daemon on loopback: prints one JSON report, exits 0 iff nothing was lost.

Usage: .venv/bin/python scripts/chaos.py [--fuzz-inputs 10000] [--faults 30] [--seed 0] [--pd] [--out PATH]
The parts live in tests/chaos/ (one job per file, beside the test harness they use); see chaos/cli.py for the flags.
"""

import sys
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]
# The project's packages, then tests/ (the chaos package and its harness), ahead of scripts/: this file is also
# named chaos, and the package must win.
sys.path[:0] = [str(_ROOT), str(_ROOT / "tests")]

from chaos.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
