"""Chat templates: rendered as the model's tokenizer_config.json says, sandboxed, and time-limited."""

from __future__ import annotations

import asyncio
import json

import pytest

from frontend.chat_template import ChatTemplate, ChatTemplateError
from gpu_runtime.default_model import ensure_default_model

HI = [{"role": "user", "content": "Hi"}]


def test_the_default_models_template_renders_a_generation_prompt():
    template = ChatTemplate.from_model_dir(ensure_default_model())
    assert template.render(HI) == "<|begin_of_text|><|user|>\nHi\n<|assistant|>\n"


def test_named_templates_and_added_token_objects_are_understood(tmp_path):
    config = {
        "bos_token": {"content": "<s>", "lstrip": False},
        "chat_template": [
            {"name": "tool_use", "template": "tools"},
            {"name": "default", "template": "{{ bos_token }}{{ messages[0]['content'] }}"},
        ],
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    assert ChatTemplate.from_model_dir(tmp_path).render(HI) == "<s>Hi"


def test_a_model_without_a_template_has_none(tmp_path):
    assert ChatTemplate.from_model_dir(tmp_path) is None
    (tmp_path / "tokenizer_config.json").write_text("{}")
    assert ChatTemplate.from_model_dir(tmp_path) is None


def test_the_sandbox_refuses_reaching_into_python():
    template = ChatTemplate("{{ messages.__class__.__mro__[1].__subclasses__() }}", {})
    with pytest.raises(ChatTemplateError, match="^messages:"):
        template.render(HI)


def test_raise_exception_in_a_template_names_messages():
    template = ChatTemplate(
        "{% if messages[0]['role'] != 'system' %}{{ raise_exception('system first') }}{% endif %}", {}
    )
    with pytest.raises(ChatTemplateError, match="system first"):
        template.render(HI)


def test_a_render_that_runs_too_long_is_abandoned():
    template = ChatTemplate("{% for i in range(4000) %}{% for j in range(2000) %}{% endfor %}{% endfor %}", {})
    with pytest.raises(ChatTemplateError, match="took over"):
        asyncio.run(template.render_async(HI, timeout=0.2))
