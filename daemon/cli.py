"""The `tokend` command line: one subcommand per job (`generate` now; `serve` with the daemon issue)."""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tokend", description="tokend: an LLM serving daemon")
    commands = parser.add_subparsers(dest="command", required=True)
    generate = commands.add_parser("generate", help="generate from prompts on the command line, offline")
    generate.add_argument("prompts", nargs="+", help="one or more prompts, generated together in one batch")
    generate.add_argument("--model", default=None, help="Hugging Face checkpoint directory (default: embedded)")
    generate.add_argument("--max-tokens", type=int, default=64)
    generate.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    generate.add_argument("--top-p", type=float, default=1.0)
    generate.add_argument("--top-k", type=int, default=0)
    generate.add_argument("--seed", type=int, default=None)
    generate.add_argument("--device", default="auto", help="cpu, cuda, cuda:N (default: cuda when present)")
    generate.add_argument("--dtype", default="auto", help="float32, bfloat16, float16 (default: by device)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "generate":
        from daemon.generate_command import run_generate

        try:
            return run_generate(args)
        except ValueError as error:  # bad input: say which field, no traceback
            print(f"tokend: {error}", file=sys.stderr)
            return 2
    return 1


if __name__ == "__main__":
    sys.exit(main())
