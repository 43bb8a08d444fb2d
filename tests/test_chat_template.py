"""Chat templates: found, compiled and rendered as transformers does, sandboxed, and time-limited."""

from __future__ import annotations

import asyncio
import json
import sys
import time

import pytest

from common.chat_template import ChatTemplate, ChatTemplateError
from gpu_runtime.default_model import ensure_tiny_random_model

HI = [{"role": "user", "content": "Hi"}]


def test_the_tiny_models_template_renders_a_generation_prompt():
    template = ChatTemplate.from_model_dir(ensure_tiny_random_model())
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


def test_a_render_held_up_without_running_is_not_failed_for_it():
    """The limit is the render's CPU time: a frontend stopped or starved for a moment (the chaos run's SIGSTOP, a
    busy machine) still renders a cheap template, where a wall-clock limit answered 400."""

    class HeldUp(ChatTemplate):
        def render(self, messages, **options):
            time.sleep(0.5)  # the thread is held up: wall time passes, no CPU time
            return super().render(messages, **options)

    template = HeldUp("{% for m in messages %}{{ m['content'] }}{% endfor %}", {})
    assert asyncio.run(template.render_async(HI, timeout=0.2)) == "".join(m["content"] for m in HI)


def test_transformers_environment_loop_controls_tojson_and_generation_tag():
    template = ChatTemplate(
        "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{% generation %}"
        "{{ m | tojson }}{% endgeneration %}{% endfor %}",
        {},
    )
    # No HTML escaping and no \\u escapes, as transformers' own tojson.
    assert template.render([{"role": "user", "content": "<b>&café"}, *HI]) == '{"role": "user", "content": "<b>&café"}'


def test_chat_template_jinja_wins_and_named_files_serve_tools(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "config", "eos_token": "</s>"}))
    (tmp_path / "chat_template.jinja").write_text("file{{ eos_token }}")
    (tmp_path / "additional_chat_templates").mkdir()
    (tmp_path / "additional_chat_templates" / "tool_use.jinja").write_text("{{ tools[0]['name'] }}")
    template = ChatTemplate.from_model_dir(tmp_path)
    assert template.render(HI) == "file</s>"
    assert template.render(HI, tools=[{"name": "weather"}]) == "weather"


def test_named_list_picks_tool_use_only_when_tools_are_given(tmp_path):
    named = [{"name": "default", "template": "plain"}, {"name": "tool_use", "template": "tools"}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": named}))
    template = ChatTemplate.from_model_dir(tmp_path)
    assert (template.render(HI), template.render(HI, tools=[])) == ("plain", "tools")


def test_continue_final_message_leaves_the_last_message_open():
    template = ChatTemplate("{% for m in messages %}[{{ m['content'] }}]\n{% endfor %}", {})
    chat = [*HI, {"role": "assistant", "content": "Hel"}]
    assert template.render(chat, add_generation_prompt=False, continue_final_message=True) == "[Hi]\n[Hel"
    with pytest.raises(ChatTemplateError, match="^messages: continue_final_message and add_generation_prompt"):
        template.render(chat, continue_final_message=True)


def test_template_kwargs_reach_the_template_but_never_replace_the_conversation():
    template = ChatTemplate("{{ messages[0]['content'] }}{% if enable_thinking %}<think>{% endif %}", {})
    assert template.render(HI, template_kwargs={"enable_thinking": True, "messages": []}) == "Hi<think>"


def test_grpc_chat_options_default_to_a_generation_prompt_and_name_bad_json():
    from common.chat_template import chat_options
    from tokend.v1 import tokend_pb2 as pb

    assert chat_options(pb.ChatMessages())["add_generation_prompt"] is True
    assert chat_options(pb.ChatMessages(continue_final_message=True))["add_generation_prompt"] is False
    assert chat_options(pb.ChatMessages(tools_json='[{"name": "x"}]'))["tools"] == [{"name": "x"}]
    with pytest.raises(ChatTemplateError, match="^tools_json: must be a JSON array"):
        chat_options(pb.ChatMessages(tools_json="{}"))


def test_a_syntax_error_names_the_file_and_line(tmp_path):
    from common.chat_template import ChatTemplateLoadError

    (tmp_path / "chat_template.jinja").write_text("ok\n{% if %}")
    with pytest.raises(ChatTemplateLoadError, match=r"chat_template\.jinja: line 2: the chat template does not"):
        ChatTemplate.from_model_dir(tmp_path)


def test_a_render_that_loops_past_its_step_budget_stops_on_its_own_thread():
    """The 1 s limit fails the request; the budget also ends the thread, which Python could not stop otherwise."""
    template = ChatTemplate("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", {})
    with pytest.raises(ChatTemplateError, match="messages: the chat template ran over"):
        template.render(HI)
    assert sys.gettrace() is None  # the hook is this render's only: the thread is traced no longer


@pytest.mark.parametrize("expression", ['"a" * 1000000000', "[0] * 10**8", "2 ** 100000"])
def test_repetition_and_powers_that_would_take_the_memory_are_refused(expression):
    template = ChatTemplate("{{ " + expression + " }}", {})
    with pytest.raises(ChatTemplateError, match="messages:"):
        template.render(HI)


def test_modest_repetition_still_renders():
    assert ChatTemplate('{{ "=" * 8 }}{{ 2 ** 10 }}', {}).render(HI) == "========1024"
