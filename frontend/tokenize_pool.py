"""Prompt tokenization on worker threads, so that a multi-megabyte prompt never stalls the event loop."""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
from concurrent.futures import ThreadPoolExecutor

from gpu_runtime.tokenizer import Tokenizer

# Two: a big prompt being tokenized does not hold up every small one behind it, and the frontend leaves the
# other cores to the schedulers. Jobs wait in the executor's queue; each is bounded by the prompt size limit.
_NUM_THREADS = 2

# Tokenizing a prompt of megabytes is seconds of CPU. Where the frontend shares cores with CPU schedulers, the
# streams being decoded come first: the tokenize threads run at a lower priority (Linux's nice is per thread).
_TOKENIZE_NICENESS = 10


def _lower_this_threads_priority() -> None:
    with contextlib.suppress(AttributeError, OSError):  # no per-thread priority (not Linux): the usual one
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), _TOKENIZE_NICENESS)


class TokenizePool:
    def __init__(self, num_threads: int = _NUM_THREADS):
        self._executor = ThreadPoolExecutor(
            num_threads, thread_name_prefix="tokenize", initializer=_lower_this_threads_priority
        )

    async def encode(self, tokenizer: Tokenizer, text: str, add_special_tokens: bool, max_tokens: int) -> list[int]:
        """Token ids of the text; the loop only awaits them (Tokenizer.encode releases the GIL). Raises
        TooManyTokens past max_tokens."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, tokenizer.encode, text, add_special_tokens, max_tokens)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
