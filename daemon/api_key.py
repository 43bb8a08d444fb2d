"""Where a command's API key comes from: $TOKEND_API_KEY, --api-key-file, or stdin (`--api-key -`).

A key on the command line is in every user's `ps` and in /proc/<pid>/cmdline for as long as the command runs (a
rollout waits up to an hour), so a literal `--api-key KEY` still works but warns; the other sources stay private.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping
from typing import TextIO

API_KEY_ENV = "TOKEND_API_KEY"
ARGV_WARNING = (
    "warning: --api-key puts the key in this command's argv, which every local user can read (ps, /proc); "
    f"use ${API_KEY_ENV}, --api-key-file PATH, or --api-key - (from stdin)"
)


def add_api_key_flags(parser: argparse.ArgumentParser, whose: str) -> None:
    """--api-key and --api-key-file, for a key that is `whose` ("a tenant's", "an admin tenant's")."""
    parser.add_argument("--api-key", default=None, metavar="KEY",
                        help=f"{whose} API key, sent as `authorization: Bearer KEY`; '-' reads it from stdin (a "
                        f"literal key is visible to other users: prefer ${API_KEY_ENV} or --api-key-file)")  # fmt: skip
    parser.add_argument("--api-key-file", default=None, metavar="PATH",
                        help=f"a file holding {whose} API key (its first line)")  # fmt: skip


def api_key_of(args: argparse.Namespace, environ: Mapping[str, str] = os.environ, stdin: TextIO | None = None,
               stderr: TextIO | None = None) -> str:  # fmt: skip
    """The key the flags and environment give ("" for none): --api-key-file, else --api-key (stdin for '-'),
    else $TOKEND_API_KEY. ValueError naming the flag when a file cannot be read or holds no key."""
    path, given = getattr(args, "api_key_file", None), getattr(args, "api_key", None)
    if path and given:
        raise ValueError("api_key: give --api-key or --api-key-file, not both")
    if path:
        try:
            with open(path, encoding="utf-8") as file:
                return _first_line(file.read(), f"api_key_file: {path}")
        except OSError as error:
            raise ValueError(f"api_key_file: cannot read {path}: {error.strerror}") from None
    if given == "-":
        return _first_line((stdin or sys.stdin).read(), "api_key: stdin")
    if given:
        print(ARGV_WARNING, file=stderr or sys.stderr)
        return given
    return environ.get(API_KEY_ENV, "").strip()


def _first_line(text: str, where: str) -> str:
    key = text.strip().splitlines()[0].strip() if text.strip() else ""
    if not key:
        raise ValueError(f"{where} holds no key")
    return key
