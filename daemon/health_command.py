"""`tokend health`: asks a daemon's gRPC health service whether it serves; exit 0 if it does, 1 if not.

For probes that run a command (Docker's HEALTHCHECK, a Kubernetes exec probe, a shell script): grpc.health.v1's
service "" is SERVING while every scheduler is live, and NOT_SERVING while starting, draining or with one down.
Runs as `python -m daemon.health_command` too, which needs nothing but the installed package.
"""

from __future__ import annotations

import argparse
import os
import sys

from daemon.address_flag import add_address_flag

HELP = "ask a daemon's gRPC health service whether it serves: exit 0 if it does, 1 if not"
# The port `tokend serve` takes from the same variable, so that a container that sets it is probed there.
_DEFAULT_ADDRESS = f"127.0.0.1:{os.environ.get('TOKEND_GRPC_PORT', '').strip() or 50051}"


def add_health_flags(parser: argparse.ArgumentParser) -> None:
    add_address_flag(parser, default=_DEFAULT_ADDRESS)
    parser.add_argument(
        "--service", default="", help='the health service name: "" (the whole daemon) or a served model\'s name'
    )
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the answer")


def run_health(args: argparse.Namespace) -> int:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    request = health_pb2.HealthCheckRequest(service=args.service)
    with grpc.insecure_channel(args.address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(request, timeout=args.timeout)
        except grpc.RpcError as error:
            print(f"tokend health: {args.address}: {error.code().name}: {error.details()}", file=sys.stderr)
            return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    print(status)
    return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1


def main() -> int:
    parser = argparse.ArgumentParser(prog="tokend health", description=HELP)
    add_health_flags(parser)
    return run_health(parser.parse_args())


if __name__ == "__main__":
    sys.exit(main())
