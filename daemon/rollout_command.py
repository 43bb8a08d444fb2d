"""`tokend rollout`: asks a running daemon (Admin.Rollout) to move a model to new weights, or back, and waits.

It prints each new rollout event as the daemon reports it and exits 0 once the rollout is done (or held at its
canary share), 1 if it failed or was refused, 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import sys
import time

from common.lanes import RolloutPhase, RolloutStrategy
from daemon.address_flag import DEFAULT_ADDRESS, add_address_flag
from daemon.admin_token import ADMIN_TOKEN_FILE, read_admin_token
from daemon.api_key import API_KEY_ENV, add_api_key_flags, api_key_of
from daemon.config import default_state_dir
from daemon.generate_command import auth_metadata

HELP = "roll a served model onto new weights (or back) without dropping a stream"


def add_rollout_flags(parser: argparse.ArgumentParser) -> None:
    add_address_flag(parser, default=DEFAULT_ADDRESS)
    parser.add_argument("--model", required=True, help="the served model's name")
    parser.add_argument("--path", default="", help="the new weights: a checkpoint directory, .gguf file or built-in")
    parser.add_argument("--strategy", choices=list(RolloutStrategy), default=None,
                        help="surge: new workers on spare devices first; in-place: one group at a time "
                        "(default: surge when a spare device is free)")  # fmt: skip
    parser.add_argument("--canary-percent", type=int, default=0,
                        help="send this share of new requests to the new weights and hold there")  # fmt: skip
    parser.add_argument("--rollback", action="store_true", help="back to the weights before the latest rollout")
    parser.add_argument("--no-wait", action="store_true", help="return once the rollout has begun")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds to wait for it to settle")
    add_api_key_flags(parser, "an admin tenant's")
    parser.add_argument("--state-dir", default=None,
                        help=f"the daemon's --state-dir: with no key (--api-key, --api-key-file, ${API_KEY_ENV}), "
                        f"its {ADMIN_TOKEN_FILE} file is sent, the local admin credential (default: the daemon's "
                        "default, $STATE_DIRECTORY or $XDG_STATE_HOME/tokend)")  # fmt: skip


def run_rollout(args: argparse.Namespace) -> int:
    import grpc

    from tokend.v1 import tokend_pb2 as pb
    from tokend.v1 import tokend_pb2_grpc as pb_grpc

    if not args.path and not args.rollback:
        print("tokend rollout: path: give --path (or --rollback)", file=sys.stderr)
        return 2
    metadata = auth_metadata(admin_key_of(args))
    request = pb.RolloutRequest(model=args.model, path=args.path, strategy=args.strategy or "",
                                canary_percent=args.canary_percent, rollback=args.rollback)  # fmt: skip
    with grpc.insecure_channel(args.address) as channel:
        admin = pb_grpc.AdminStub(channel)
        try:
            status = admin.Rollout(request, metadata=metadata, timeout=30).rollout
            shown = _show(status, 0)
            deadline = time.monotonic() + args.timeout
            while not args.no_wait and not RolloutPhase(status.phase).settled and time.monotonic() < deadline:
                time.sleep(1.0)
                reply = admin.GetRollout(pb.GetRolloutRequest(model=args.model), metadata=metadata, timeout=30)
                status = reply.rollouts[0]
                shown = _show(status, shown)
        except grpc.RpcError as error:
            print(f"tokend rollout: {error.code().name}: {error.details()}", file=sys.stderr)
            return 1
    print(f"{args.model}: {status.phase} (epoch {status.epoch}, {status.path})")
    if status.error:
        print(f"tokend rollout: {status.error}", file=sys.stderr)
    return 1 if status.phase == RolloutPhase.FAILED else 0


def admin_key_of(args: argparse.Namespace) -> str:
    """An admin tenant's key if one is given, else the local admin token of the daemon at --state-dir ("" when
    neither: the daemon's refusal says how to get one)."""
    return api_key_of(args) or read_admin_token(args.state_dir or default_state_dir())


def _show(status, shown: int) -> int:
    """Prints the events not printed yet (the daemon keeps the latest few); returns how many have been."""
    events = list(status.events)
    for event in events[shown:] if shown <= len(events) else events:
        print(event, flush=True)
    return len(events)
