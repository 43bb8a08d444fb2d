"""The playground page in a real headless Chromium: pick a model, stream a completion, press Stop."""

from __future__ import annotations

import os
import shutil
import warnings
from pathlib import Path

import pytest
from daemon_harness import ROOT, Daemon

from gpu_runtime.default_model import DEFAULT_MODEL_NAME
from tokend.v1 import tokend_pb2 as pb

PROMPT = "Tell me a long story."
MAX_TOKENS = 1900
ARTIFACTS = Path(os.environ.get("TOKEND_TEST_ARTIFACTS", ROOT / "test-artifacts"))


def _chromium() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        message = (
            "SKIPPING THE BROWSER TEST: no Chromium here. scripts/test and .ci/run install Debian's `chromium` "
            "where they may (root or passwordless sudo); install it to run this test."
        )
        warnings.warn(message, stacklevel=1)
        pytest.skip(message)
    return path


def test_the_playground_streams_shows_its_figures_and_stops(tmp_path):
    chromium = _chromium()
    from playwright.sync_api import expect, sync_playwright

    with Daemon() as daemon, sync_playwright() as playwright:
        # Greedy, so that the random model's answer is known to run long (no early end-of-sequence) and Stop,
        # not the model, ends it.
        chat = pb.ChatMessages(messages=[pb.ChatMessage(role="user", content=PROMPT)])
        sampling = pb.SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
        request = pb.GenerateRequest(chat=chat, sampling=sampling)
        assert list(daemon.generation.Generate(request, timeout=120))[-1].finish_reason == "length"
        # --no-sandbox: CI runs as root, where Chromium's sandbox refuses to start.
        browser = playwright.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1000, "height": 800})
            page.goto(daemon.http_url + "/")
            expect(page.locator("#model option")).to_have_text(DEFAULT_MODEL_NAME)
            page.fill("#prompt", PROMPT)
            page.fill("#max-tokens", str(MAX_TOKENS))
            page.fill("#temperature", "0")
            page.click("#send")
            expect(page.locator("#stats")).to_contain_text("ms to first token", timeout=60_000)
            expect(page.locator("#stats")).to_contain_text("tokens/s")
            page.wait_for_function("document.querySelector('#output').textContent.length > 0", timeout=60_000)
            daemon.wait_for(lambda: daemon.metric("tokend:num_requests_running") > 0, timeout=5)
            page.click("#stop")
            expect(page.locator("#stats")).to_contain_text("stopped")
            daemon.wait_for(lambda: daemon.metric("tokend:num_requests_running") == 0, timeout=1.0)
            expect(page.locator("#send")).to_be_enabled()
            expect(page.locator("#error")).to_have_text("")
            ARTIFACTS.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(ARTIFACTS / "playground.png"), full_page=True)
        finally:
            browser.close()
    assert (ARTIFACTS / "playground.png").stat().st_size > 10_000
