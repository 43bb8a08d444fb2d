"""Prompt tokenization on worker threads, so that a multi-megabyte prompt never stalls the event loop."""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
from concurrent.futures import ThreadPoolExecutor

from gpu_runtime.tokenizer import Tokenizer

# Two threads each for usual and bulk texts: a big prompt being tokenized does not hold up every small one behind
# it, and the frontend leaves the other cores to the schedulers. Jobs wait in their executor's queue; each is
# bounded by the prompt size limit.
_NUM_THREADS = 2

# A text this long (about 16k tokens and up; a few milliseconds of CPU) is tokenized as bulk work, below the
# schedulers' priority: a prompt of megabytes is seconds of CPU, and where the frontend shares cores with CPU
# schedulers the streams being decoded come first. Shorter prompts keep the usual priority (their TTFT waits on it).
BULK_TEXT_CHARS = 64 * 1024
_BULK_NICENESS = 10


def _lower_this_threads_priority() -> None:
    with contextlib.suppress(AttributeError, OSError):  # no per-thread priority (Linux's nice is per thread)
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), _BULK_NICENESS)


class TokenizePool:
    def __init__(self, num_threads: int = _NUM_THREADS):
        self._usual = ThreadPoolExecutor(num_threads, thread_name_prefix="tokenize")
        self._bulk = ThreadPoolExecutor(
            num_threads, thread_name_prefix="tokenize-bulk", initializer=_lower_this_threads_priority
        )

    async def encode(self, tokenizer: Tokenizer, text: str, add_special_tokens: bool, max_tokens: int) -> list[int]:
        """Token ids of the text; the loop only awaits them (Tokenizer.encode releases the GIL). Raises
        TooManyTokens past max_tokens."""
        executor = self._bulk if len(text) >= BULK_TEXT_CHARS else self._usual
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(executor, tokenizer.encode, text, add_special_tokens, max_tokens)

    def close(self) -> None:
        for executor in (self._usual, self._bulk):
            executor.shutdown(wait=False, cancel_futures=True)
