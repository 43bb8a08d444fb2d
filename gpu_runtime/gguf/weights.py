"""llama.cpp's tensor names and Q/K row order, mapped back to the transformers layout tokend loads.

llama.cpp's converter renames every tensor (`blk.0.attn_q.weight` for `model.layers.0.self_attn.q_proj.weight`).
For the families ggml rotates its own way (rope type NORM: Llama, Mistral; Architecture.gguf_qk_interleaved) it
also reorders the rows of the query and key projections: transformers' rotary embedding pairs dimension i with
i + head_dim/2 ("rotate half"), ggml's NORM pairs neighbours (2i, 2i+1), so each head's rows were interleaved to
suit ggml. Undoing that interleave makes the weights exactly the checkpoint the GGUF was made from. The NEOX-rope
families (Qwen2, Qwen3) rotate halves as transformers does, and their rows are kept as they are.
"""

from __future__ import annotations

import re

import torch

_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",  # Qwen3's per-head norms
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Tensors that carry no weights of their own: the rotary frequencies are recomputed from the config.
SKIPPED = frozenset({"rope_freqs.weight"})
_LAYER_TENSOR = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")
_GLOBAL_TENSOR = re.compile(r"^(\w+)\.(weight|bias)$")


def transformers_name(gguf_name: str) -> str:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`; ValueError for a tensor Llama has not."""
    if match := _LAYER_TENSOR.match(gguf_name):
        layer, module, kind = match.groups()
        if module in _LAYER_NAMES:
            return f"model.layers.{layer}.{_LAYER_NAMES[module]}.{kind}"
    elif (match := _GLOBAL_TENSOR.match(gguf_name)) and match.group(1) in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[match.group(1)]}.{match.group(2)}"
    raise ValueError(f"model: GGUF tensor {gguf_name!r} has no place in a Llama-family model (an unsupported "
                     "architecture?)")  # fmt: skip


def undo_rotary_permutation(tensor: torch.Tensor, num_heads: int) -> torch.Tensor:
    """The inverse of llama.cpp's `permute` of a query or key projection (weight or bias) with `num_heads` heads:
    within each head, rows (2i, 2i+1) go back to (i, i + head_dim/2)."""
    rows = tensor.shape[0]
    split = tensor.reshape(num_heads, rows // num_heads // 2, 2, *tensor.shape[1:])
    return split.transpose(1, 2).reshape(tensor.shape).contiguous()


def to_transformers_layout(
    gguf_name: str, tensor: torch.Tensor, num_heads: int, num_kv_heads: int, qk_interleaved: bool = True
) -> torch.Tensor:
    """The tensor as the transformers checkpoint holds it (Q and K rows back in rotate-half order, where the
    converter interleaved them)."""
    if not qk_interleaved:
        return tensor
    if re.match(r"^blk\.\d+\.attn_q\.", gguf_name):
        return undo_rotary_permutation(tensor, num_heads)
    if re.match(r"^blk\.\d+\.attn_k\.", gguf_name):
        return undo_rotary_permutation(tensor, num_kv_heads)
    return tensor
