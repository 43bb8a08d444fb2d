"""A checkpoint's embedding recipe read from its sentence-transformers files (both generations of their names) and
config.json's Matryoshka fields; what tokend cannot compute is kept as the reason its embeddings are refused; an
embedding request's params are checked as they are built."""

from __future__ import annotations

import json

import pytest

from gpu_runtime.ipc.pooling import ModelPooling, PoolingParams, PoolingType
from gpu_runtime.ipc.sampling_params import SamplingParams
from gpu_runtime.model.pooling_config import model_pooling

OLD = "sentence_transformers.models."  # sentence-transformers 2 to 5
NEW_POOLING = "sentence_transformers.sentence_transformer.modules.pooling.Pooling"  # 6
NEW_NORMALIZE = "sentence_transformers.base.modules.normalize.Normalize"


def _write(directory, modules, pooling_config=None, config=None):
    (directory / "config.json").write_text(json.dumps(config or {}))
    if modules is not None:
        entries = [{"idx": i, "name": str(i), "path": path, "type": kind} for i, (kind, path) in enumerate(modules)]
        (directory / "modules.json").write_text(json.dumps(entries))
    if pooling_config is not None:
        (directory / "1_Pooling").mkdir()
        (directory / "1_Pooling" / "config.json").write_text(json.dumps(pooling_config))
    return directory


def test_a_decoder_without_sentence_transformers_files_pools_its_last_token_normalized(tmp_path):
    assert model_pooling(_write(tmp_path, None), 64) == ModelPooling(PoolingType.LAST, True, 64)


@pytest.mark.parametrize(
    ("modules", "pooling_config", "expected"),
    [
        (
            [(OLD + "Transformer", ""), (OLD + "Pooling", "1_Pooling"), (OLD + "Normalize", "2_Normalize")],
            {"word_embedding_dimension": 64, "pooling_mode_mean_tokens": True},
            (PoolingType.MEAN, True),
        ),
        (
            [(OLD + "Transformer", ""), (OLD + "Pooling", "1_Pooling")],
            {"pooling_mode_lasttoken": True, "pooling_mode_mean_tokens": False},
            (PoolingType.LAST, False),
        ),
        (
            [(NEW_POOLING, "1_Pooling"), (NEW_NORMALIZE, "2_Normalize")],
            {"pooling_mode": "cls"},
            (PoolingType.CLS, True),
        ),
        (
            [(NEW_POOLING, "1_Pooling")],
            {"pooling_mode": "lasttoken", "include_prompt": True},
            (PoolingType.LAST, False),
        ),
    ],
    ids=["v5-mean-normalized", "v5-last", "v6-cls-normalized", "v6-last"],
)
def test_the_pooling_and_normalize_modules_are_read(tmp_path, modules, pooling_config, expected):
    pooling = model_pooling(_write(tmp_path, modules, pooling_config), 64)
    assert (pooling.type, pooling.normalize, pooling.unsupported) == (*expected, "")


@pytest.mark.parametrize(
    ("modules", "pooling_config", "named"),
    [
        ([(NEW_POOLING, "1_Pooling"), (OLD + "Dense", "2_Dense")], {"pooling_mode": "mean"}, "Dense"),
        ([(NEW_POOLING, "1_Pooling")], {"pooling_mode": "max"}, "'max'"),
        ([(OLD + "Pooling", "1_Pooling")], {"pooling_mode_max_tokens": True}, "pooling_mode_max_tokens"),
        (
            [(OLD + "Pooling", "1_Pooling")],
            {"pooling_mode_mean_tokens": True, "pooling_mode_cls_token": True},
            "pooling_mode_mean_tokens, pooling_mode_cls_token",
        ),
        ([(NEW_POOLING, "1_Pooling")], {"pooling_mode": "lasttoken", "include_prompt": False}, "include_prompt"),
        ([(NEW_POOLING, "missing")], None, "missing/config.json is unreadable"),
    ],
    ids=["dense", "max", "old-max", "two-modes", "no-prompt", "no-config"],
)
def test_what_cannot_be_computed_is_the_reason_embeddings_are_refused(tmp_path, modules, pooling_config, named):
    pooling = model_pooling(_write(tmp_path, modules, pooling_config), 64)
    assert named in pooling.unsupported


def test_a_modules_file_that_is_not_json_is_a_reason_too(tmp_path):
    _write(tmp_path, None)
    (tmp_path / "modules.json").write_text("{not json")
    assert "modules.json is unreadable" in model_pooling(tmp_path, 64).unsupported


@pytest.mark.parametrize(
    ("config", "dimensions", "error"),
    [
        ({}, 16, "does not support matryoshka"),
        ({"is_matryoshka": True}, 16, None),
        ({"is_matryoshka": True}, 65, "must be in [1, 64], got 65"),
        ({"matryoshka_dimensions": [32, 16]}, 16, None),
        ({"matryoshka_dimensions": [32, 16]}, 24, "must be one of [16, 32], got 24"),
    ],
)
def test_dimensions_are_those_the_model_was_trained_to_be_cut_to(tmp_path, config, dimensions, error):
    why = model_pooling(_write(tmp_path, None, config=config), 64).dimensions_error(dimensions)
    assert why is None if error is None else error in why


def test_an_embedding_request_generates_nothing_and_names_a_bad_field():
    assert SamplingParams(max_tokens=0, pooling=PoolingParams()).pooling.type is PoolingType.LAST
    with pytest.raises(ValueError, match="^pooling: must be set only with max_tokens 0"):
        SamplingParams(max_tokens=3, pooling=PoolingParams())
    with pytest.raises(ValueError, match="^max_tokens: must be .* .0 only with prompt_logprobs or pooling"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="^pooling.dimensions: must be None or an integer >= 1"):
        PoolingParams(dimensions=0)
