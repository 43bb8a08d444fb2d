"""The sampling defaults a checkpoint recommends in its generation_config.json, chosen as vLLM's --generation-config.

- `auto` (the default, as vLLM's): the model directory's generation_config.json, when it has one;
- `vllm`: none, so unset fields keep tokend's (and vLLM's) neutral defaults: temperature 1, no filters;
- a directory: that directory's generation_config.json, which must exist.

As vLLM, only temperature, top_p, top_k, min_p and repetition_penalty are taken, each when the file sets it
(to anything but null), whatever `do_sample` says. vLLM also turns `max_new_tokens` into a cap on every
request's max_tokens; tokend does not (a request that asks for more than the context is refused instead).
"""

from __future__ import annotations

import json
from pathlib import Path

from gpu_runtime.ipc.sampling_params import SamplingDefaults, SamplingParams

GENERATION_CONFIG_FILE = "generation_config.json"


def load_sampling_defaults(model_dir: str | Path, mode: str) -> SamplingDefaults:
    """The defaults `mode` (auto|vllm|a directory) gives this model; ValueError naming the file when it holds a
    value no request could use, so that the model fails to start rather than every request failing."""
    if mode == "vllm":
        return SamplingDefaults()
    directory = Path(model_dir) if mode == "auto" else Path(mode)
    path = directory / GENERATION_CONFIG_FILE
    if not path.is_file():
        if mode == "auto":
            return SamplingDefaults()
        raise ValueError(f"generation_config: {directory} has no {GENERATION_CONFIG_FILE}")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{path}: not readable JSON: {error}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: must hold a JSON object")
    fields = SamplingDefaults.__struct_fields__
    values = {name: raw[name] for name in fields if raw.get(name) is not None}
    try:
        SamplingParams(**values)  # every value must be one a request could have sent
    except ValueError as error:
        raise ValueError(f"{path}: {error} (serve with --generation-config vllm to ignore the file)") from None
    return SamplingDefaults(**values)
