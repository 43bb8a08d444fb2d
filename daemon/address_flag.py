"""--address: the daemon's gRPC address, one flag under one name in every command that talks to a daemon."""

from __future__ import annotations

import argparse

DEFAULT_ADDRESS = "127.0.0.1:50051"


def add_address_flag(parser: argparse.ArgumentParser | argparse._ArgumentGroup, default: str | None = None) -> None:
    """Adds --address (HOST:PORT), read as `args.address`. `--grpc`, its old name in `gateway` and `bench`, still
    works, unlisted."""
    parser.add_argument("--address", metavar="HOST:PORT", help="the daemon's gRPC address", default=default)
    parser.add_argument("--grpc", dest="address", help=argparse.SUPPRESS, default=default)
