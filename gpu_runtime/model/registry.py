"""The model registry: tokend's architectures by name, each one entry holding its model class, how its checkpoint's
tensor names map onto the model's parameters, its tensor-parallel split table and its GGUF names.

An architecture is one module under architectures/ that defines ARCHITECTURE, plus its line in _MODULES below
(docs/adding-a-model.md). The modules are imported at the first lookup, not here: config.py asks the registry which
entry a config.json names, and the entries import their model classes, which import config.py.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

    from gpu_runtime.attention.backend import AttentionBackend
    from gpu_runtime.attention.metadata import AttentionMetadata
    from gpu_runtime.model.config import ModelConfig
    from gpu_runtime.model.gguf_format import GGUFFormat
    from gpu_runtime.model.tp_checkpoint import TensorSplit

_MODULES = (
    "gpu_runtime.model.architectures.llama",
    "gpu_runtime.model.architectures.mistral",
    "gpu_runtime.model.architectures.qwen2",
    "gpu_runtime.model.architectures.qwen3",
    "gpu_runtime.model.architectures.mixtral",
    "gpu_runtime.model.architectures.qwen3_moe",
    "gpu_runtime.model.architectures.gemma2",
    "gpu_runtime.model.architectures.gemma3",
    "gpu_runtime.model.architectures.phi3",
)

_LAYER_TENSOR = re.compile(r"^model\.layers\.(\d+)\.(.+)\.([^.]+)$")
# A per-expert checkpoint module: "mlp.experts.3.gate_proj" is expert 3's piece of "mlp.experts.*.gate_proj".
_EXPERT_MODULE = re.compile(r"^(.+\.experts)\.(\d+)\.([^.]+)$")


class CausalLM(Protocol):
    """What the engine asks of a model class (an nn.Module), built as `model_class(config, backend, dtype, tp)`."""

    config: ModelConfig  # the model's shape; under tensor parallelism the rank's view (its heads only)
    attention_backend: AttentionBackend  # planned once per step by the runner, before the forward
    norm: torch.nn.Module  # the final norm: its output is transformers' last_hidden_state, which embeddings pool

    def __call__(self, input_ids, positions, kv_pages, meta: AttentionMetadata) -> torch.Tensor: ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None: ...

    def tie_weights(self) -> None:
        """Shares lm_head with the embeddings where config.tie_word_embeddings says so (the loader calls it after
        materialising the model, which unties them)."""


@dataclass(frozen=True, slots=True)
class FusedParameter:
    """One parameter that several checkpoint tensors fill, stacked along its rows (q, k, v into qkv_proj)."""

    name: str  # its module within a layer: "self_attn.qkv_proj"
    pieces: tuple[str, ...]  # the checkpoint modules stacked into it, in row order
    rows: Callable[[ModelConfig], tuple[int, ...]]  # each piece's rows, for a config (a rank's view under TP)


@dataclass(frozen=True, slots=True)
class ExpertParameter:
    """One [num_experts, rows, columns] parameter that every expert's checkpoint tensors fill: expert e's pieces
    stacked along the rows of [e] (each expert's gate and up into gate_up_proj), so that the MoE block runs one
    matmul per expert over the tokens routed to it. Checkpoints store each expert's matrices apart; they are stacked
    as they are loaded."""

    name: str  # the parameter within a layer: "mlp.experts.gate_up_proj"
    pieces: tuple[str, ...]  # the per-expert checkpoint modules, "*" for the expert's number, in row order
    rows: Callable[[ModelConfig], tuple[int, ...]]  # each piece's rows, for a config (a rank's view under TP)


def expert_module(module: str) -> tuple[str, int] | None:
    """("mlp.experts.*.gate_proj", 3) for a per-expert module "mlp.experts.3.gate_proj"; None for the others."""
    match = _EXPERT_MODULE.match(module)
    return (f"{match.group(1)}.*.{match.group(3)}", int(match.group(2))) if match else None


def split_table_key(module: str) -> str:
    """The key a checkpoint module has in a split table: itself, or for an expert's, its name with "*" for the
    expert (every expert splits alike)."""
    expert = expert_module(module)
    return module if expert is None else expert[0]


@dataclass(frozen=True, slots=True)
class Architecture:
    """One architecture tokend serves. Tensor names are a checkpoint's (transformers'): `model.layers.N.` dropped
    from a layer's, the rest whole ("model.embed_tokens", "lm_head"), always without `.weight`/`.bias`."""

    name: str  # ModelConfig.architecture, and config.json's model_type
    hf_classes: tuple[str, ...]  # the config.json "architectures" names it serves, the canonical one first
    model_class: Callable[..., CausalLM]
    fused: tuple[FusedParameter, ...]  # checkpoint tensors stacked into one parameter; the others map by name
    # Every checkpoint module and how tensor parallelism splits it (replicated ones too: a module missing here is
    # an error under tensor parallelism, never quietly replicated).
    tp_splits: Mapping[str, TensorSplit]
    # The fields this architecture reads its own way from config.json, over the ones read alike for all of them.
    adapt_config: Callable[[dict[str, Any], ModelConfig], ModelConfig] = lambda raw, config: config
    gguf: GGUFFormat | None = None  # how llama.cpp's converter writes it, if tokend reads its GGUF files
    activations: tuple[str, ...] = ("silu",)  # the MLP activations (ModelConfig.hidden_act) its model class runs
    rope_types: tuple[str, ...] = ("default", "linear", "llama3")  # the RopeConfig.rope_type values it runs
    experts: tuple[ExpertParameter, ...] = ()  # per-expert checkpoint tensors stacked into one parameter each

    def fused_piece(self, module: str) -> tuple[FusedParameter, int] | None:
        """The fused parameter a checkpoint module goes into, and which piece of it; None if it maps by name."""
        for fused in self.fused:
            if module in fused.pieces:
                return fused, fused.pieces.index(module)
        return None

    def fused_parameter(self, module: str) -> FusedParameter | None:
        return next((fused for fused in self.fused if fused.name == module), None)

    def expert_piece(self, module: str) -> tuple[ExpertParameter, int, int] | None:
        """The stacked expert parameter a per-expert checkpoint module goes into, its expert and its piece."""
        expert = expert_module(module)
        if expert is None:
            return None
        for stacked in self.experts:
            if expert[0] in stacked.pieces:
                return stacked, expert[1], stacked.pieces.index(expert[0])
        return None

    def expert_parameter(self, name: str) -> ExpertParameter | None:
        return next((stacked for stacked in self.experts if stacked.name == name), None)


def split_tensor_name(name: str) -> tuple[int | None, str, str]:
    """(layer, module, kind) of a checkpoint tensor: "model.layers.3.mlp.up_proj.weight" is (3, "mlp.up_proj",
    "weight"); "lm_head.weight" is (None, "lm_head", "weight")."""
    match = _LAYER_TENSOR.match(name)
    if match is not None:
        return int(match.group(1)), match.group(2), match.group(3)
    module, _, kind = name.rpartition(".")
    return None, module, kind


_registry: dict[str, Architecture] = {}
_loaded = False


def _entries() -> dict[str, Architecture]:
    global _loaded
    if not _loaded:
        for module in _MODULES:
            _add(importlib.import_module(module).ARCHITECTURE)
        _loaded = True
    return _registry


def _add(entry: Architecture) -> None:
    taken = {cls for other in _registry.values() for cls in other.hf_classes}
    if entry.name in _registry or taken.intersection(entry.hf_classes):
        raise ValueError(f"model registry: {entry.name!r} ({', '.join(entry.hf_classes)}) is registered already")
    _registry[entry.name] = entry


def register(entry: Architecture) -> Architecture:
    """Adds an architecture beside the built-in ones (a test's, a plugin's); ValueError if its name or one of its
    config.json classes is taken."""
    _entries()
    _add(entry)
    return entry


def unregister(name: str) -> None:
    _entries().pop(name, None)


def architectures() -> tuple[Architecture, ...]:
    return tuple(_entries().values())


def architecture(name: str) -> Architecture:
    """The entry of ModelConfig.architecture `name`; ValueError naming it if none is registered."""
    entry = _entries().get(name)
    if entry is None:
        raise ValueError(f"model: architecture {name!r} is not supported; tokend serves {sorted(_entries())}")
    return entry


def architecture_of(hf_classes: list[str], model_type: str | None) -> Architecture | None:
    """The entry a config.json names: the first of its "architectures" registered, else its model_type's."""
    entries = _entries()
    for cls in hf_classes:
        for entry in entries.values():
            if cls in entry.hf_classes:
                return entry
    return entries.get(model_type) if isinstance(model_type, str) else None


def hf_class_names() -> list[str]:
    """Every config.json class tokend serves, sorted (for the message that refuses the others)."""
    return sorted(cls for entry in _entries().values() for cls in entry.hf_classes)


def gguf_architecture(gguf_name: str, experts: bool = False) -> Architecture | None:
    """The entry that reads a GGUF file of this general.architecture, with merged expert tensors or without."""
    return next(
        (
            entry
            for entry in _entries().values()
            if entry.gguf is not None and gguf_name in entry.gguf.names and entry.gguf.experts == experts
        ),
        None,
    )


def gguf_names() -> list[str]:
    return sorted({name for entry in _entries().values() if entry.gguf is not None for name in entry.gguf.names})
