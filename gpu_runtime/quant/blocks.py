"""Which GGUF tensors are kept in their quantized blocks, and the record of them a converted directory holds.

A kept tensor is a uint8 [rows, bytes per row] tensor in the safetensors files, under its transformers name; the
file QUANTIZED_WEIGHTS_FILE maps each such name to its ggml type. Only matrices a matmul reads (the linear layers,
lm_head) or an embedding gathers rows of are kept; norms and the plain float types stay float.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

# The gguf package is imported where a GGUF's blocks are met, not here: every scheduler's loader imports this
# module, and gguf (with the mistral-common it then loads, where installed) takes up to half a second.
if TYPE_CHECKING:
    from gguf import GGMLQuantizationType, ReaderTensor

QUANTIZED_WEIGHTS_FILE = "quantized_weights.json"
# The block types the CPU kernel (csrc/quant_matmul_cpu.cpp) multiplies in place, by ggml's names.
SERVED_TYPE_NAMES = frozenset({"Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K"})


@dataclass(frozen=True, slots=True)
class BlockFormat:
    """One ggml block type: how many values a block holds and in how many bytes."""

    type: GGMLQuantizationType
    block_values: int
    block_bytes: int

    @classmethod
    def of(cls, type_name: str) -> BlockFormat:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        tensor_type = GGMLQuantizationType[type_name]
        values, size = GGML_QUANT_SIZES[tensor_type]
        return cls(tensor_type, values, size)

    def row_bytes(self, in_features: int) -> int:
        return in_features // self.block_values * self.block_bytes


def is_matrix_weight(name: str) -> bool:
    """A transformers tensor name a matmul or an embedding lookup reads: a layer's *_proj, lm_head, the embedding."""
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return True
    return name.startswith("model.layers.") and name.endswith("_proj.weight")


def keeps_blocks(name: str, tensor: ReaderTensor) -> bool:
    """Whether the conversion keeps this tensor (transformers name `name`) in its GGUF blocks."""
    from gguf import GGMLQuantizationType

    served = GGMLQuantizationType(tensor.tensor_type).name in SERVED_TYPE_NAMES
    return served and len(tensor.shape) == 2 and is_matrix_weight(name)


def read_quantized_weights(model_dir: Path) -> dict[str, BlockFormat]:
    """Each kept tensor's name and block format; empty for a checkpoint with none (every float checkpoint)."""
    path = Path(model_dir) / QUANTIZED_WEIGHTS_FILE
    if not path.is_file():
        return {}
    return {name: BlockFormat.of(type_name) for name, type_name in json.loads(path.read_text())["tensors"].items()}
