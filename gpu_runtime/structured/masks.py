"""Each step's allowed-token masks for its constrained rows: computed on a thread while the forward runs, applied to
the logits before anything else reads them (logit bias, penalties, greedy or sampling, logprobs).

llguidance fills one bit per token (32 to an int32 word) for every matcher at once on its own Rust threads,
without the GIL, so the forward and the masks overlap; an unconstrained batch never touches any of this.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import llguidance
import numpy as np
import torch

from gpu_runtime.sequence import Sequence


@dataclass(slots=True)
class PendingMasks:
    rows: list[int]  # the constrained rows of the step's sampling batch
    bitmask: torch.Tensor  # [len(rows), words] int32, filled by the future
    done: Future

    @torch.inference_mode()
    def apply(self, logits: torch.Tensor) -> None:
        """Sets every disallowed token's logit to -inf, in place, once the masks are ready."""
        self.done.result()
        vocab = logits.shape[-1]
        # Bit i of word w is token 32w + i: the words' little-endian bytes, unpacked least significant bit first.
        banned = np.unpackbits(self.bitmask.numpy().view(np.uint8), axis=1, bitorder="little")[:, :vocab] == 0
        if logits.device.type == "cpu" and logits.is_contiguous():
            # numpy's putmask on each row's memory: ~10x torch's masked_fill_ on a CPU when most tokens are
            # banned (0.7 ms against 8 for 16 rows of 49k), and no copy of the rows.
            values = logits.numpy()
            for index, row in enumerate(self.rows):
                np.putmask(values[row], banned[index], -np.inf)
            return
        banned_rows = torch.from_numpy(banned).to(logits.device, non_blocking=True)
        rows = torch.tensor(self.rows, device=logits.device)
        logits[rows] = logits[rows].masked_fill(banned_rows, float("-inf"))

    def wait(self) -> None:
        """Blocks until the thread is done with the matchers (before they advance, even on a failed step)."""
        self.done.exception()


def fill_bitmask(executor: llguidance.LLExecutor, matchers: list, bitmask: torch.Tensor) -> None:
    """llguidance fills each (matcher, row) of `bitmask` ([rows, words] int32, contiguous, on the CPU) in parallel.

    What llguidance.torch.fill_next_token_bitmask_par does, called directly: importing that module compiles a
    helper with torch.compile, which loads torch._dynamo, 2.4 s at every scheduler start."""
    rows, words = bitmask.shape
    executor.unsafe_compute_mask_ptr(matchers, bitmask.data_ptr(), words * 4, rows)


class GrammarMasks:
    def __init__(self, vocab_size: int):
        self._words = (vocab_size + 31) // 32
        self._executor = llguidance.LLExecutor()
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="grammar-masks")

    def start(self, seqs: list[Sequence]) -> PendingMasks | None:
        """Starts computing the masks of the rows that have a matcher; None when no row has one."""
        rows = [row for row, seq in enumerate(seqs) if seq.matcher is not None]
        if not rows:
            return None
        bitmask = torch.empty((len(rows), self._words), dtype=torch.int32)
        matchers = [(seqs[row].matcher, index) for index, row in enumerate(rows)]
        return PendingMasks(rows, bitmask, self._thread.submit(fill_bitmask, self._executor, matchers, bitmask))

    def close(self) -> None:
        self._thread.shutdown(wait=True)
