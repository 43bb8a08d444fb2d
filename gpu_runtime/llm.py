"""The offline API, shaped like vLLM's: LLM(...).generate(prompts, sampling_params) and LLM(...).embed(prompts)."""

from __future__ import annotations

import array
import itertools
from collections.abc import Sequence as SequenceABC

from tqdm.auto import tqdm

from gpu_runtime.engine import LLMEngine
from gpu_runtime.engine_config import EngineConfig
from gpu_runtime.ipc.pooling import PoolingParams
from gpu_runtime.ipc.sampling_params import SamplingParams
from gpu_runtime.outputs import CompletionOutput, EmbeddingOutput, EmbeddingRequestOutput, RequestOutput

PromptInput = str | dict


class LLM:
    """Generates for a list of prompts in one continuous batch and returns the outputs in prompt order."""

    def __init__(self, model: str | None = None, **engine_options):
        self.engine = LLMEngine(EngineConfig(model=model, **engine_options))
        self._ids = itertools.count()

    def close(self) -> None:
        """Stops the engine's other tensor-parallel ranks (tensor_parallel_size > 1); they also end with this
        process. Idempotent; `with LLM(...) as llm:` calls it."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: PromptInput | SequenceABC[PromptInput],
        sampling_params: SamplingParams | SequenceABC[SamplingParams] | None = None,
        use_tqdm: bool | None = None,
    ) -> list[RequestOutput]:
        """`prompts` are strings or {"prompt_token_ids": [...]} dicts; one SamplingParams or one per prompt.

        Every prompt is validated before any is queued, so a bad one raises ValueError and nothing runs.
        """
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        params = self._params_per_prompt(prompts, sampling_params)
        requests = [(str(next(self._ids)), *self._tokenize(p)) for p in prompts]
        for (_, _, token_ids), p in zip(requests, params, strict=True):
            self.engine.validate_request(token_ids, p)
        for (request_id, _, token_ids), p in zip(requests, params, strict=True):
            self.engine.add_request(request_id, token_ids, p)
        return self._run(requests, params, use_tqdm if use_tqdm is not None else len(requests) >= 32)

    def embed(
        self, prompts: PromptInput | SequenceABC[PromptInput], pooling_params: PoolingParams | None = None
    ) -> list[EmbeddingRequestOutput]:
        """Each prompt's embedding (pooled as `pooling_params` says; by default as the model's own
        sentence-transformers files do), in prompt order; a bad prompt raises ValueError before any runs."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        pooling = self.engine.pooling
        params = SamplingParams(max_tokens=0, pooling=pooling_params or PoolingParams(pooling.type, pooling.normalize))
        requests = [(str(next(self._ids)), self._tokenize(p)[1]) for p in prompts]
        for _, token_ids in requests:
            self.engine.validate_request(token_ids, params)
        for request_id, token_ids in requests:
            self.engine.add_request(request_id, token_ids, params)
        vectors: dict[str, list[float]] = {}
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.embedding is not None:
                    vectors[out.request_id] = array.array("f", out.embedding).tolist()
        return [EmbeddingRequestOutput(request_id, token_ids, EmbeddingOutput(vectors[request_id]))
                for request_id, token_ids in requests]  # fmt: skip

    def _params_per_prompt(self, prompts, sampling_params) -> list[SamplingParams]:
        if sampling_params is None:  # as vLLM's LLM: the model's generation_config.json defaults, if any
            return [SamplingParams(**self.engine.sampling_defaults.as_dict())] * len(prompts)
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"sampling_params: {len(sampling_params)} given for {len(prompts)} prompts")
        return list(sampling_params)

    def _tokenize(self, prompt: PromptInput) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.engine.tokenizer.encode(prompt)
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return None, list(prompt["prompt_token_ids"])
        raise ValueError(f"prompt: expected a string or a dict with 'prompt_token_ids', got {type(prompt).__name__}")

    def _run(self, requests, params, show_progress: bool) -> list[RequestOutput]:
        tokens: dict[str, list[int]] = {request_id: [] for request_id, _, _ in requests}
        logprobs: dict[str, list] = {request_id: [] for request_id, _, _ in requests}
        reasons: dict[str, str] = {}
        cached: dict[str, int] = {}
        prompt_logprobs: dict[str, list] = {}
        with tqdm(total=len(requests), desc="generate", unit="req", disable=not show_progress) as progress:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    tokens[out.request_id].extend(out.new_token_ids)
                    logprobs[out.request_id].extend(out.new_logprobs or [])
                    cached[out.request_id] = out.num_cached_tokens
                    if out.prompt_logprobs is not None:
                        prompt_logprobs[out.request_id] = [None, *out.prompt_logprobs[1:]]  # vLLM's None first
                    if out.finished:
                        reasons[out.request_id] = out.finish_reason
                        progress.update(1)
        return [
            RequestOutput(
                request_id=request_id,
                prompt=prompt,
                prompt_token_ids=token_ids,
                outputs=[
                    CompletionOutput(
                        index=0,
                        text=self.engine.tokenizer.decode(tokens[request_id]),
                        token_ids=tokens[request_id],
                        finish_reason=reasons[request_id],
                        logprobs=logprobs[request_id] if p.logprobs is not None else None,
                    )
                ],
                finished=True,
                num_cached_tokens=cached.get(request_id, 0),
                prompt_logprobs=prompt_logprobs.get(request_id),
            )
            for (request_id, prompt, token_ids), p in zip(requests, params, strict=True)
        ]
