#!/usr/bin/env python3
"""Chaos and fuzz run against a real tokend daemon on loopback: prints one JSON report, exits 0 iff nothing was lost.

Usage: .venv/bin/python scripts/chaos.py [--fuzz-inputs 10000] [--faults 30] [--seed 0] [--out PATH]
The parts live in scripts/chaos/ (one job per file); see chaos/cli.py for the flags.
"""

import sys
from pathlib import Path

_SCRIPTS = Path(__file__).resolve().parent
sys.path[:0] = [str(_SCRIPTS.parent), str(_SCRIPTS)]  # the project's packages, then scripts/chaos/

from chaos.cli import main  # noqa: E402  (a package directory wins over this file of the same name)

if __name__ == "__main__":
    sys.exit(main())
