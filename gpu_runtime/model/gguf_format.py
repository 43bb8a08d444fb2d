"""How llama.cpp's converter writes an architecture into a GGUF file, so that gpu_runtime/gguf can read it back as
the transformers checkpoint it was made from: the `general.architecture` names, the tensor names, what the converter
changed in the values, and the config.json keys its metadata holds. Each registry entry that reads GGUFs has one
(Architecture.gguf); this module is data only (no torch, no gguf package), as the architecture modules that import
it must stay light.

Tensor names are llama.cpp's (gguf-py's tensor_mapping): a layer's `blk.N.attn_q` is `model.layers.N.` plus the
module named here. Merged expert tensors (`ffn_gate_exps`, [experts, rows, columns]) map to a per-expert module
with "*" for the expert, which the conversion splits into one tensor per expert, as the checkpoint stored them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

# hparam("block_count") reads `<architecture>.block_count`; the second argument is the default.
Hparam = Callable[[str, Any], Any]

# The layer tensors of a Llama-shaped decoder, as every family here names them unless its format says otherwise.
LLAMA_LAYER_NAMES = MappingProxyType(
    {
        "attn_norm": "input_layernorm",
        "ffn_norm": "post_attention_layernorm",
        "attn_q": "self_attn.q_proj",
        "attn_k": "self_attn.k_proj",
        "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj",
        "attn_q_norm": "self_attn.q_norm",  # Qwen3's and Gemma 3's per-head norms
        "attn_k_norm": "self_attn.k_norm",
        "ffn_gate": "mlp.gate_proj",
        "ffn_up": "mlp.up_proj",
        "ffn_down": "mlp.down_proj",
    }
)
GLOBAL_NAMES = MappingProxyType({"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"})


def keep_config(hparam: Hparam, config: dict[str, Any]) -> dict[str, Any]:
    return config


@dataclass(frozen=True, slots=True)
class GGUFFormat:
    names: tuple[str, ...]  # the general.architecture values read as this architecture
    # Whether the converter interleaved each head's Q and K rows for ggml's NORM rotary (Llama, Mistral); the
    # NEOX-rope families (Qwen, Gemma) keep transformers' order.
    qk_interleaved: bool = False
    # Whether the file holds merged expert tensors: Mixtral is written as "llama" with llama.expert_count set, and
    # is told from a dense Llama by this.
    experts: bool = False
    # Layer tensors named otherwise than LLAMA_LAYER_NAMES (or absent from it), over that table.
    layer_names: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    # Whether the file may rotate fewer dimensions than a head has (rope.dimension_count: Phi-4-mini's 96 of 128).
    partial_rotary: bool = False
    # What the converter added to every norm weight (Gemma stores 1 + w, the factor its RMSNorm multiplies by).
    norm_offset: float = 0.0
    # The config.json keys this family reads from its own metadata, over the ones every family has.
    config: Callable[[Hparam, dict[str, Any]], dict[str, Any]] = keep_config

    def layer_module(self, gguf_module: str) -> str | None:
        """The checkpoint module of a layer tensor (`attn_q` -> `self_attn.q_proj`); None if this family has none."""
        return self.layer_names.get(gguf_module, LLAMA_LAYER_NAMES.get(gguf_module))
