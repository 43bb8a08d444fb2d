"""The playground page in a real headless Chromium, against real daemons: a conversation with a system prompt, the
request it sends, edit and re-send, local storage, Stop, the load panel, API keys with tenants, and the API's own
errors (401, 429 with its retry hint, 503). Saves the screenshots docs/playground.md shows into test-artifacts/."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import warnings
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest
from daemon_harness import ROOT, Daemon

from gpu_runtime.default_model import TINY_RANDOM_MODEL_NAME
from tokend.v1 import tokend_pb2 as pb

ARTIFACTS = Path(os.environ.get("TOKEND_TEST_ARTIFACTS", ROOT / "test-artifacts"))
LONG_PROMPT = "Tell me a long story."
# Tokens the Stop test asks for, from a copy of the tiny model with a 32k context that cannot say end-of-sequence: its
# answer runs for many seconds whatever the load, so Stop and nothing else ends it. (2,000 tokens of the 2,048
# context took 7 s on a busy machine, less than the browser took to check the load panel and reach the button.)
LONG_ANSWER = 30_000
WAIT_MS = 60_000  # the most any page condition may take on a loaded 2-core machine; most take well under a second
KEYS = {"admin": "sk-admin-0123456789", "user": "sk-user-0123456789", "metered": "sk-metered-0123456789"}
WRONG_KEY = "sk-wrong-0123456789"


def _chromium() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        message = (
            "SKIPPING THE BROWSER TESTS: no Chromium here. scripts/test and .ci/run install Debian's `chromium` "
            "where they may (root or passwordless sudo); install it to run these tests."
        )
        warnings.warn(message, stacklevel=1)
        pytest.skip(message)
    return path


@pytest.fixture(scope="module")
def browser():
    chromium = _chromium()
    from playwright.sync_api import expect, sync_playwright

    expect.set_options(timeout=WAIT_MS)
    with sync_playwright() as playwright:
        # --no-sandbox: CI runs as root, where Chromium's sandbox refuses to start.
        browser = playwright.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        yield browser
        browser.close()


@pytest.fixture(scope="module")
def daemon():
    """Tenants off: anyone who reaches the gateway may chat and read the load."""
    with Daemon() as running:
        yield running


@pytest.fixture(scope="module")
def endless_daemon(tmp_path_factory):
    """Serves, under the tiny model's name, a copy of it that cannot end an answer before max_tokens: its context is
    32,768 (positions are rotary, computed to any length) and its end-of-sequence token's embedding row is zero. The
    embeddings are tied, so that token's logit is exactly 0, never above the largest of the 257 others (an answer
    whose every logit is negative: about 2^-257 a step)."""
    import torch
    from safetensors.torch import load_file, save_file

    from gpu_runtime.default_model import ensure_tiny_random_model

    model_dir = tmp_path_factory.mktemp("endless") / TINY_RANDOM_MODEL_NAME
    shutil.copytree(ensure_tiny_random_model(), model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps(config | {"max_position_embeddings": 32_768}))
    weights = load_file(model_dir / "model.safetensors")
    weights["model.embed_tokens.weight"][config["eos_token_id"]] = torch.zeros(config["hidden_size"])
    save_file(weights, model_dir / "model.safetensors", metadata={"format": "pt"})
    daemon_config = tmp_path_factory.mktemp("endless-config") / "tokend.toml"
    daemon_config.write_text(f'[[models]]\nname = "{TINY_RANDOM_MODEL_NAME}"\npath = "{model_dir}"\n')
    with Daemon("--config", str(daemon_config)) as running:
        yield running


@pytest.fixture(scope="module")
def tenant_daemon(tmp_path_factory):
    sha = {role: hashlib.sha256(key.encode()).hexdigest() for role, key in KEYS.items()}
    config = tmp_path_factory.mktemp("tenants") / "tokend.toml"
    config.write_text(
        f"""
[[tenants]]
name = "ops"
api_key_sha256 = "{sha["admin"]}"
admin = true

[[tenants]]
name = "app"
api_key_sha256 = "{sha["user"]}"

[[tenants]]
name = "metered"
api_key_sha256 = "{sha["metered"]}"
tokens_per_minute = 1
"""
    )
    with Daemon("--config", str(config)) as running:
        yield running


@pytest.fixture
def page(browser):
    """A fresh browser profile per test (its own local and session storage), watched for script and CSP errors."""
    context = browser.new_context(
        viewport={"width": 1280, "height": 860}, permissions=["clipboard-read", "clipboard-write"]
    )
    context.set_default_timeout(WAIT_MS)
    page = context.new_page()
    page.problems = []
    page.on("pageerror", lambda error: page.problems.append(f"uncaught: {error}"))
    page.on("console", lambda message: message.type == "error" and page.problems.append(message.text))
    yield page
    context.close()


def _turns(page):
    return page.locator("#conversation .turn")


def _answered(page, count: int):
    """Waits until `count` turns are on the page and the last one's answer has ended (its stats name the finish)."""
    from playwright.sync_api import expect

    expect(_turns(page)).to_have_count(count)
    expect(_turns(page).last.locator(".stats")).to_contain_text("finish: ")


def _send_and_capture(page, text: str) -> dict:
    """Sends `text` as the next user turn; returns the JSON body of the chat request the page made."""
    with page.expect_request(lambda r: r.url.endswith("/v1/chat/completions")) as request:
        page.fill("#prompt", text)
        page.press("#prompt", "Enter")
    return request.value.post_data_json


def _same_origin_only(page, base_url: str) -> list[str]:
    """Records every URL the page asks for that is not this gateway's (the page must work offline)."""
    foreign = []
    origin = urlsplit(base_url).netloc

    def check(request):
        url = urlsplit(request.url)
        if url.scheme != "data" and url.netloc != origin:
            foreign.append(request.url)

    page.on("request", check)
    return foreign


# -- tenants off ----------------------------------------------------------------------------------------------------


def test_a_conversation_with_a_system_prompt_is_sent_whole_and_kept(daemon, page):
    from playwright.sync_api import expect

    foreign = _same_origin_only(page, daemon.http_url)
    page.goto(daemon.http_url + "/")
    expect(page.locator("#model option")).to_have_text(TINY_RANDOM_MODEL_NAME)
    page.fill("#system", "You are a terse assistant who answers in one line.")
    page.fill("#max-tokens", "12")
    page.fill("#top-p", "0.9")
    page.fill("#seed", "7")
    page.select_option("#priority", "batch")

    first = _send_and_capture(page, "What is paged attention?")
    assert first["messages"] == [
        {"role": "system", "content": "You are a terse assistant who answers in one line."},
        {"role": "user", "content": "What is paged attention?"},
    ]
    assert first["stream"] is True and first["stream_options"] == {"include_usage": True}
    settings = {"max_tokens": 12, "temperature": 0.7, "top_p": 0.9, "seed": 7, "priority": "batch"}
    assert first["model"] == TINY_RANDOM_MODEL_NAME and {name: first.get(name) for name in settings} == settings
    _answered(page, 2)
    answer = _turns(page).nth(1).locator(".content").text_content()
    stats = _turns(page).nth(1).locator(".stats").text_content()
    figures = r"\d+ ms to first token · .*prompt \d+ \(\d+ cached\) · completion \d+ · finish: \w+"
    assert re.search(figures, stats), stats
    _turns(page).nth(1).get_by_role("button", name="Copy").click()
    assert page.evaluate("navigator.clipboard.readText()") == answer

    second = _send_and_capture(page, "And why pages?")
    assert second["messages"] == [
        {"role": "system", "content": "You are a terse assistant who answers in one line."},
        {"role": "user", "content": "What is paged attention?"},
        {"role": "assistant", "content": answer},
        {"role": "user", "content": "And why pages?"},
    ]
    _answered(page, 4)
    # The second prompt starts with the first one's pages: the prefix cache served them.
    cached = re.search(r"\((\d+) cached\)", _turns(page).nth(3).locator(".stats").text_content())
    assert int(cached.group(1)) > 0
    page.locator("#request-view summary").click()
    assert json.loads(page.locator("#request-json").text_content()) == second
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "playground-chat.png"))

    # Edit last: the last question comes back into the box, its answer goes, and the edit is sent in its place.
    page.click("#edit-last")
    expect(_turns(page)).to_have_count(2)
    expect(page.locator("#prompt")).to_have_value("And why pages?")
    edited = _send_and_capture(page, "And why pages, not one block?")
    assert edited["messages"] == [*second["messages"][:3], {"role": "user", "content": "And why pages, not one block?"}]
    _answered(page, 4)

    # Kept in local storage: a reload finds the conversation, the system prompt and the settings; Clear forgets
    # the conversation for good.
    page.reload()
    expect(_turns(page)).to_have_count(4)
    expect(page.locator("#system")).to_have_value("You are a terse assistant who answers in one line.")
    expect(page.locator("#seed")).to_have_value("7")
    expect(page.locator("#priority")).to_have_value("batch")
    expect(_turns(page).nth(1).locator(".content")).to_have_text(answer)
    page.click("#clear")
    expect(_turns(page)).to_have_count(0)
    page.reload()
    expect(page.locator("#model option")).to_have_text(TINY_RANDOM_MODEL_NAME)
    expect(_turns(page)).to_have_count(0)
    assert foreign == [] and page.problems == []


def test_stop_ends_the_stream_while_the_load_panel_shows_it_running(endless_daemon, page):
    from playwright.sync_api import expect

    daemon = endless_daemon  # its model cannot say end-of-sequence: Stop, not the model, ends the answer
    page.goto(daemon.http_url + "/")
    card = page.locator(f'#load-schedulers [data-model="{TINY_RANDOM_MODEL_NAME}"]')
    expect(card.locator(".running")).to_have_text("0")  # tenants off: anyone may read the load
    expect(page.locator("#load-status")).to_contain_text("0 in flight")
    page.fill("#max-tokens", str(LONG_ANSWER))
    page.fill("#temperature", "0")
    page.fill("#prompt", LONG_PROMPT)
    page.click("#send")
    answer = _turns(page).last
    expect(answer.locator(".stats")).to_contain_text("ms to first token")
    expect(answer.locator(".stats")).to_contain_text("tokens/s")
    expect(card.locator(".running")).to_have_text("1")
    expect(page.locator("#load-status")).to_contain_text("1 in flight")
    page.screenshot(path=str(ARTIFACTS / "playground-load.png"))

    page.click("#stop")
    expect(answer.locator(".stats")).to_contain_text("stopped")
    expect(page.locator("#send")).to_be_enabled()
    expect(page.locator("#stop")).to_be_disabled()
    daemon.wait_for(lambda: daemon.metric("tokend:num_requests_running") == 0, timeout=WAIT_MS / 1000)
    expect(card.locator(".running")).to_have_text("0")
    assert answer.locator(".content").text_content() != ""
    assert page.locator("#error").text_content() == "" and page.problems == []


def test_the_page_and_its_files_carry_content_security_headers(daemon):
    page = httpx.get(daemon.http_url + "/", timeout=30)
    policy = page.headers["content-security-policy"]
    assert "default-src 'none'" in policy and "script-src 'self'" in policy and "frame-ancestors 'none'" in policy
    assert "unsafe-inline" not in policy and "unsafe-eval" not in policy
    assert page.headers["x-content-type-options"] == "nosniff"
    assert page.headers["referrer-policy"] == "no-referrer"
    assert "<script>" not in page.text and "<style>" not in page.text and "http" not in page.text  # no inline code
    for asset, media_type in (("playground.js", "javascript"), ("playground.css", "text/css")):
        reply = httpx.get(f"{daemon.http_url}/static/{asset}", timeout=30)
        assert reply.status_code == 200 and media_type in reply.headers["content-type"]
        assert reply.headers["x-content-type-options"] == "nosniff"


# -- tenants on ----------------------------------------------------------------------------------------------------


def test_with_tenants_the_api_key_is_sent_and_a_wrong_one_shows_the_401(tenant_daemon, page):
    from playwright.sync_api import expect

    page.goto(tenant_daemon.http_url + "/")
    expect(page.locator("#error")).to_contain_text("cannot list models: HTTP 401")
    expect(page.locator("#load-status")).to_have_text(re.compile("load needs an API key"))

    page.fill("#api-key", WRONG_KEY)
    page.press("#api-key", "Enter")
    page.fill("#max-tokens", "8")
    _send_and_capture(page, "Hello?")
    failed = _turns(page).last
    expect(failed.locator(".error")).to_have_text("HTTP 401: authorization: unknown API key")
    expect(failed.locator(".stats")).to_have_text("failed")  # not "waiting for the first token" any more

    # A non-admin key: it may chat (its tenant is billed) but not read the load.
    page.fill("#api-key", KEYS["user"])
    page.press("#api-key", "Enter")  # a change: the models and the load are asked for again, with the key
    expect(page.locator("#model option")).to_have_text(TINY_RANDOM_MODEL_NAME)
    expect(page.locator("#error")).to_have_text("")
    expect(page.locator("#load-status")).to_have_text(re.compile("load needs an admin key"))
    with page.expect_request(lambda r: r.url.endswith("/v1/chat/completions")) as sent:
        page.click("#send")  # the box is empty and the last good turn is the user's: it is sent again
    assert sent.value.headers["authorization"] == f"Bearer {KEYS['user']}"
    assert sent.value.post_data_json["messages"] == [{"role": "user", "content": "Hello?"}]
    _answered(page, 2)  # the failed answer made way for this one
    tenant_daemon.wait_for(lambda: tenant_daemon.usage_report().get("app", {}).get("requests") == 1, timeout=30)

    # The admin key reads the load, and stays for the tab's life (session storage): a reload still has it.
    page.fill("#api-key", KEYS["admin"])
    page.press("#api-key", "Enter")
    page.reload()
    expect(page.locator("#api-key")).to_have_value(KEYS["admin"])
    expect(page.locator(f'#load-schedulers [data-model="{TINY_RANDOM_MODEL_NAME}"] .running')).to_have_text("0")
    expect(page.locator("#load-status")).to_contain_text("in flight")


def test_the_load_endpoint_answers_admin_keys_only(tenant_daemon):
    def load(key: str | None) -> httpx.Response:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.get(tenant_daemon.http_url + "/v1/load", headers=headers, timeout=30)

    assert load(None).status_code == 401 and load(WRONG_KEY).status_code == 401
    refused = load(KEYS["user"])
    assert refused.status_code == 403 and refused.json()["error"]["message"] == "tenant 'app' is not an admin"
    answered = load(KEYS["admin"])
    assert answered.status_code == 200 and answered.headers["cache-control"] == "no-store"
    (scheduler,) = answered.json()["schedulers"]
    assert scheduler["model"] == TINY_RANDOM_MODEL_NAME and scheduler["ready"] and scheduler["pid"] > 0


def test_a_shed_request_shows_the_429_and_its_retry_hint_and_a_draining_server_the_503(tenant_daemon, page):
    from playwright.sync_api import expect

    page.goto(tenant_daemon.http_url + "/")
    page.fill("#api-key", KEYS["metered"])  # one token a minute: the first request spends it, the next is shed
    page.press("#api-key", "Enter")
    page.fill("#max-tokens", "8")
    _send_and_capture(page, "Hello?")
    _answered(page, 2)
    _send_and_capture(page, "Again?")
    expect(_turns(page).last.locator(".error")).to_have_text(
        re.compile(r"^HTTP 429: tenant 'metered' used its tokens_per_minute; retry in \d+ s$")
    )

    admin = (("authorization", f"Bearer {KEYS['admin']}"),)
    tenant_daemon.admin.Drain(pb.DrainRequest(), metadata=admin, timeout=30)  # last test of its daemon
    page.fill("#api-key", KEYS["admin"])
    page.press("#api-key", "Enter")
    _send_and_capture(page, "Still there?")
    expect(_turns(page).last.locator(".error")).to_have_text(
        "HTTP 503: server is draining; retry on another instance (Retry-After: 1 s)"
    )
    expect(page.locator("#load-status")).to_contain_text("draining")
