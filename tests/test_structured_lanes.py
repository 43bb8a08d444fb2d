"""Structured outputs across the lanes: a prefill/decode pair (the decode worker replays the prefill worker's first
token into its matcher), tensor parallelism (rank 0 samples under the mask) and a rollout that migrates constrained
streams to the new weights mid-output: every output still matches its constraint."""

from __future__ import annotations

import re
import threading

import pytest
from checkpoints import LLAMA_GQA, write_checkpoint
from daemon_harness import Daemon

from gpu_runtime import LLM, SamplingParams
from gpu_runtime.ipc.structured_output import StructuredOutput
from tokend.v1 import tokend_pb2 as pb

pytestmark = pytest.mark.daemon

# The tiny model's tokenizer is byte-level: one token per character, so these bound the length of every output.
# The leading '#' is the prefill worker's token: a decode worker that did not replay it would write a second one.
CODE = r"#[a-z]{3,6}-[0-9]{2,4}"
WORDS = r"(?:[a-z] ){1000}[a-z]"  # 2,001 tokens: outlasts a new worker's start (2-3 s) several times over


def _constrained(prompt: list[int], regex: str, max_tokens: int, temperature: float = 1.0) -> pb.GenerateRequest:
    sampling = pb.SamplingParams(max_tokens=max_tokens, temperature=temperature,
                                 structured_output=pb.StructuredOutput(regex=regex))  # fmt: skip
    return pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), sampling=sampling)


def _text(chunks) -> str:
    return "".join(chunk.text for chunk in chunks)


def test_a_prefill_decode_pair_hands_constrained_requests_over_and_their_outputs_match():
    prompts = [[(5 * i + j) % 250 + 3 for j in range(40)] for i in range(6)]  # two full pages each: handed over
    with Daemon("--device", "cpu=prefill,cpu=decode", "--disagg-min-prompt-tokens", "16") as daemon:
        outputs = [list(daemon.generation.Generate(_constrained(p, CODE, 16), timeout=120)) for p in prompts]
        # Each handed its pages over (the count reaches /metrics with the workers' next load reports).
        daemon.wait_for(lambda: daemon.metric("tokend:kv_transfer_pages_total") >= len(prompts), timeout=30)
    for chunks in outputs:
        assert chunks[-1].finish_reason == "stop" and re.fullmatch(CODE, _text(chunks))


def test_tensor_parallel_ranks_sample_the_same_constrained_tokens_as_one_process(tmp_path):
    model_dir = str(write_checkpoint(tmp_path / "model", {"kind": "llama", "num_attention_heads": 4,
                                                          "num_key_value_heads": 2}))  # fmt: skip
    prompts = [{"prompt_token_ids": [(3 * i + j) % 250 + 3 for j in range(12)]} for i in range(6)]
    params = [SamplingParams(max_tokens=16, temperature=1.0, seed=i, structured_output=StructuredOutput.regex(CODE))
              for i in range(6)]  # fmt: skip
    with LLM(model_dir) as one:
        single = [o.outputs[0] for o in one.generate(prompts, params)]
    with LLM(model_dir, tensor_parallel_size=2) as two:
        split = [o.outputs[0] for o in two.generate(prompts, params)]
    assert [o.token_ids for o in split] == [o.token_ids for o in single]
    for output in split:
        assert output.finish_reason == "stop" and re.fullmatch(CODE, output.text)


def test_constrained_streams_migrated_by_a_rollout_still_match(tmp_path):
    for name, seed in (("A", 1), ("B", 2)):
        write_checkpoint(tmp_path / name, LLAMA_GQA, seed=seed, max_position_embeddings=4096)
    flags = ["--spare-devices", "cpu", "--rollout-drain-timeout", "0.5", "--on-drain-timeout", "migrate"]
    results, started = [], threading.Semaphore(0)
    with Daemon("--model", str(tmp_path / "A"), "--served-model-name", "m", *flags) as daemon:

        def stream(index: int) -> None:
            chunks = []
            for chunk in daemon.generation.Generate(_constrained([index + 3] * 8, WORDS, 2100, 0.8), timeout=600):
                if not chunks:
                    started.release()  # admitted and streaming: the rollout may begin
                chunks.append(chunk)
            results.append(chunks)

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(8)]
        for thread in threads:
            thread.start()
        for _ in threads:
            assert started.acquire(timeout=120)
        daemon.admin.Rollout(pb.RolloutRequest(model="m", path=str(tmp_path / "B"), strategy="surge"))
        for thread in threads:
            thread.join(timeout=600)
    assert len(results) == len(threads)
    assert any(chunks[-1].migrated for chunks in results), "no stream outlasted the drain timeout"
    for chunks in results:
        assert chunks[-1].finish_reason == "stop" and re.fullmatch(WORDS, _text(chunks))
