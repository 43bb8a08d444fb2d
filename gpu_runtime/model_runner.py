"""Turns a scheduled step into flat model inputs, runs the forward, and returns the sampling rows' logits."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from gpu_runtime.attention.metadata import AttentionMetadata, SequenceSpan
from gpu_runtime.kv_cache.kv_pool import KVPool
from gpu_runtime.model.llama import LlamaForCausalLM
from gpu_runtime.scheduler import SchedulerOutput
from gpu_runtime.sequence import Sequence


@dataclass(frozen=True, slots=True)
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_rows: torch.Tensor  # the last row of each sampling sequence, in `sampling` order
    sampling: list[Sequence]  # the sequences that sample a token this step, in logits order


def pages_for(seq: Sequence, num_tokens: int, page_size: int) -> list[int]:
    """The block table's first pages, those that hold the sequence's first `num_tokens` tokens."""
    return seq.page_ids[: -(-num_tokens // page_size)]


class ModelRunner:
    """Owns the model and the KV pool; knows nothing of queues or sampling policy."""

    def __init__(self, model: LlamaForCausalLM, pool: KVPool, device: torch.device):
        self.model = model
        self.pool = pool
        self.device = device
        self.forward_seconds = 0.0  # time inside forward + logits, for the efficiency figure

    def prepare(self, step: SchedulerOutput) -> StepInputs:
        page_size = self.pool.page_size
        work = [(seq, 1) for seq in step.decodes] + [(w.seq, w.num_new_tokens) for w in step.prefills]
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        spans = []
        logits_rows: list[int] = []
        sampling: list[Sequence] = []
        for seq, num_new in work:
            start = seq.num_computed_tokens
            end = start + num_new
            pages = seq.page_ids
            spans.append(SequenceSpan(len(input_ids), num_new, end, self._tensor(pages_for(seq, end, page_size))))
            input_ids.extend(seq.token_ids_range(start, end))
            positions.extend(range(start, end))
            slots.extend(pages[p // page_size] * page_size + p % page_size for p in range(start, end))
            if end == seq.num_tokens:  # its last token is in: it samples (a mid-prompt chunk does not)
                logits_rows.append(len(input_ids) - 1)
                sampling.append(seq)
        for seq in step.padding:
            # A static batch's finished sequence: its last computed position again, attending over its own
            # pages, as a padded batch row would. Its K/V is not stored (rows past the slot mapping are not).
            context = seq.num_computed_tokens
            if context == 0:
                continue
            spans.append(SequenceSpan(len(input_ids), 1, context, self._tensor(pages_for(seq, context, page_size))))
            input_ids.extend(seq.token_ids_range(context - 1, context))
            positions.append(context - 1)
        meta = AttentionMetadata(slot_mapping=self._tensor(slots), spans=tuple(spans))
        return StepInputs(self._tensor(input_ids), self._tensor(positions), meta, self._tensor(logits_rows), sampling)

    def _tensor(self, values: list) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)

    @torch.inference_mode()
    def execute(self, inputs: StepInputs) -> torch.Tensor:
        """Runs one forward over the flattened batch; returns [num_sequences, vocab] float32 logits."""
        started = time.perf_counter()
        hidden = self.model(inputs.input_ids, inputs.positions, self.pool.layers, inputs.meta)
        logits = self.model.compute_logits(hidden[inputs.logits_rows])
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.forward_seconds += time.perf_counter() - started
        return logits
