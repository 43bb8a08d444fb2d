"""The `tokend` command line: `serve` runs the daemon, `generate` streams from it (or runs offline)."""

from __future__ import annotations

import argparse
import sys

from daemon.bench.flags import add_bench_flags
from daemon.config import add_serve_flags


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tokend", description="tokend: an LLM serving daemon")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser(
        "serve",
        help="run the daemon: gRPC frontend plus one scheduler per GPU group",
        description="Run the daemon. Every option is a flag, a top-level key of the --config TOML file (its name in "
        "snake_case) and an environment variable TOKEND_<KEY> (TOKEND_MAX_NUM_SEQS=8); flags win over the "
        "environment, which wins over the file, which wins over the defaults.",
    )
    add_serve_flags(serve)
    gateway = commands.add_parser("gateway", help="run the HTTP/SSE gateway alone, in front of a running daemon")
    gateway.add_argument("--grpc", default="127.0.0.1:50051", help="the daemon's gRPC address")
    gateway.add_argument("--http-port", type=int, default=8000, help="listens on 127.0.0.1")
    gateway.add_argument("--sse-keepalive", type=float, default=5.0, help="seconds without a token before a comment")
    gateway.add_argument("--http-header-timeout", type=float, default=10.0, help="seconds to send a request's headers")
    gateway.add_argument("--http-max-connections", type=int, default=1024, help="open connections at once")
    gateway.add_argument("--log-level", default="info")
    bench = commands.add_parser("bench", help="benchmark a running daemon (vLLM bench serve's metrics)")
    add_bench_flags(bench)
    usage = commands.add_parser("usage", help="token usage per tenant, from the usage ledger in the state directory")
    usage.add_argument("--state-dir", required=True)
    usage.add_argument("--since", default=None, help="ISO time (2026-11-29T10:00:00Z) or unix seconds")
    usage.add_argument("--json", action="store_true", help="print JSON")
    generate = commands.add_parser("generate", help="stream a completion from a running daemon over gRPC")
    generate.add_argument("prompts", nargs="+", help="prompts; with --offline, generated together in one batch")
    generate.add_argument("--address", default="127.0.0.1:50051", help="the daemon's gRPC address")
    generate.add_argument("--model", default=None, help="served model name (with --offline: a checkpoint directory)")
    generate.add_argument("--max-tokens", type=int, default=64)
    generate.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    generate.add_argument("--top-p", type=float, default=1.0)
    generate.add_argument("--top-k", type=int, default=0)
    generate.add_argument("--seed", type=int, default=None)
    generate.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    generate.add_argument("--timeout", type=float, default=300.0, help="seconds before the call is abandoned")
    generate.add_argument("--offline", action="store_true", help="run the model in this process, no daemon")
    generate.add_argument("--device", default="auto", help="with --offline: cpu, cuda, cuda:N")
    generate.add_argument("--dtype", default="auto", help="with --offline: float32, bfloat16, float16")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        from daemon.serve_command import run_serve

        return run_serve(args)
    if args.command == "bench":
        from daemon.bench.command import run_bench

        return run_bench(args)
    if args.command == "usage":
        from daemon.usage_command import run_usage

        try:
            return run_usage(args)
        except ValueError as error:
            print(f"tokend usage: {error}", file=sys.stderr)
            return 2
    if args.command == "gateway":
        from frontend.gateway.__main__ import run_gateway
        from frontend.gateway.spec import GatewaySpec

        spec = GatewaySpec(
            grpc_address=args.grpc,
            http_port=args.http_port,
            keepalive_s=args.sse_keepalive,
            header_timeout_s=args.http_header_timeout,
            max_connections=args.http_max_connections,
            log_level=args.log_level,
        )
        return run_gateway(spec)
    if args.command == "generate":
        from daemon.generate_command import run_generate, run_offline_generate

        try:
            return run_offline_generate(args) if args.offline else run_generate(args)
        except ValueError as error:  # bad input: say which field, no traceback
            print(f"tokend: {error}", file=sys.stderr)
            return 2
    return 1


if __name__ == "__main__":
    sys.exit(main())
