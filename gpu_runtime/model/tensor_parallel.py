"""Tensor parallelism, Megatron's split of the decoder over N ranks: a rank's view of the model and its collectives.

Each rank holds 1/N of the attention heads (query and KV heads alike, so its KV pool holds only its own KV heads),
1/N of the MLP's intermediate columns, and 1/N of the vocabulary:
- qkv_proj and gate_up_proj are column-parallel: a rank computes its own heads and intermediate columns, no
  communication;
- o_proj and down_proj are row-parallel: each rank's product is a partial sum over its own inputs, and one
  all-reduce per block adds them up. A row-parallel bias is held by rank 0 alone and added inside its matmul,
  before the reduce (vLLM's way), so it counts once and every projection stays a plain nn.Linear, which the CPU's
  prepacking (cpu_weights.py) replaces like any other;
- a Mixture-of-Experts block is split the same way inside every expert (Megatron's split of each expert's MLP, not
  whole experts per rank): each rank holds 1/N of every expert's gate/up columns and the matching down rows, routes
  every token itself (the router is replicated: every rank picks the same experts) and one all-reduce adds the
  partial sums. So every rank does 1/N of every routed token's work whatever the routing (whole experts per rank
  would leave ranks idle when the router favours one rank's experts, and need N to divide the expert count);
- the embedding is vocabulary-parallel: a rank looks up the ids in its range, zeros for the others, one all-reduce;
- lm_head is vocabulary-parallel: each rank computes its vocabulary's logits, gathered to rank 0, which samples.
A vocabulary that does not divide by N is padded (vLLM's way): every rank holds ceil(V / N) rows, the last ones'
extra rows zero, and the padding's logits are cut off after the gather. Heads and intermediate columns must divide.

Every rank runs every forward with the same inputs: the collectives pair up across ranks in program order.
Which part of each checkpoint tensor a rank reads: tp_checkpoint.py.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from gpu_runtime.model.config import ModelConfig


@dataclass(frozen=True, slots=True)
class TensorParallel:
    """This process's place in a tensor-parallel group, and the collectives the sharded model runs over it.

    `group` is the torch.distributed process group of the N ranks (None: the default group, which
    init_process_group made); `rank` is this process's rank within it. The timeout of every collective is the
    group's, given to init_process_group."""

    rank: int
    world_size: int
    group: dist.ProcessGroup | None = None

    def __post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(f"tensor_parallel_size: rank {self.rank} is not in a group of {self.world_size}")

    @property
    def is_first(self) -> bool:
        """Rank 0: the scheduler's own rank, the one that gets the logits."""
        return self.rank == 0

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sums `tensor` over the ranks, in place; returns it."""
        if self.world_size > 1:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group)
        return tensor

    def vocab_shard(self, vocab_size: int) -> tuple[int, int]:
        """(first id, rows) of this rank's vocabulary shard: ceil(vocab / N) rows each, the last ones padded."""
        rows = -(-vocab_size // self.world_size)
        return self.rank * rows, rows

    def gather_logits(self, logits: torch.Tensor, vocab_size: int) -> torch.Tensor | None:
        """Every rank's [rows, vocab shard] logits, joined on rank 0 as [rows, vocab_size] (the padding cut off);
        None on the other ranks. Every rank must call it, with the same number of rows."""
        if self.world_size == 1:
            return logits[:, :vocab_size]
        logits = logits.contiguous()
        parts = [torch.empty_like(logits) for _ in range(self.world_size)] if self.is_first else None
        first = 0 if self.group is None else dist.get_global_rank(self.group, 0)
        dist.gather(logits, parts, dst=first, group=self.group)
        return torch.cat(parts, dim=-1)[:, :vocab_size] if parts is not None else None


def check_divisible(config: ModelConfig, world_size: int) -> None:
    """Raises ValueError naming both numbers when the model's heads or MLP width do not split over `world_size`
    ranks (each rank must hold whole KV heads: a GQA model with 2 KV heads splits over 1 or 2 ranks, not 4)."""
    if world_size < 1:
        raise ValueError(f"tensor_parallel_size: {world_size} is not a number of ranks (1 or more)")
    sizes = {
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "intermediate_size": config.intermediate_size,
    }
    if config.moe is not None:  # every expert's gate/up columns and down rows are split alike
        sizes["moe_intermediate_size"] = config.moe.intermediate_size
    for name, size in sizes.items():
        if size % world_size:
            raise ValueError(
                f"tensor_parallel_size: {world_size} does not divide {name} {size} "
                f"(each rank holds 1/{world_size} of them); use a tensor_parallel_size that divides {size}"
            )


def shard_config(config: ModelConfig, tp: TensorParallel) -> ModelConfig:
    """A rank's local view of the model: its heads, KV heads and intermediate columns, for its layers, its
    attention backend and its KV pool (KVPool / page_bytes of this config size the rank's pool). vocab_size stays
    the whole vocabulary: the logits rank 0 gets cover all of it."""
    check_divisible(config, tp.world_size)
    n = tp.world_size
    moe = config.moe and dataclasses.replace(config.moe, intermediate_size=config.moe.intermediate_size // n)
    return dataclasses.replace(
        config,
        num_heads=config.num_heads // n,
        num_kv_heads=config.num_kv_heads // n,
        intermediate_size=config.intermediate_size // n,
        moe=moe,
    )


def holds_row_bias(tp: TensorParallel | None) -> bool:
    """Whether this rank holds the bias of a row-parallel projection (o_proj, down_proj): rank 0 alone."""
    return tp is None or tp.is_first


class VocabParallelEmbedding(nn.Embedding):
    """The rows of this rank's vocabulary shard; ids outside it look up zeros, and the ranks' sum is the lookup."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallel):
        self.first_id, rows = tp.vocab_shard(vocab_size)
        # Its weight unfilled, as unfilled_embedding's (the loader fills it): see there for why.
        super().__init__(rows, hidden_size, _weight=torch.empty(rows, hidden_size))
        self.tp = tp

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.first_id
        elsewhere = (local < 0) | (local >= self.num_embeddings)
        x = nn.functional.embedding(local.masked_fill(elsewhere, 0), self.weight)
        x.masked_fill_(elsewhere.unsqueeze(-1), 0.0)
        return self.tp.all_reduce(x)

    def extra_repr(self) -> str:
        return f"first_id={self.first_id}, {super().extra_repr()}"
