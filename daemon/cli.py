"""The `tokend` command line: `serve` runs the daemon, `generate` streams from it (or runs offline), `gateway` runs
the HTTP gateway alone, `bench` measures a running daemon, `usage` reads the usage ledger, `health` asks a daemon
whether it serves."""

from __future__ import annotations

import argparse
import sys

from common.addresses import is_loopback
from daemon.address_flag import DEFAULT_ADDRESS, add_address_flag
from daemon.api_key import add_api_key_flags
from daemon.bench.flags import add_bench_flags
from daemon.config import add_serve_flags
from daemon.health_command import HELP as HEALTH_HELP
from daemon.health_command import add_health_flags
from daemon.rollout_command import HELP as ROLLOUT_HELP
from daemon.rollout_command import add_rollout_flags
from daemon.tokenizer_path_command import HELP as TOKENIZER_PATH_HELP
from daemon.tokenizer_path_command import add_tokenizer_path_flags
from daemon.version import tokend_version


class _DefaultsShown(argparse.HelpFormatter):
    """Adds "(default: X)" to an option's help when X tells something and the help does not say it already (serve's
    help texts, made from its config fields, all do)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        unset = action.default is None or action.default is False or action.default in ("", [], argparse.SUPPRESS)
        if not action.option_strings or "default" in text or unset:
            return text
        return f"{text} (default: %(default)s)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tokend", description="tokend: an LLM serving daemon")
    version = f"tokend {tokend_version()}"
    parser.add_argument("--version", action="version", version=version, help="print tokend's version and exit")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve = commands.add_parser(
        "serve",
        help="run the daemon: gRPC frontend plus one scheduler per GPU group",
        description="Run the daemon. Every option is a flag, a top-level key of the --config TOML file (its name in "
        "snake_case) and an environment variable TOKEND_<KEY> (TOKEND_MAX_NUM_SEQS=8); flags win over the "
        "environment, which wins over the file, which wins over the defaults.",
    )
    serve.add_argument("--version", action="version", version=version, help="print tokend's version and exit")
    add_serve_flags(serve)
    _add_gateway_command(commands)
    bench = commands.add_parser(
        "bench", help="benchmark a running daemon (vLLM bench serve's metrics)", formatter_class=_DefaultsShown
    )
    add_bench_flags(bench)
    usage = commands.add_parser(
        "usage",
        help="token usage per tenant, from the usage ledger in the state directory",
        formatter_class=_DefaultsShown,
    )
    usage.add_argument("--state-dir", required=True, help="the daemon's --state-dir, which holds the usage ledger")
    usage.add_argument("--since", default=None, help="ISO time (2026-11-29T10:00:00Z) or unix seconds")
    usage.add_argument("--json", action="store_true", help="print JSON")
    _add_generate_command(commands)
    add_health_flags(commands.add_parser("health", help=HEALTH_HELP, formatter_class=_DefaultsShown))
    add_tokenizer_path_flags(commands.add_parser("tokenizer-path", help=TOKENIZER_PATH_HELP))
    add_rollout_flags(commands.add_parser("rollout", help=ROLLOUT_HELP, formatter_class=_DefaultsShown))
    return parser


def _add_gateway_command(commands) -> None:
    gateway = commands.add_parser(
        "gateway", help="run the HTTP/SSE gateway alone, in front of a running daemon", formatter_class=_DefaultsShown
    )
    add_address_flag(gateway, default=DEFAULT_ADDRESS)
    gateway.add_argument(
        "--host",
        default="127.0.0.1",
        help="the address it listens on; beyond loopback anyone who reaches it may use the daemon unless the daemon "
        "has [[tenants]], which the gateway cannot check",
    )
    gateway.add_argument("--http-port", type=int, default=8000, help="the port it listens on, on --host")
    gateway.add_argument("--sse-keepalive", type=float, default=5.0, help="seconds without a token before a comment")
    gateway.add_argument("--http-header-timeout", type=float, default=10.0, help="seconds to send a request's headers")
    gateway.add_argument("--http-max-connections", type=int, default=1024, help="open connections at once")
    gateway.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"), help="log level")


def _add_generate_command(commands) -> None:
    generate = commands.add_parser(
        "generate", help="stream a completion from a running daemon over gRPC", formatter_class=_DefaultsShown
    )
    generate.add_argument("prompts", nargs="+", help="prompts; with --offline, generated together in one batch")
    add_address_flag(generate, default=DEFAULT_ADDRESS)
    add_api_key_flags(generate, "a tenant's")  # default: $TOKEND_API_KEY, else none
    generate.add_argument(
        "--chat",
        action="store_true",
        help="send each prompt as one user message, rendered with the chat template",
    )
    generate.add_argument(
        "--model",
        default=None,
        help="served model name (with --offline: a checkpoint directory, a .gguf file or a built-in model's name)",
    )
    generate.add_argument("--max-tokens", type=int, default=64, help="tokens to generate at most")
    generate.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    generate.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: the smallest set of this mass")
    generate.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest tokens; 0: all")
    generate.add_argument("--seed", type=int, default=None, help="a seed makes sampling repeat")
    generate.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    generate.add_argument("--timeout", type=float, default=300.0, help="seconds before the call is abandoned")
    generate.add_argument(
        "--wait", type=float, default=60.0, help="seconds to wait for a starting daemon's model to serve; 0: none"
    )
    generate.add_argument("--offline", action="store_true", help="run the model in this process, no daemon")
    generate.add_argument("--device", default="auto", help="with --offline: cpu, cuda, cuda:N")
    generate.add_argument("--dtype", default="auto", help="with --offline: float32, bfloat16, float16")


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
        return _run_gateway(args)
    if args.command == "health":
        from daemon.health_command import run_health

        return run_health(args)
    if args.command == "rollout":
        from daemon.rollout_command import run_rollout

        try:
            return run_rollout(args)
        except ValueError as error:
            print(f"tokend rollout: {error}", file=sys.stderr)
            return 2
    if args.command == "tokenizer-path":
        from daemon.tokenizer_path_command import run_tokenizer_path

        return run_tokenizer_path(args)
    if args.command == "generate":
        from daemon.generate_command import run_generate, run_offline_generate

        try:
            return run_offline_generate(args) if args.offline else run_generate(args)
        except ValueError as error:  # bad input: say which field, no traceback
            print(f"tokend: {error}", file=sys.stderr)
            return 2
    return 1


def _run_gateway(args: argparse.Namespace) -> int:
    from common.logs import configure_logging
    from frontend.gateway.__main__ import run_gateway
    from frontend.gateway.spec import GatewaySpec

    spec = GatewaySpec(
        grpc_address=args.address,
        host=args.host,
        http_port=args.http_port,
        keepalive_s=args.sse_keepalive,
        header_timeout_s=args.http_header_timeout,
        max_connections=args.http_max_connections,
        log_level=args.log_level,
    )
    if not is_loopback(args.host):
        # The daemon refuses such a --host without tenants; alone, the gateway cannot see whether the daemon it
        # fronts has any, so it says so instead.
        configure_logging("gateway", args.log_level).warning(
            "gateway_beyond_loopback",
            host=args.host,
            message=f"listening on {args.host}: anyone who reaches it may use the daemon at {args.address} unless "
            "that daemon has [[tenants]] (the gateway passes Authorization on, but cannot check that tenants exist)",
        )
    return run_gateway(spec)


if __name__ == "__main__":
    sys.exit(main())
