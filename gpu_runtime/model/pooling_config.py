"""A checkpoint's embedding recipe, as sentence-transformers saves it beside the weights (modules.json, its Pooling
module's config.json, a Normalize module) and config.json's Matryoshka fields; a decoder without them pools its
last token, normalized (vLLM's default for a decoder served for embeddings)."""

from __future__ import annotations

import json
from pathlib import Path

from gpu_runtime.ipc.pooling import ModelPooling, PoolingType

# modules.json's module types, by class name: sentence-transformers 2-5 write "sentence_transformers.models.Pooling",
# 6 "sentence_transformers.sentence_transformer.modules.pooling.Pooling".
_TRANSFORMER, _POOLING, _NORMALIZE = "Transformer", "Pooling", "Normalize"
# Pooling modes by the key sentence-transformers' Pooling config sets true (or its `pooling_mode` string).
_MODES = {"pooling_mode_lasttoken": PoolingType.LAST, "pooling_mode_mean_tokens": PoolingType.MEAN,
          "pooling_mode_cls_token": PoolingType.CLS}  # fmt: skip
_MODE_NAMES = {"lasttoken": PoolingType.LAST, "mean": PoolingType.MEAN, "cls": PoolingType.CLS}
_OTHER_MODES = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens")


def model_pooling(model_dir: Path, hidden_size: int) -> ModelPooling:
    """The model's ModelPooling; a recipe tokend cannot compute is kept as `unsupported` (it still generates)."""
    matryoshka = _matryoshka_dimensions(model_dir / "config.json")
    modules_path = model_dir / "modules.json"
    if not modules_path.is_file():
        return ModelPooling(PoolingType.LAST, True, hidden_size, matryoshka)
    try:
        modules = [(str(m["type"]), str(m.get("path", ""))) for m in json.loads(modules_path.read_text())]
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as error:
        return ModelPooling(hidden_size=hidden_size, unsupported=f"modules.json is unreadable ({error})")
    pooling, normalize = PoolingType.LAST, False
    for module_type, path in modules:
        kind = module_type.rpartition(".")[2]
        if kind == _POOLING:
            pooling, why = _pooling_mode(model_dir / path / "config.json")
            if why:
                return ModelPooling(hidden_size=hidden_size, unsupported=why)
        elif kind == _NORMALIZE:
            normalize = True
        elif kind != _TRANSFORMER:
            why = f"modules.json: module {module_type!r} is not supported"
            return ModelPooling(hidden_size=hidden_size, unsupported=why)
    return ModelPooling(pooling, normalize, hidden_size, matryoshka)


def _pooling_mode(path: Path) -> tuple[PoolingType, str]:
    """The Pooling module's mode, or why it cannot be served."""
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        return PoolingType.LAST, f"{path.parent.name}/config.json is unreadable ({error})"
    if raw.get("include_prompt", True) is False:
        return PoolingType.LAST, f"{path.parent.name}/config.json: include_prompt false is not supported"
    named = raw.get("pooling_mode")
    if isinstance(named, str):
        if named not in _MODE_NAMES:
            return PoolingType.LAST, f"{path.parent.name}/config.json: pooling_mode {named!r} is not supported"
        return _MODE_NAMES[named], ""
    chosen = [mode for key, mode in _MODES.items() if raw.get(key)]
    others = [key for key in _OTHER_MODES if raw.get(key)]
    if others or len(chosen) != 1:
        wanted = ", ".join(others or [key for key in _MODES if raw.get(key)]) or "no mode"
        return PoolingType.LAST, f"{path.parent.name}/config.json: {wanted} is not supported (one of last, mean, cls)"
    return chosen[0], ""


def _matryoshka_dimensions(config_path: Path) -> tuple[int, ...]:
    """config.json's matryoshka_dimensions, (0,) for is_matryoshka (any), () when the model has neither."""
    try:
        raw = json.loads(config_path.read_text())
    except (OSError, ValueError):
        return ()
    dims = raw.get("matryoshka_dimensions")
    if isinstance(dims, list) and dims and all(isinstance(d, int) and d > 0 for d in dims):
        return tuple(sorted(set(dims)))
    return (0,) if raw.get("is_matryoshka") is True else ()
