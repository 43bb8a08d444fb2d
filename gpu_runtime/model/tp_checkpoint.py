"""Which part of each checkpoint tensor a tensor-parallel rank reads, read alone from the safetensors file.

safetensors' `get_slice` reads the rows (or columns) asked for and nothing else, so no rank ever holds a whole
weight matrix: a rank's load peaks at its shard of the model plus one shard of one tensor. The split is
tensor_parallel.py's: column-parallel projections by rows, row-parallel ones by columns (their bias whole, on rank
0 alone), the embedding and lm_head by vocabulary rows (padded with zero rows to ceil(V / N)), norms whole.
"""

from __future__ import annotations

import torch

from gpu_runtime.model.config import ModelConfig
from gpu_runtime.model.tensor_parallel import TensorParallel, holds_row_bias

_VOCAB_PARALLEL = ("model.embed_tokens.weight", "lm_head.weight")


class CheckpointShards:
    """Reads this rank's part of each checkpoint tensor (the whole model's config, the rank's place)."""

    def __init__(self, config: ModelConfig, tp: TensorParallel):
        q_rows = config.num_heads * config.head_dim
        kv_rows = config.num_kv_heads * config.head_dim
        width = config.intermediate_size
        # checkpoint module -> (dimension split over the ranks, its length in the whole tensor)
        self.splits = {
            "self_attn.q_proj": (0, q_rows),
            "self_attn.k_proj": (0, kv_rows),
            "self_attn.v_proj": (0, kv_rows),
            "mlp.gate_proj": (0, width),
            "mlp.up_proj": (0, width),
            "self_attn.o_proj": (1, q_rows),
            "mlp.down_proj": (1, width),
        }
        self.config = config
        self.tp = tp

    def read(self, name: str, part) -> torch.Tensor | None:
        """This rank's part of the tensor `name` (`part`: safe_open's get_slice of it), or None where the rank
        holds none of it. Raises ValueError naming the tensor when its length along the split does not match the
        config (the loader checks the other dimensions against the rank's parameter)."""
        shape = tuple(part.get_shape())
        if name == "lm_head.weight" and self.config.tie_word_embeddings:
            return None  # the loader ignores it: lm_head is the embedding
        if name in _VOCAB_PARALLEL:
            return self._vocab_rows(name, part, shape)
        module, _, kind = name.rpartition(".")
        split = self.splits.get(".".join(module.split(".")[-2:]))
        if split is None:
            return part[:]  # replicated on every rank: the norms
        dim, length = split
        if dim == 1 and kind == "bias":  # a row-parallel bias: added once, by rank 0
            return part[:] if holds_row_bias(self.tp) else None
        if len(shape) <= dim or shape[dim] != length:
            raise ValueError(f"model: {name!r} has shape {shape}, expected {length} along dimension {dim}")
        size = length // self.tp.world_size
        start = self.tp.rank * size
        return part[start : start + size] if dim == 0 else part[:, start : start + size]

    def _vocab_rows(self, name: str, part, shape: tuple[int, ...]) -> torch.Tensor:
        vocab = self.config.vocab_size
        if not shape or shape[0] != vocab:
            raise ValueError(f"model: {name!r} has shape {shape}, expected {vocab} rows (vocab_size)")
        first, rows = self.tp.vocab_shard(vocab)
        real = max(0, min(rows, vocab - first))
        if real == rows:
            return part[first : first + rows]
        # The last ranks' shards run past the vocabulary: zero rows, whose logits are cut off after the gather.
        shard = torch.zeros((rows, *shape[1:]), dtype=_dtype_of(part))
        if real:
            shard[:real] = part[first : first + real]
        return shard


def _dtype_of(part) -> torch.dtype:
    """The torch dtype of a get_slice handle (an empty slice's: get_dtype names it by safetensors' own string)."""
    return part[0:0].dtype
