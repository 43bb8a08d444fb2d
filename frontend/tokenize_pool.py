"""Prompt tokenization on worker threads, so that a multi-megabyte prompt never stalls the event loop."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

from gpu_runtime.tokenizer import Tokenizer

# Two: a big prompt being tokenized does not hold up every small one behind it, and the frontend leaves the
# other cores to the schedulers. Jobs wait in the executor's queue; each is bounded by the prompt size limit.
_NUM_THREADS = 2


class TokenizePool:
    def __init__(self, num_threads: int = _NUM_THREADS):
        self._executor = ThreadPoolExecutor(num_threads, thread_name_prefix="tokenize")

    async def encode(self, tokenizer: Tokenizer, text: str, add_special_tokens: bool, max_tokens: int) -> list[int]:
        """Token ids of the text; the loop only awaits them (Tokenizer.encode releases the GIL). Raises
        TooManyTokens past max_tokens."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, tokenizer.encode, text, add_special_tokens, max_tokens)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
