"""Rank 0's word to the other ranks of a tensor-parallel group: each step's plan, or stop.

Every rank must run every forward with the same inputs, in the same order, or the collectives inside the model
pair up wrongly and hang. So rank 0 broadcasts each step's StepPlan (msgspec bytes, never pickle: nano-vllm's
pickled commands in shared memory corrupted and hung ranks, nano-vllm#246) before its own forward; the other ranks
build the same tensors from it and run the same forward.

The channel is its own gloo group, with no practical timeout: the other ranks wait on it for as long as the engine
idles, and during the minutes ranks take to load their shards. The model's collectives run on the default group,
whose timeout is the stall time: a rank that died or hung fails rank 0's step instead of stalling it forever.

Each command is signed with the group's secret and its sequence number (group_auth.py): gloo's connections are
loopback TCP, and a rank takes only what rank 0 sent, in order, never a forged or replayed plan.
"""

from __future__ import annotations

import hmac

import msgspec
import torch
import torch.distributed as dist

from gpu_runtime.ipc.peer_auth import PeerAuth
from gpu_runtime.step_inputs import StepPlan

_MAC_BYTES = 32  # HMAC-SHA256, after the payload


class RunStep(msgspec.Struct, frozen=True, tag="step"):
    plan: StepPlan


class Stop(msgspec.Struct, frozen=True, tag="stop"):
    reason: str


RankCommand = RunStep | Stop


class ForgedCommand(RuntimeError):
    """A broadcast whose MAC is not rank 0's for its place in the sequence: the rank stops rather than run it."""


class StepChannel:
    """Broadcasts RankCommands from rank 0 over `group` (a gloo group: on CUDA the model's own collectives run on
    NCCL, and this small host-side payload stays on the host); also the group's agreements while it starts."""

    def __init__(self, auth: PeerAuth, group: dist.ProcessGroup | None = None):
        self._auth = auth
        self._group = group
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(RankCommand)
        self._sequence = 0  # commands sent (rank 0) or taken (the others): every rank counts the same

    def send(self, command: RankCommand) -> None:
        sealed = self.seal(command)
        dist.broadcast(torch.tensor([len(sealed)], dtype=torch.int64), src=0, group=self._group)
        dist.broadcast(torch.frombuffer(bytearray(sealed), dtype=torch.uint8), src=0, group=self._group)

    def receive(self) -> RankCommand:
        size = torch.zeros(1, dtype=torch.int64)
        dist.broadcast(size, src=0, group=self._group)
        payload = torch.empty(int(size.item()), dtype=torch.uint8)
        dist.broadcast(payload, src=0, group=self._group)
        return self.open(payload.numpy().tobytes())

    def seal(self, command: RankCommand) -> bytes:
        """The command's bytes, then their MAC (with the next sequence number)."""
        payload = self._encoder.encode(command)
        sealed = payload + self._auth.tp_step_mac(self._sequence, payload)
        self._sequence += 1
        return sealed

    def open(self, sealed: bytes) -> RankCommand:
        """The command sealed as the next in sequence; ForgedCommand if its MAC is not (checked before decoding)."""
        payload, mac = sealed[:-_MAC_BYTES], sealed[-_MAC_BYTES:]
        if len(sealed) < _MAC_BYTES or not hmac.compare_digest(self._auth.tp_step_mac(self._sequence, payload), mac):
            raise ForgedCommand(f"tensor-parallel command {self._sequence}: its MAC is not rank 0's (forged, "
                                f"replayed or reordered); this rank stops")  # fmt: skip
        self._sequence += 1
        return self._decoder.decode(payload)

    def smallest(self, value: int) -> int:
        """The smallest of every rank's `value` (the KV pages each rank's memory allows: all must hold as many)."""
        tensor = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=self._group)
        return int(tensor.item())

    def barrier(self) -> None:
        """Waits for every rank (all loaded, say), however long that takes."""
        dist.barrier(group=self._group)
