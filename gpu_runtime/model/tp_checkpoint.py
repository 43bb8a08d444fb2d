"""Which part of each checkpoint tensor a tensor-parallel rank reads, read alone from the safetensors file.

safetensors' `get_slice` reads the rows (or columns) asked for and nothing else, so no rank ever holds a whole
weight matrix: a rank's load peaks at its shard of the model plus one shard of one tensor. The split is
tensor_parallel.py's: column-parallel projections by rows, row-parallel ones by columns (their bias whole, on rank
0 alone), the embedding and lm_head by vocabulary rows (padded with zero rows to ceil(V / N)), norms whole.

Each architecture lists every one of its checkpoint modules in its split table (the model registry's tp_splits),
the replicated ones too, and an expert's once for all experts ("mlp.experts.*.gate_proj"): a tensor the table does
not name is an error naming it, never replicated by default (an expert's weights quietly copied to every rank would
be wrong and waste memory).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from gpu_runtime.model.config import ModelConfig
from gpu_runtime.model.registry import split_table_key, split_tensor_name
from gpu_runtime.model.tensor_parallel import TensorParallel, holds_row_bias


class SplitKind(enum.Enum):
    COLUMN = "column"  # dimension 0 (output features) split: each rank its own heads or intermediate columns
    ROW = "row"  # dimension 1 (input features) split; the bias whole, on rank 0 alone
    VOCAB = "vocab"  # rows split by vocabulary id, padded to ceil(V / N) rows per rank
    REPLICATED = "replicated"  # whole on every rank: the norms
    NOT_LOADED = "not_loaded"  # in some checkpoints but no weight (rotary inv_freq: recomputed from config.json)


@dataclass(frozen=True, slots=True)
class TensorSplit:
    kind: SplitKind
    length: Callable[[ModelConfig], int] | None = None  # COLUMN and ROW: the split dimension's whole length
    # COLUMN of a tensor the checkpoint stores fused (Phi-3's qkv_proj): its pieces' rows, each split on its own.
    pieces: Callable[[ModelConfig], tuple[int, ...]] | None = None


def column_parallel(length: Callable[[ModelConfig], int]) -> TensorSplit:
    return TensorSplit(SplitKind.COLUMN, length)


def fused_column_parallel(pieces: Callable[[ModelConfig], tuple[int, ...]]) -> TensorSplit:
    """A checkpoint tensor that stacks several column-parallel projections (q, k and v): each rank reads its share
    of every piece, stacked in the same order, as the rank's fused parameter holds them."""
    return TensorSplit(SplitKind.COLUMN, lambda config: sum(pieces(config)), pieces)


def row_parallel(length: Callable[[ModelConfig], int]) -> TensorSplit:
    return TensorSplit(SplitKind.ROW, length)


VOCAB_PARALLEL = TensorSplit(SplitKind.VOCAB)
REPLICATED = TensorSplit(SplitKind.REPLICATED)
NOT_LOADED = TensorSplit(SplitKind.NOT_LOADED)


class CheckpointShards:
    """Reads this rank's part of each checkpoint tensor (the whole model's config, the rank's place, and the
    architecture's split table)."""

    def __init__(self, config: ModelConfig, tp: TensorParallel, splits: Mapping[str, TensorSplit]):
        self.config = config
        self.tp = tp
        self.splits = splits

    def read(self, name: str, part) -> torch.Tensor | None:
        """This rank's part of the tensor `name` (`part`: safe_open's get_slice of it), or None where the rank
        holds none of it. Raises ValueError naming the tensor when the split table has no entry for it, or when
        its length along the split does not match the config (the loader checks the other dimensions against the
        rank's parameter)."""
        shape = tuple(part.get_shape())
        _, module, kind = split_tensor_name(name)
        split = self.splits.get(split_table_key(module))
        if split is None:
            raise ValueError(
                f"model: checkpoint tensor {name!r} is not in {self.config.architecture}'s tensor-parallel split "
                f"table (its module {module!r}): tokend cannot tell how to split it over {self.tp.world_size} ranks"
            )
        if split.kind is SplitKind.NOT_LOADED:
            return None
        if name == "lm_head.weight" and self.config.tie_word_embeddings:
            return None  # the loader ignores it: lm_head is the embedding
        if split.kind is SplitKind.REPLICATED:
            return part[:]
        if split.kind is SplitKind.VOCAB:
            return self._vocab_rows(name, part, shape)
        dim, length = (0 if split.kind is SplitKind.COLUMN else 1), split.length(self.config)
        if dim == 1 and kind == "bias":  # a row-parallel bias: added once, by rank 0
            return part[:] if holds_row_bias(self.tp) else None
        if len(shape) <= dim or shape[dim] != length:
            raise ValueError(f"model: {name!r} has shape {shape}, expected {length} along dimension {dim}")
        if split.pieces is not None:
            return self._piece_rows(part, split.pieces(self.config))
        size = length // self.tp.world_size
        start = self.tp.rank * size
        return part[start : start + size] if dim == 0 else part[:, start : start + size]

    def _piece_rows(self, part, pieces: tuple[int, ...]) -> torch.Tensor:
        rows, offset = [], 0
        for piece in pieces:
            size = piece // self.tp.world_size
            start = offset + self.tp.rank * size
            rows.append(part[start : start + size])
            offset += piece
        return torch.cat(rows)

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
