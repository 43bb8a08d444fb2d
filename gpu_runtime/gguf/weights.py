"""llama.cpp's tensor names, values and Q/K row order, mapped back to the transformers checkpoint tokend loads.

llama.cpp's converter renames every tensor (`blk.0.attn_q.weight` for `model.layers.0.self_attn.q_proj.weight`;
each architecture's names are in its GGUFFormat). For the families ggml rotates its own way (rope type NORM: Llama,
Mistral, Mixtral; GGUFFormat.qk_interleaved) it also reorders the rows of the query and key projections:
transformers' rotary embedding pairs dimension i with i + head_dim/2 ("rotate half"), ggml's NORM pairs neighbours
(2i, 2i+1), so each head's rows were interleaved to suit ggml. Gemma's norms were stored plus one
(GGUFFormat.norm_offset), and Mixture-of-Experts layers' experts merged into one [experts, rows, columns] tensor per
projection. Undoing each makes the weights the checkpoint the GGUF was made from.
"""

from __future__ import annotations

import re

import torch

from gpu_runtime.model.gguf_format import GLOBAL_NAMES, GGUFFormat

# Tensors that carry no weights of their own, only rotary settings (Llama 3.1's frequency factors, Phi-3's longrope
# factors): they become config.json's rope_scaling, and the frequencies are recomputed from it.
ROPE_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")
SKIPPED = frozenset(ROPE_TENSORS)
_LAYER_TENSOR = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")
_GLOBAL_TENSOR = re.compile(r"^(\w+)\.(weight|bias)$")


class CheckpointNames:
    """The checkpoint tensors each GGUF tensor of one file becomes: one, or one per expert for a merged expert
    tensor."""

    def __init__(self, gguf_format: GGUFFormat, architecture: str, num_experts: int = 0):
        self._format = gguf_format
        self._architecture = architecture
        self._num_experts = num_experts

    def of(self, gguf_name: str) -> list[str]:
        """`blk.3.attn_q.weight` -> [`model.layers.3.self_attn.q_proj.weight`]; ValueError naming a tensor this
        architecture has no place for."""
        if match := _LAYER_TENSOR.match(gguf_name):
            layer, gguf_module, kind = match.groups()
            module = self._format.layer_module(gguf_module)
            if module is not None and "*" in module:
                experts = range(self._num_experts)
                return [f"model.layers.{layer}.{module.replace('*', str(e))}.{kind}" for e in experts]
            if module is not None:
                return [f"model.layers.{layer}.{module}.{kind}"]
        elif (match := _GLOBAL_TENSOR.match(gguf_name)) and match.group(1) in GLOBAL_NAMES:
            return [f"{GLOBAL_NAMES[match.group(1)]}.{match.group(2)}"]
        raise ValueError(f"model: GGUF tensor {gguf_name!r} has no place in a {self._architecture!r} model (an "
                         "unsupported variant of the architecture?)")  # fmt: skip

    def pieces(self, gguf_name: str, tensor: torch.Tensor, heads: tuple[int, int]) -> list[tuple[str, torch.Tensor]]:
        """The tensor as the checkpoint held it, under its checkpoint name(s): `heads` is (attention heads, KV heads),
        for the Q/K rows."""
        names = self.of(gguf_name)
        if len(names) > 1:  # merged experts: [experts, rows, columns], expert e's matrix first-dimension e
            if tensor.shape[0] != len(names):
                raise ValueError(f"model: GGUF tensor {gguf_name!r} holds {tensor.shape[0]} experts, the file's "
                                 f"expert_count says {len(names)}")  # fmt: skip
            return [(name, tensor[e].contiguous()) for e, name in enumerate(names)]
        (name,) = names
        if self._format.norm_offset and name.endswith("norm.weight") and tensor.is_floating_point():
            tensor = tensor - self._format.norm_offset
        if self._format.qk_interleaved:
            tensor = _rotate_half_order(gguf_name, tensor, *heads)
        return [(name, tensor)]


def undo_rotary_permutation(tensor: torch.Tensor, num_heads: int) -> torch.Tensor:
    """The inverse of llama.cpp's `permute` of a query or key projection (weight or bias) with `num_heads` heads:
    within each head, rows (2i, 2i+1) go back to (i, i + head_dim/2)."""
    rows = tensor.shape[0]
    split = tensor.reshape(num_heads, rows // num_heads // 2, 2, *tensor.shape[1:])
    return split.transpose(1, 2).reshape(tensor.shape).contiguous()


def _rotate_half_order(gguf_name: str, tensor: torch.Tensor, num_heads: int, num_kv_heads: int) -> torch.Tensor:
    if re.match(r"^blk\.\d+\.attn_q\.", gguf_name):
        return undo_rotary_permutation(tensor, num_heads)
    if re.match(r"^blk\.\d+\.attn_k\.", gguf_name):
        return undo_rotary_permutation(tensor, num_kv_heads)
    return tensor
