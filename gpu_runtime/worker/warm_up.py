"""Warm-up: one short generation before the scheduler says it is ready, so no client pays first-run costs."""

from __future__ import annotations

from gpu_runtime.engine import LLMEngine
from gpu_runtime.ipc.pooling import PoolingParams
from gpu_runtime.ipc.sampling_params import SamplingParams
from gpu_runtime.ipc.structured_output import StructuredOutput

_WARM_UP_ID = "tokend-warm-up"


def warm_up(engine: LLMEngine, num_prompt_tokens: int = 32, num_output_tokens: int = 4) -> None:
    """Runs a prefill and a few decode steps through every layer (an embedding, for a model that only embeds), then
    forgets the request's cached pages.

    Under a grammar that allows anything, so the structured-output tokenizer is built and the mask path runs now
    (the first constrained request would otherwise pay ~0.2 s for it); without, for a model that has no
    end-of-sequence token (it serves no structured output: GrammarCompiler says why to each request that asks)."""
    prompt = [i % engine.model_config.vocab_size for i in range(1, num_prompt_tokens + 1)]
    anything = StructuredOutput.regex(r"(?s:.*)") if engine.model_config.eos_token_ids else None
    params = SamplingParams(max_tokens=num_output_tokens, temperature=0, ignore_eos=True, structured_output=anything)
    if not engine.model_config.generates:  # a base model embeds only: its prefill is the whole warm-up
        params = SamplingParams(max_tokens=0, pooling=PoolingParams())
    engine.add_request(_WARM_UP_ID, prompt, params)
    while engine.has_unfinished_requests():
        engine.step()
    # Leave no trace in what clients see: no cached prefix, no counted tokens or steps.
    engine.kv.allocator.evict_all_cached()
    engine.kv.num_prefix_query_tokens = engine.kv.num_prefix_hit_tokens = engine.kv.num_host_hit_tokens = 0
    engine.stats = type(engine.stats)()
