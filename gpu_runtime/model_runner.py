"""Turns a scheduled step into flat model inputs, runs the forward, and returns the sampling rows' logits."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from gpu_runtime.attention.metadata import AttentionMetadata, PrefillSpan
from gpu_runtime.kv_cache.kv_pool import KVPool
from gpu_runtime.model.llama import LlamaForCausalLM
from gpu_runtime.scheduler import SchedulerOutput
from gpu_runtime.sequence import Sequence


@dataclass(frozen=True, slots=True)
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_rows: torch.Tensor  # the last row of each sequence, in `sequences` order
    sequences: list[Sequence]  # decodes first, then prefills: the order the logits come in


class ModelRunner:
    """Owns the model and the KV pool; knows nothing of queues or sampling policy."""

    def __init__(self, model: LlamaForCausalLM, pool: KVPool, device: torch.device):
        self.model = model
        self.pool = pool
        self.device = device
        self.forward_seconds = 0.0  # time inside forward + logits, for the efficiency figure

    def prepare(self, step: SchedulerOutput) -> StepInputs:
        page_size = self.pool.page_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        for seq in step.decodes:
            position = seq.num_computed_tokens
            input_ids.extend(seq.token_ids_range(position, position + 1))
            positions.append(position)
            slots.append(seq.page_ids[position // page_size] * page_size + position % page_size)
        spans = []
        for work in step.prefills:
            seq, start = work.seq, work.seq.num_computed_tokens
            end = start + work.num_new_tokens
            spans.append(PrefillSpan(len(input_ids), work.num_new_tokens, end, self._tensor(seq.page_ids[: -(-end // page_size)])))
            input_ids.extend(seq.token_ids_range(start, end))
            positions.extend(range(start, end))
            slots.extend(seq.page_ids[p // page_size] * page_size + p % page_size for p in range(start, end))
        rows, row = [], 0
        for seq_len in [1] * len(step.decodes) + [work.num_new_tokens for work in step.prefills]:
            row += seq_len
            rows.append(row - 1)
        meta = AttentionMetadata(
            slot_mapping=self._tensor(slots),
            num_decodes=len(step.decodes),
            prefills=tuple(spans),
            **self._decode_tables(step.decodes),
        )
        sequences = step.decodes + [work.seq for work in step.prefills]
        return StepInputs(self._tensor(input_ids), self._tensor(positions), meta, self._tensor(rows), sequences)

    def _decode_tables(self, decodes: list[Sequence]) -> dict[str, torch.Tensor]:
        page_size = self.pool.page_size
        context_lens = [seq.num_computed_tokens + 1 for seq in decodes]
        max_pages = max((-(-n // page_size) for n in context_lens), default=0)
        tables = [seq.page_ids[:max_pages] + [0] * (max_pages - len(seq.page_ids[:max_pages])) for seq in decodes]
        key_positions = torch.arange(max_pages * page_size, device=self.device)
        lens = self._tensor(context_lens)
        return {
            "decode_block_tables": self._tensor(tables).view(len(decodes), max_pages),
            "decode_key_mask": (key_positions[None, :] < lens[:, None]).view(len(decodes), 1, 1, max_pages * page_size),
        }

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
