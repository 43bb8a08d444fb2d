"""Builds the model class its architecture's registry entry names and fills it from a checkpoint's *.safetensors
files (sharded or not), by the entry's weight-name map; under tensor parallelism a rank's shard of it, reading only
that shard of each tensor (tp_checkpoint.py, by the entry's split table)."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from gpu_runtime.attention.backend import AttentionBackend
from gpu_runtime.model import registry
from gpu_runtime.model.config import ModelConfig
from gpu_runtime.model.load_progress import LoadProgress
from gpu_runtime.model.registry import Architecture, CausalLM, split_table_key, split_tensor_name
from gpu_runtime.model.rope import RotaryEmbedding
from gpu_runtime.model.tensor_parallel import TensorParallel
from gpu_runtime.model.tp_checkpoint import CheckpointShards, SplitKind
from gpu_runtime.quant.plan import can_serve_blocks, plan_quantized, swap_modules


def safetensors_files(model_dir: Path) -> list[Path]:
    """The checkpoint's weight files: those its index names, else every *.safetensors file."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ValueError(f"model: {model_dir} lacks the shards {missing} that its index lists")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model: {model_dir} has no *.safetensors weights")
    return files


def checkpoint_name(stored: str) -> str:
    """A tensor's name as a causal LM's checkpoint has it: a base model's ("layers.0.mlp.up_proj.weight", as
    sentence-transformers saves an embedding model) gains the "model." its causal LM would have."""
    if stored.startswith(("model.", "lm_head.")):
        return stored
    return f"model.{stored}"


def iterate_checkpoint(model_dir: Path, shards: CheckpointShards | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Each checkpoint tensor by name, whole; or with `shards`, only a rank's part of it (tensors the rank holds
    none of are skipped). Progress counts the checkpoint's bytes passed over, a shard's whole tensor included."""
    files = safetensors_files(model_dir)
    with LoadProgress(model_dir, files) as progress:
        for path in files:
            try:
                with safe_open(str(path), framework="pt") as f:
                    for stored in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                        name = checkpoint_name(stored)
                        if shards is None:
                            tensor = f.get_tensor(stored)
                            numel = tensor.numel()
                        else:
                            part = f.get_slice(stored)
                            tensor, numel = shards.read(name, part), math.prod(part.get_shape())
                            if tensor is None:
                                continue
                        yield name, tensor
                        progress.advance(numel * tensor.element_size())
            except SafetensorError as error:  # a damaged file: the same at every retry, so a config error
                raise ValueError(f"model: {path} is not a readable safetensors file ({error})") from None


def load_model(
    model_dir: str | Path,
    config: ModelConfig,
    backend: AttentionBackend,
    dtype: torch.dtype,
    device: torch.device,
    load_format: str = "auto",
    tp: TensorParallel | None = None,
) -> CausalLM:
    """Returns the model in eval mode on `device`, every parameter filled from the checkpoint (or, with
    load_format "dummy", drawn at random on the device: a model's shape without its weights, for benchmarks).
    With `tp`, this rank's shard of the model (`config` the whole model's), only that shard read from the files.

    The model is built on the meta device and materialised once, in `dtype` on `device`: no randomly
    initialised (or float32) copy is ever made, so loading peaks at about the weights' size (plus one
    checkpoint tensor while it is converted).
    """
    entry = registry.architecture(config.architecture)
    # A GGUF converted with its blocks kept (quantization "auto"): the modules that can serve them are swapped for
    # quantized ones; the other kept tensors are dequantized as they are read.
    quantized = plan_quantized(Path(model_dir), tp is not None) if load_format != "dummy" else None
    serves_blocks = quantized is not None and bool(quantized.stored) and can_serve_blocks(device, dtype)
    with torch.device("meta"):
        model = entry.model_class(config, backend, dtype, tp).to(dtype)
        if serves_blocks:
            swap_modules(model, entry, quantized, config.tie_word_embeddings)
    _allocate_on(model, device)
    _finish_materialising(model)
    if load_format == "dummy":
        return _fill_at_random(model).eval()
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    shards = None if tp is None else CheckpointShards(config, tp, entry.tp_splits)
    for name, tensor in iterate_checkpoint(Path(model_dir), shards):
        if quantized is not None:
            tensor = quantized.as_loaded(name, tensor)
        target = _copy_into(entry, model, params, name, tensor)
        if target is not None:
            loaded.add(target)
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # the copies were queued without waiting; the model is whole only now
    if not config.generates and "lm_head.weight" not in loaded:
        params["lm_head.weight"].data.zero_()  # a base model has no head: it embeds only (never sampled from)
    missing = _expected_pieces(entry, params, model.config) - loaded
    if missing:
        raise ValueError(f"model: checkpoint {model_dir} lacks weights for {sorted(missing)[:5]}")
    return model.eval()


def _allocate_on(model: nn.Module, device: torch.device) -> None:
    """model.to_empty(device=device), each meta tensor replaced by uninitialised memory of its shape and dtype,
    without to_empty's torch.empty_like: on a meta tensor that runs torch's Python reference of it, whose first
    call imports sympy, a third of a second of every scheduler's start."""
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            empty = torch.empty(param.shape, dtype=param.dtype, device=device)
            module._parameters[name] = nn.Parameter(empty, requires_grad=param.requires_grad)
        for name, buffer in module.named_buffers(recurse=False):
            module._buffers[name] = torch.empty(buffer.shape, dtype=buffer.dtype, device=device)


def _finish_materialising(model: CausalLM) -> None:
    """What _allocate_on leaves undone: it gives each module its own tensor, untying lm_head from the embeddings,
    and the rotary tables (not in any checkpoint) are only empty memory."""
    model.tie_weights()
    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            module.compute_tables()


@torch.no_grad()
def _fill_at_random(model: CausalLM) -> CausalLM:
    """Weights as a freshly initialised Llama's (normal, std 0.02; norms the identity: 1, or 0 for a norm that
    scales by 1 + w, Gemma's), drawn where they lie."""
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.fill_(getattr(model.get_submodule(name.removesuffix(".weight")), "identity_weight", 1.0))
        else:
            param.normal_(0.0, 0.02)
    return model


def _expected_pieces(entry: Architecture, params: dict, config: ModelConfig) -> set[str]:
    """Every piece the checkpoint must supply: a parameter's name, or `name[piece]` for fused ones."""
    pieces = set()
    for name in params:
        if name == "lm_head.weight" and (config.tie_word_embeddings or not config.generates):
            continue
        layer, module, kind = split_tensor_name(f"model.{name}")  # a parameter's name is its tensor's, less "model."
        fused = entry.fused_parameter(module) if layer is not None else None
        stacked = entry.expert_parameter(f"{module}.{kind}") if layer is not None else None
        if stacked is not None:  # every expert's every piece
            experts = params[name].shape[0]
            pieces.update(f"{name}[{e}][{piece}]" for e in range(experts) for piece in range(len(stacked.pieces)))
        else:
            pieces.update([f"{name}[{piece}]" for piece in range(len(fused.pieces))] if fused else [name])
    return pieces


def _copy_into(entry: Architecture, model: CausalLM, params: dict, name: str, tensor: torch.Tensor) -> str | None:
    """Copies one checkpoint tensor into its (possibly fused) parameter; returns the piece it filled."""
    layer, module, kind = split_tensor_name(name)
    split = entry.tp_splits.get(split_table_key(module))
    if split is not None and split.kind is SplitKind.NOT_LOADED:
        return None  # recomputed from config.json
    if name == "lm_head.weight" and model.config.tie_word_embeddings:
        return None
    if layer is None:
        target = name.removeprefix("model.")
        _checked_copy(params, target, tensor, name)
        return target
    expert_piece = entry.expert_piece(module)
    if expert_piece is not None:
        return _copy_expert(params, model.config, layer, expert_piece, name, tensor)
    fused_piece = entry.fused_piece(module)
    if fused_piece is None:
        target = f"layers.{layer}.{module}.{kind}"
        _checked_copy(params, target, tensor, name)
        return target
    fused, piece = fused_piece
    target = f"layers.{layer}.{fused.name}.{kind}"
    if target not in params:
        raise ValueError(f"model: unexpected checkpoint tensor {name!r}")
    rows = fused.rows(model.config)
    offset = sum(rows[:piece])
    expected = (rows[piece], *params[target].shape[1:])
    if tuple(tensor.shape) != expected:
        raise ValueError(f"model: {name!r} has shape {tuple(tensor.shape)}, expected {expected}")
    _copy(params[target].data[offset : offset + tensor.shape[0]], tensor)
    return f"{target}[{piece}]"


def _copy_expert(params: dict, config: ModelConfig, layer: int, expert_piece, name: str, tensor) -> str:
    """Copies one expert's checkpoint tensor into its rows of [expert] of the stacked parameter."""
    stacked, expert, piece = expert_piece
    target = f"layers.{layer}.{stacked.name}"
    if target not in params or not name.endswith(".weight"):
        raise ValueError(f"model: unexpected checkpoint tensor {name!r}")
    param = params[target]
    if expert >= param.shape[0]:
        raise ValueError(f"model: {name!r} is expert {expert}, but the model has {param.shape[0]} experts")
    rows = stacked.rows(config)
    offset = sum(rows[:piece])
    expected = (rows[piece], *param.shape[2:])
    if tuple(tensor.shape) != expected:
        raise ValueError(f"model: {name!r} has shape {tuple(tensor.shape)}, expected {expected}")
    _copy(param.data[expert, offset : offset + rows[piece]], tensor)
    return f"{target}[{expert}][{piece}]"


def _checked_copy(params: dict, target: str, tensor: torch.Tensor, source: str) -> None:
    if target not in params:
        raise ValueError(f"model: unexpected checkpoint tensor {source!r}")
    if params[target].shape != tensor.shape:
        raise ValueError(f"model: {source!r} has shape {tuple(tensor.shape)}, expected {tuple(params[target].shape)}")
    _copy(params[target].data, tensor)


def _copy(target: torch.Tensor, tensor: torch.Tensor) -> None:
    """Copies a checkpoint tensor into (part of) a parameter. To CUDA it goes from pinned host memory without
    waiting (load_model synchronises once at the end; the caching host allocator keeps each pinned block until its
    copy is done, even once the tensor is dropped), converted to the parameter's dtype on the device."""
    if target.device.type == "cuda":
        tensor = tensor.pin_memory()
    with torch.no_grad():
        target.copy_(tensor, non_blocking=True)
