"""Proof, before any step plan is sent, that every member of a tensor-parallel group holds the group's secret.

Gloo's (and NCCL's) connections between ranks are TCP listeners on loopback, which any local user can reach; a
racer that got itself paired at group start would read every StepPlan, and so every tenant's tokens. The ranks
rendezvous through a file in rank 0's private directory; beside it rank 0 writes the group's secret (a 0600 file,
peer_auth.write_secret), whose path only its own children are told. Once the group is formed, over each of its
process groups, every rank contributes a random nonce, answers HMAC(secret, every nonce, its rank), and checks
every other rank's answer: a member that cannot answer makes every honest rank refuse to start, naming it. The
step channel then signs each command with the same secret (StepChannel), so none can be forged or replayed later.
"""

from __future__ import annotations

import hmac
import secrets

import torch

from gpu_runtime.ipc.peer_auth import PeerAuth

_NONCE_BYTES = 32
_ANSWER_BYTES = 32  # an HMAC-SHA256


class GroupRefused(RuntimeError):
    """A member of the group could not prove it holds the group's secret: the group does not start."""


def prove_group(group, rank: int, world_size: int, auth: PeerAuth, device: torch.device) -> None:
    """Runs the challenge over `group` (a torch.distributed ProcessGroup; its tensors on `device`, the CPU for
    gloo); returns once every rank has answered rightly, raises GroupRefused naming those that did not."""
    nonces = _all_gather(group, secrets.token_bytes(_NONCE_BYTES), world_size, device)
    transcript = b"".join(nonces)
    answers = _all_gather(group, auth.tp_answer(transcript, rank, world_size), world_size, device)
    bad = wrong_answers(auth, transcript, answers)
    if bad:
        names = ", ".join(str(member) for member in bad)
        raise GroupRefused(f"tensor-parallel rank {names} of {world_size} could not prove it holds the group's "
                           f"secret: something other than this group's ranks joined it; refusing to start")  # fmt: skip


def wrong_answers(auth: PeerAuth, transcript: bytes, answers: list[bytes]) -> list[int]:
    """The ranks whose answer is not HMAC(secret, transcript, rank) (each compared in constant time)."""
    world_size = len(answers)
    return [member for member, answer in enumerate(answers)
            if not hmac.compare_digest(auth.tp_answer(transcript, member, world_size), answer)]  # fmt: skip


def _all_gather(group, data: bytes, world_size: int, device: torch.device) -> list[bytes]:
    """Every rank's `data` (the same length on each), in rank order: the group's own allgather, so that it works
    for any ProcessGroup, registered with torch.distributed or not."""
    mine = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
    gathered = [torch.empty_like(mine) for _ in range(world_size)]
    group.allgather([gathered], [mine]).wait()
    return [part.cpu().numpy().tobytes() for part in gathered]
