"""Which of a checkpoint's kept GGUF blocks a model serves in place, swapping its modules for the quantized ones
before it is materialised; and the others dequantized as they are loaded.

Served in blocks: each nn.Linear (and the nn.Embedding) whose checkpoint pieces are all kept in one block type, on
a CPU in float32 with the kernel built. A fused layer whose pieces differ in type (Q4_K_M files store some v_proj
or down_proj in Q6_K beside Q4_K) is dequantized whole, since one kernel call runs one type; so are the MoE
experts' stacked tensors, which no kernel here multiplies. Elsewhere (CUDA, other dtypes, no compiler) everything
is dequantized at load, today's float path.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

import structlog
import torch
from torch import nn

from gpu_runtime.model.llama import RMSNorm
from gpu_runtime.model.registry import Architecture
from gpu_runtime.quant.blocks import BlockFormat, read_quantized_weights
from gpu_runtime.quant.kernel import load_quant_kernel
from gpu_runtime.quant.linear import QuantizedEmbedding, QuantizedLinear
from gpu_runtime.quant.norm import KernelRMSNorm

_LAYER_MODULE = re.compile(r"^layers\.(\d+)\.(.+)$")


@dataclass(slots=True)
class QuantizedPlan:
    stored: dict[str, BlockFormat]  # every tensor the checkpoint holds in blocks
    served: set[str] = field(default_factory=set)  # those served in place; the rest are dequantized at load

    def as_loaded(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """A checkpoint tensor as the model takes it: a kept tensor not served in blocks, dequantized."""
        block = self.stored.get(name)
        if block is None or name in self.served:
            return tensor
        # Here, not at the top: the gguf package it imports costs a third of a second of every scheduler's start.
        from gpu_runtime.gguf.dequantize import DEQUANTIZERS

        in_features = tensor.shape[1] // block.block_bytes * block.block_values
        values = DEQUANTIZERS[block.type](tensor.reshape(-1, block.block_bytes))
        return values.reshape(tensor.shape[0], in_features)


def plan_quantized(model_dir: Path, tensor_parallel: bool) -> QuantizedPlan:
    """What the checkpoint holds in blocks, and (once `swap_modules` runs) what is served so."""
    stored = read_quantized_weights(model_dir)
    if stored and tensor_parallel:
        name = next(iter(stored))
        raise ValueError(
            f"quantization: tensor {name!r} is stored as {stored[name].type.name} blocks, which tensor parallelism "
            f'does not split; serve it with quantization = "none" or tensor_parallel_size = 1'
        )
    return QuantizedPlan(stored)


def can_serve_blocks(device: torch.device, dtype: torch.dtype) -> bool:
    if device.type != "cpu" or dtype != torch.float32:
        _say(f"the {device.type} device in {dtype} has no quantized kernel")
        return False
    return load_quant_kernel() is not None  # it says why not itself


def swap_modules(model: nn.Module, entry: Architecture, plan: QuantizedPlan, tied: bool) -> None:
    """Replaces each module whose weight can be served in blocks, and then each RMSNorm by the kernel's (called under
    the meta device, before the model is materialised, so that no float weight is ever allocated for them)."""
    for name, module in list(model.named_modules()):
        if type(module) not in (nn.Linear, nn.Embedding):  # VocabParallelEmbedding, PackedLinear: not these
            continue
        pieces = _checkpoint_pieces(entry, name, tied)
        blocks = {plan.stored.get(piece) for piece in pieces}
        if len(blocks) != 1 or None in blocks:
            continue  # a float weight, or a fused one mixing types: dequantized at load
        (block,) = blocks
        if isinstance(module, nn.Linear):
            replacement = QuantizedLinear(module.in_features, module.out_features, block, module.bias is not None)
        else:
            replacement = QuantizedEmbedding(module.num_embeddings, module.embedding_dim, block)
        _replace(model, name, replacement)
        plan.served.update(pieces)
    if plan.served:  # the norms between those matmuls too (torch's own stays on every float path)
        for name, module in list(model.named_modules()):
            if type(module) is RMSNorm:
                _replace(model, name, KernelRMSNorm(module.weight.shape[0], module.eps))


def _replace(model: nn.Module, name: str, replacement: nn.Module) -> None:
    parent, _, attribute = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, attribute, replacement)


def _checkpoint_pieces(entry: Architecture, module_name: str, tied: bool) -> list[str]:
    """The checkpoint tensors that fill a module's weight (several for a fused one)."""
    if module_name == "lm_head":
        return ["model.embed_tokens.weight" if tied else "lm_head.weight"]
    match = _LAYER_MODULE.match(module_name)
    if match is None:
        return [f"model.{module_name}.weight"]
    layer, module = match.groups()
    fused = entry.fused_parameter(module)
    modules = fused.pieces if fused is not None else (module,)
    return [f"model.layers.{layer}.{piece}.weight" for piece in modules]


def _say(reason: str) -> None:
    if structlog.is_configured():
        structlog.get_logger().info("quantized_weights_dequantized", reason=reason)
    else:
        print(f"tokend: serving the GGUF's quantized weights dequantized ({reason})", file=sys.stderr)
