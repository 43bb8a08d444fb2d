"""Rank 0's word to the other ranks of a tensor-parallel group: each step's plan, or stop.

Every rank must run every forward with the same inputs, in the same order, or the collectives inside the model
pair up wrongly and hang. So rank 0 broadcasts each step's StepPlan (msgspec bytes, never pickle: nano-vllm's
pickled commands in shared memory corrupted and hung ranks, nano-vllm#246) before its own forward; the other ranks
build the same tensors from it and run the same forward.

The channel is its own gloo group, with no practical timeout: the other ranks wait on it for as long as the engine
idles, and during the minutes ranks take to load their shards. The model's collectives run on the default group,
whose timeout is the stall time: a rank that died or hung fails rank 0's step instead of stalling it forever.
"""

from __future__ import annotations

import msgspec
import torch
import torch.distributed as dist

from gpu_runtime.step_inputs import StepPlan


class RunStep(msgspec.Struct, frozen=True, tag="step"):
    plan: StepPlan


class Stop(msgspec.Struct, frozen=True, tag="stop"):
    reason: str


RankCommand = RunStep | Stop


class StepChannel:
    """Broadcasts RankCommands from rank 0 over `group` (a gloo group: on CUDA the model's own collectives run on
    NCCL, and this small host-side payload stays on the host); also the group's agreements while it starts."""

    def __init__(self, group: dist.ProcessGroup | None = None):
        self._group = group
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(RankCommand)

    def send(self, command: RankCommand) -> None:
        payload = self._encoder.encode(command)
        dist.broadcast(torch.tensor([len(payload)], dtype=torch.int64), src=0, group=self._group)
        dist.broadcast(torch.frombuffer(bytearray(payload), dtype=torch.uint8), src=0, group=self._group)

    def receive(self) -> RankCommand:
        size = torch.zeros(1, dtype=torch.int64)
        dist.broadcast(size, src=0, group=self._group)
        payload = torch.empty(int(size.item()), dtype=torch.uint8)
        dist.broadcast(payload, src=0, group=self._group)
        return self._decoder.decode(payload.numpy().tobytes())

    def smallest(self, value: int) -> int:
        """The smallest of every rank's `value` (the KV pages each rank's memory allows: all must hold as many)."""
        tensor = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=self._group)
        return int(tensor.item())

    def barrier(self) -> None:
        """Waits for every rank (all loaded, say), however long that takes."""
        dist.barrier(group=self._group)
