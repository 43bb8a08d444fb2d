"""tokend's version, for `tokend --version`: the installed package's, else the checkout's pyproject.toml."""

from __future__ import annotations

import importlib.metadata
import tomllib
from pathlib import Path

PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"


def tokend_version() -> str:
    try:
        return importlib.metadata.version("tokend")
    except importlib.metadata.PackageNotFoundError:  # run from a checkout (PYTHONPATH) without installing it
        pass
    try:
        with PYPROJECT.open("rb") as file:
            return tomllib.load(file)["project"]["version"]
    except (OSError, tomllib.TOMLDecodeError, KeyError):
        return "unknown"
