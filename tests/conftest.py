"""Shared fixtures: a private model cache, transformers-written checkpoints with reference outputs, and the tiers."""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing.process
import os
import random
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

# The suite's references are float32 CPU outputs: on a GPU box an engine on device "auto" would run bfloat16 on CUDA
# and be compared with them. So CUDA is hidden, before torch starts it, from the tests and every process they start
# (daemons inherit it), unless TOKEND_TEST_GPU=1: then the marked GPU tests run (TOKEND_TEST_GPU=1 pytest -m gpu).
if os.environ.get("TOKEND_TEST_GPU") != "1":
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    # Without a GPU the Triton kernels run only under Triton's interpreter, which must be on before triton is
    # first imported in a process (a worker runs many files): set for the whole run, not per test file.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch
import zmq
from checkpoints import LLAMA_GQA, QWEN2, write_checkpoint
from harness.parallel import file_units_scheduler
from harness.tiers import TIER_MARKERS, TIERS

# The CPU attention kernel is built once per machine (a minute), not once per run: the tests (and the daemons
# they start) use the kernels/ directory of the cache the user already has, where scripts/bootstrap.sh built it.
if "TORCH_EXTENSIONS_DIR" not in os.environ:
    from gpu_runtime.attention.cpu_kernel import kernel_directory

    os.environ["TORCH_EXTENSIONS_DIR"] = str(kernel_directory())
# Every test run writes the embedded default model into its own cache, never the user's, and removes it after.
if "TOKEND_CACHE_DIR" not in os.environ:
    os.environ["TOKEND_CACHE_DIR"] = tempfile.mkdtemp(prefix="tokend-test-cache-")
    atexit.register(shutil.rmtree, os.environ["TOKEND_CACHE_DIR"], ignore_errors=True)
# Every engine in the tests checks its page pool's invariants whenever it goes idle.
os.environ["TOKEND_DEBUG"] = "1"
# One torch thread in the test process, as the daemons' schedulers have on a 2-core machine: the suite's process
# computes references while a daemon (or another job) keeps the cores busy, and there two threads that spin at
# every parallel op's barrier run the tiny models 5-15 times slower than one; alone, two gain at most a third.
torch.set_num_threads(1)


def _collected_without_term(context: zmq.Context) -> None:
    """zmq.Context.__del__ for the tests: a context the garbage collector finds unclosed is reported, not terminated.
    pyzmq's own __del__ terminates it, and when its sockets are in the same collected cycle (a failed test's
    traceback holds both) their weak references are already cleared, so term() waits for sockets nobody will close
    and the whole run hangs inside the collector. Leaking the context instead costs one idle I/O thread."""
    if not context._shadow and not context.closed:
        warnings.warn(f"a test left {context!r} unclosed", ResourceWarning, stacklevel=2)


zmq.Context.__del__ = _collected_without_term

NUM_REFERENCE_TOKENS = 48
TESTS_DIR = Path(__file__).resolve().parent


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker, which needs the tiers to be on the items
def pytest_collection_modifyitems(config, items):
    """Marks every test with its file's tier (harness/tiers.py), unless the file marks itself; a test file in no
    tier, or in two, stops the run naming it, so that no file silently drops out of `-m fast` and the rest."""
    problems = set()
    for item in items:
        path = item.path.resolve()
        name = path.relative_to(TESTS_DIR).as_posix() if path.is_relative_to(TESTS_DIR) else str(path)
        own = {mark.name for mark in item.iter_markers() if mark.name in TIER_MARKERS}
        if len(own) > 1:
            problems.add(f"{name}: in two tiers {sorted(own)}")
        elif not own and name not in TIERS:
            problems.add(f"{name}: in no tier: add it to tests/harness/tiers.py (or give it a pytestmark)")
        elif not own:
            item.add_marker(TIERS[name])
    if problems:
        raise pytest.UsageError("test tiers:\n  " + "\n  ".join(sorted(problems)))


@pytest.fixture(autouse=True)
def _fast_tests_start_nothing(request, monkeypatch):
    """A `fast` test that starts a process or builds an engine fails, naming the tier it belongs in: the edit-loop
    tier stays fast because nothing in it can start a daemon or load a model."""
    if request.node.get_closest_marker("fast") is None:
        return

    def refuse(what: str, tier: str):
        def refused(*args, **kwargs):
            raise AssertionError(f"a fast test {what}: put {request.node.path.name} in the {tier} tier")

        return refused

    monkeypatch.setattr(subprocess, "Popen", refuse("started a process", "daemon"))
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", refuse("started a process", "daemon"))
    with contextlib.suppress(ImportError):  # an engine that cannot even be imported cannot be built either
        from gpu_runtime.engine import LLMEngine

        monkeypatch.setattr(LLMEngine, "__init__", refuse("built an engine", "engine"))


def pytest_xdist_make_scheduler(config, log):
    """`--dist loadfile` (scripts/test's) with the many-process files in one unit: harness/parallel.py."""
    return file_units_scheduler(config, log) if config.getvalue("dist") == "loadfile" else None


def kv_bytes_for(model_dir, page_size: int, num_pages: int) -> int:
    """The kv_cache_bytes budget that buys exactly `num_pages` pages of float32 K/V for this checkpoint (pages of every
    layer: a hybrid model, in KV groups, gets more pages of fewer layers each for it)."""
    from gpu_runtime.kv_cache.kv_pool import page_bytes
    from gpu_runtime.model.config import load_model_config

    return num_pages * page_bytes(load_model_config(model_dir), page_size, torch.float32)


def random_prompts(count: int, min_len: int, max_len: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(rng.randint(min_len, max_len))] for _ in range(count)]


def transformers_greedy(model_dir, prompts: list[list[int]], num_tokens: int) -> list[list[int]]:
    """transformers' own generate(do_sample=False), one prompt at a time: the reference outputs."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # generate exactly num_tokens, as ignore_eos does
    outputs = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=num_tokens,
                do_sample=False,
            )
            outputs.append(out[0, len(prompt) :].tolist())
    return outputs


@pytest.fixture(scope="session", params=["llama-gqa", "qwen2"])
def reference_case(request, tmp_path_factory):
    """(checkpoint dir, 16 prompts of 1-300 tokens, transformers' greedy continuations)."""
    spec = {"llama-gqa": LLAMA_GQA, "qwen2": QWEN2}[request.param]
    model_dir = write_checkpoint(tmp_path_factory.mktemp(request.param), spec)
    prompts = random_prompts(16, 1, 300, seed=1)
    return model_dir, prompts, transformers_greedy(model_dir, prompts, NUM_REFERENCE_TOKENS)


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("llama"), LLAMA_GQA)


@pytest.fixture(scope="session")
def default_model_daemon():
    """One daemon on the default model (SmolLM2-135M-Instruct) for the files that serve it through the openai client
    (structured outputs, tool calls): a start of it costs ~15 s, paid once."""
    from daemon_harness import Daemon

    with Daemon("--model", "SmolLM2-135M-Instruct", "--max-num-seqs", "32") as running:
        yield running
