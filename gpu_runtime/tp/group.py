"""Joining and leaving a tensor-parallel group, the same for rank 0 and the others.

The ranks meet through a file in a private directory (torch.distributed's FileStore: no TCP store to expose).
Gloo's and NCCL's own connections between the ranks stay on the loopback interface unless the operator says
otherwise (GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME): a group is one host's processes. Those listeners accept any
local user, so before anything else crosses them every rank proves it holds the group's secret (group_auth.py).
"""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path

import msgspec
import torch
import torch.distributed as dist

from gpu_runtime.engine_config import EngineConfig
from gpu_runtime.ipc.peer_auth import PeerAuth
from gpu_runtime.model.tensor_parallel import TensorParallel
from gpu_runtime.tp.group_auth import prove_group
from gpu_runtime.tp.step_channel import StepChannel

# The default group's timeout: the step channel runs on it, and the other ranks wait there for as long as the engine
# idles; a rank that never joins is rank 0's RankGroup's to notice (it watches the processes while they start).
_CONTROL_TIMEOUT = timedelta(days=365)


class RankSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What rank 0 tells each other rank it starts (JSON on the command line; nothing secret)."""

    rank: int
    world_size: int
    rendezvous: str  # the FileStore's file, in rank 0's private directory
    secret_path: str  # the group's secret (0600, beside the rendezvous): the path, never the secret (argv is public)
    engine: EngineConfig  # rank 0's, with its attention backend and dtype resolved: every rank builds the same
    model_dir: str
    device: str  # this rank's own: "cpu", or its GPU among the group's ("cuda:1")
    torch_threads: int
    collective_timeout_s: float
    log_level: str = "info"

    def to_json(self) -> str:
        return msgspec.json.encode(self).decode()

    @classmethod
    def from_json(cls, text: str) -> RankSpec:
        return msgspec.json.decode(text, type=cls)


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank `rank`'s device when rank 0's is `device`: the next GPUs of the group on CUDA, the CPU on a CPU."""
    if device.type != "cuda":
        return device
    return torch.device("cuda", (device.index or 0) + rank)


def join_group(
    rank: int, world_size: int, rendezvous: str, device: torch.device, collective_timeout_s: float, auth: PeerAuth
) -> tuple[TensorParallel, StepChannel]:
    """Joins the group (blocks until every rank has), and proves, over each of its connections' groups, that every
    member holds the group's secret (`auth`: GroupRefused otherwise); returns this rank's place in it and the step
    channel, which signs every command.

    Two process groups: the default one (gloo, no practical timeout) carries the step channel and the start-up
    agreements; the model's collectives run on their own (NCCL on CUDA, gloo on a CPU), which time out after
    `collective_timeout_s`, so a rank that died or hung fails the next step instead of hanging it."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
    cuda = device.type == "cuda"
    dist.init_process_group(
        "cpu:gloo,cuda:nccl" if cuda else "gloo",
        init_method=f"file://{rendezvous}",
        rank=rank,
        world_size=world_size,
        timeout=_CONTROL_TIMEOUT,
    )
    timeout = timedelta(seconds=collective_timeout_s)
    model_group = dist.new_group(backend="nccl" if cuda else "gloo", timeout=timeout)
    # Both groups, each with its own connections: the plans go on the default one, the activations on the other.
    prove_group(dist.group.WORLD, rank, world_size, auth, torch.device("cpu"))
    prove_group(model_group, rank, world_size, auth, device)
    return TensorParallel(rank, world_size, model_group), StepChannel(auth)


def started_marker(rendezvous: str, rank: int) -> Path:
    """The file a rank creates once it has started (its imports done), beside the rendezvous file."""
    return Path(rendezvous).with_name(f"rank{rank}.started")


def leave_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
