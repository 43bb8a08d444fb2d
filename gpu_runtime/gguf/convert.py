"""Converts a GGUF file, once, into a transformers checkpoint directory in tokend's cache, which is what the
engine then loads: restarts read safetensors (seconds) instead of dequantizing again.

The directory holds config.json, generation_config.json, tokenizer.json, tokenizer_config.json (special tokens
and the chat template), the weights as *.safetensors (float32, or F16/BF16 as stored: dequantized values are
exact in float32) and gguf_source.json saying what it was made from. It is keyed by the GGUF file's path, size
and modification time, so a replaced file is converted anew.

With `keep_blocks` (quantization "auto") the linear layers' and the embedding's quantized tensors are kept as they
are stored, each a uint8 [rows, bytes per row] tensor of its GGUF blocks (the Q/K row un-permutation applies to
block rows alike), their ggml types listed in quantized_weights.json; the engine serves them through
gpu_runtime/quant. Such a conversion has a cache key of its own, so it is never confused with a float one.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from pathlib import Path

import numpy as np
import structlog
import torch
from gguf import GGMLQuantizationType, ReaderTensor
from safetensors.torch import save_file
from tqdm import tqdm

from gpu_runtime.default_model import cache_dir, write_once
from gpu_runtime.gguf.dequantize import FLOAT_TYPES, check_supported, dequantize
from gpu_runtime.gguf.model_config import generation_config, gguf_entry, hf_config
from gpu_runtime.gguf.reader import GGUFFile, engine_shape, read_gguf
from gpu_runtime.gguf.tokenizer import build_tokenizer, tokenizer_config
from gpu_runtime.gguf.weights import ROPE_TENSORS, SKIPPED, CheckpointNames
from gpu_runtime.quant.blocks import QUANTIZED_WEIGHTS_FILE, keeps_blocks

CONVERTER_VERSION = 1  # bump when the output changes, so that stale conversions are not served
BLOCKS_CONVERTER_VERSION = 1  # the same for conversions that keep quantized blocks (keep_blocks)
MAX_SHARD_BYTES = 4 << 30


def converted_dir(gguf_path: Path, keep_blocks: bool = False) -> Path:
    """Where this GGUF file's conversion lives in the cache (whether or not it exists yet)."""
    stat = gguf_path.stat()
    identity = f"{gguf_path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}:{CONVERTER_VERSION}"
    if keep_blocks:  # a key of its own; float conversions keep theirs, so existing caches stay valid
        identity += f":blocks:{BLOCKS_CONVERTER_VERSION}"
    key = hashlib.sha256(identity.encode()).hexdigest()[:12]
    suffix = "-blocks" if keep_blocks else ""
    return cache_dir() / "models" / "gguf" / f"{gguf_path.name.removesuffix('.gguf')}-{key}{suffix}"


def ensure_converted(gguf_path: str | Path, keep_blocks: bool = False) -> Path:
    """The converted checkpoint directory of a GGUF file, converting it first if this cache has none."""
    gguf_path = Path(gguf_path)
    directory = converted_dir(gguf_path, keep_blocks)
    return write_once(directory, lambda scratch: convert_gguf(gguf_path, scratch, keep_blocks))


def convert_gguf(gguf_path: Path, out_dir: Path, keep_blocks: bool = False) -> None:
    """Writes the checkpoint into `out_dir`; raises ValueError naming what tokend cannot read (an architecture, a
    tensor type, a tokenizer) before the long part starts."""
    started = time.monotonic()
    log = structlog.get_logger() if structlog.is_configured() else None
    if log is not None:
        log.info("converting_gguf", source=str(gguf_path), target=str(out_dir.parent))
    gguf = read_gguf(gguf_path)
    tensors = {t.name: t for t in gguf.tensors}
    if "token_embd.weight" not in tensors:
        raise ValueError(f"model: GGUF file {gguf_path} has no token_embd.weight: not a language model tokend reads")
    rope_tensors = {name: _dequantized(tensors[name]) for name in ROPE_TENSORS if name in tensors}
    entry = gguf_entry(gguf)  # refuses an architecture tokend does not read, naming it
    config = hf_config(gguf, entry, rope_tensors)
    tokenizer = build_tokenizer(gguf)
    weights = [t for name, t in tensors.items() if name not in SKIPPED]
    checkpoint_names = CheckpointNames(entry.gguf, entry.name, int(gguf.hparam("expert_count", 0) or 0))
    names = {t.name: checkpoint_names.of(t.name) for t in weights}  # refuses unknown tensors before any work
    for t in weights:
        check_supported(t.tensor_type, t.name)
    config["vocab_size"] = engine_shape(tensors["token_embd.weight"])[0]
    _write_json(out_dir / "config.json", config)
    _write_json(out_dir / "generation_config.json", generation_config(gguf))
    tokenizer.save(str(out_dir / "tokenizer.json"))
    _write_json(out_dir / "tokenizer_config.json", tokenizer_config(gguf))
    heads = (config["num_attention_heads"], config["num_key_value_heads"])
    kept = {t.name for t in weights if keep_blocks and len(names[t.name]) == 1 and keeps_blocks(names[t.name][0], t)}
    _write_weights(gguf, weights, checkpoint_names, heads, out_dir, kept)
    if keep_blocks:
        types = {names[t.name][0]: GGMLQuantizationType(t.tensor_type).name for t in weights if t.name in kept}
        _write_json(out_dir / QUANTIZED_WEIGHTS_FILE, {"version": BLOCKS_CONVERTER_VERSION, "tensors": types})
    source = {"source": str(gguf_path.resolve()), "bytes": gguf_path.stat().st_size, "converter": CONVERTER_VERSION}
    _write_json(out_dir / "gguf_source.json", {**source, "general.name": gguf.metadata.get("general.name")})
    if log is not None:
        log.info("gguf_converted", source=str(gguf_path), seconds=round(time.monotonic() - started, 3))


def _dequantized(tensor: ReaderTensor) -> torch.Tensor:
    return dequantize(tensor.data, tensor.tensor_type, engine_shape(tensor), tensor.name)


def _raw_blocks(tensor: ReaderTensor) -> torch.Tensor:
    """A quantized tensor's bytes as uint8 [rows, bytes per row] (a copy: the reader maps the file read-only)."""
    rows = engine_shape(tensor)[0]
    return torch.from_numpy(np.ascontiguousarray(tensor.data).view(np.uint8).reshape(rows, -1).copy())


def _output_bytes(tensor: ReaderTensor, kept: frozenset[str] | set[str] = frozenset()) -> int:
    if tensor.name in kept:
        return int(tensor.n_bytes)
    dtype = FLOAT_TYPES.get(GGMLQuantizationType(tensor.tensor_type), torch.float32)
    return int(tensor.n_elements) * dtype.itemsize


def _shards(weights: list[ReaderTensor], kept: set[str]) -> list[list[ReaderTensor]]:
    """Tensors grouped into files of at most MAX_SHARD_BYTES (a tensor larger than that gets a file of its own)."""
    shards: list[list[ReaderTensor]] = [[]]
    size = 0
    for tensor in weights:
        if shards[-1] and size + _output_bytes(tensor, kept) > MAX_SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(tensor)
        size += _output_bytes(tensor, kept)
    return shards


def _write_weights(
    gguf: GGUFFile,
    weights: list[ReaderTensor],
    names: CheckpointNames,
    heads: tuple[int, int],  # attention heads, KV heads
    out_dir: Path,
    kept: set[str],
) -> None:
    shards = _shards(weights, kept)
    files = (
        ["model.safetensors"]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    weight_map = {}
    with tqdm(
        total=sum(_output_bytes(t, kept) for t in weights), desc=f"converting {gguf.path.name}", unit="B",
        unit_scale=True,
        unit_divisor=1024, file=sys.stderr, disable=not sys.stderr.isatty(), leave=False, dynamic_ncols=True,
    ) as progress:  # fmt: skip
        for shard, file_name in zip(shards, files, strict=True):
            tensors = {}
            for tensor in shard:
                value = _raw_blocks(tensor) if tensor.name in kept else _dequantized(tensor)
                for name, piece in names.pieces(tensor.name, value, heads):
                    tensors[name] = piece
                    weight_map[name] = file_name
                progress.update(_output_bytes(tensor, kept))
            save_file(tensors, str(out_dir / file_name), metadata={"format": "pt"})
    if len(files) > 1:
        total = sum(_output_bytes(t, kept) for t in weights)
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        _write_json(out_dir / "model.safetensors.index.json", index)


def _write_json(path: Path, value: dict) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n")
