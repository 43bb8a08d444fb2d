"""A scheduled step as model inputs: token ids, positions, cache slots and attention metadata, as batch tensors.

Everything the device needs is written into one host list of int64 and copied in one transfer (from pinned
memory, without waiting, on CUDA); the tensors the model reads are views of that one copy (the backends that use
masks compute them on the device from these, in their `plan`). Python touches each sequence a few times per step,
never each cached token: a decode adds one id, one position, one slot and its block-table row.

Two stages: `plan_step` turns the scheduler's choice into a StepPlan of plain integers, and `inputs_of_plan`
turns a plan into tensors. Tensor-parallel ranks receive the plan (msgspec, never pickle) and run only the second.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import msgspec
import torch

from gpu_runtime.attention.metadata import AttentionMetadata, DecodeBatch, PlanRow, PrefillBatch
from gpu_runtime.kv_cache.host_tier import KVCopy
from gpu_runtime.pooling import PooledChunk, chunk_to_pool
from gpu_runtime.prompt_logprobs import ScoredPrompt, rows_to_score
from gpu_runtime.scheduler import SchedulerOutput
from gpu_runtime.sequence import Sequence


@dataclass(frozen=True, slots=True)
class StepSequences:
    """Rank 0's view of a step's rows by sequence: those that sample a token (in logits order), those that score
    prompt tokens (in scored-row order), and the embedding requests' chunks."""

    sampling: list[Sequence] = dataclasses.field(default_factory=list)
    scored: list[ScoredPrompt] = dataclasses.field(default_factory=list)
    pooled: list[PooledChunk] = dataclasses.field(default_factory=list)


@dataclass(frozen=True, slots=True)
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_rows: torch.Tensor  # the last row of each sampling sequence, in `sampling` order
    sampling: list[Sequence]  # the sequences that sample a token this step, in logits order
    # Prompt logprobs (gpu_runtime.prompt_logprobs): the rows that score a prompt token, and those tokens (None
    # when no sequence of the step wants them); on rank 0, the sequences they belong to, in row order.
    scored_rows: torch.Tensor | None = None
    scored_targets: torch.Tensor | None = None
    scored: tuple[ScoredPrompt, ...] = ()
    # Embedding requests' chunks (gpu_runtime.pooling): they never sample, so none of them is in `sampling`.
    pooled: tuple[PooledChunk, ...] = ()

    @property
    def scored_top(self) -> int:
        """The most top tokens any scored sequence wants at each prompt position."""
        return max((item.seq.params.prompt_logprobs or 0 for item in self.scored), default=0)


class GroupPlan(msgspec.Struct, frozen=True, array_like=True):
    """Another KV group's part of a step (a hybrid model's: gpu_runtime/kv_cache/kv_groups.py): the rows are the
    first group's, at this group's pages."""

    slots: list[int]  # cache slot of each stored token
    decode_pages: list[list[int]]  # each decode row's pages, in the rows' order
    prefill_pages: list[list[int]]


class StepPlan(msgspec.Struct, frozen=True, array_like=True):
    """A step's flattened batch as plain integers: everything its forward needs but the weights and the cache."""

    input_ids: list[int]
    positions: list[int]
    slots: list[int]  # cache slot of each new token; rows past the last slot are not stored
    logits_rows: list[int]  # the rows whose logits are sampled
    decode_rows: list[PlanRow]  # single-query rows: the decodes, then a static batch's padding rows
    prefill_rows: list[PlanRow]
    num_real_decodes: int
    scored_rows: list[int] = []  # rows whose logits score a prompt token (prompt logprobs), and those tokens
    scored_targets: list[int] = []
    other_groups: list[GroupPlan] = []  # the KV groups after the first (slots and PlanRow.pages are the first's)
    # Under tensor parallelism, the host KV tier's copies rank 0 made since the last step, replayed before it.
    kv_copies: list[KVCopy] = []


class _HostBuffer:
    """int64 sections appended on the host, then moved to the device as one tensor and split into views."""

    def __init__(self) -> None:
        self.values: list[int] = []
        self.sections: list[tuple[int, int, tuple[int, ...]]] = []

    def add(self, values: list[int], shape: tuple[int, ...] | None = None) -> int:
        self.sections.append((len(self.values), len(values), shape or (len(values),)))
        self.values.extend(values)
        return len(self.sections) - 1

    def to_device(self, device: torch.device) -> list[torch.Tensor]:
        host = torch.tensor(self.values, dtype=torch.long)
        # From pinned memory without waiting: the copy overlaps with the host's next work, and the step's one
        # synchronisation (the sampler reading the tokens back) comes after the forward anyway.
        device_copy = host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host
        return [device_copy[start : start + length].view(shape) for start, length, shape in self.sections]


def build_step_inputs(step: SchedulerOutput, page_size: int, device: torch.device, num_groups: int = 1) -> StepInputs:
    """The step's inputs (its attention backend's `plan` still to run on their metadata)."""
    plan, sequences = plan_step(step, page_size, num_groups)
    return inputs_of_plan(plan, device, sequences)


def plan_step(step: SchedulerOutput, page_size: int, num_groups: int = 1) -> tuple[StepPlan, StepSequences]:
    """The step's plan, and which of its rows are whose (`num_groups`: the KV groups, each with its block table)."""
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    logits_rows: list[int] = []
    decode_rows: list[PlanRow] = []
    prefill_rows: list[PlanRow] = []
    scored_rows: list[int] = []
    scored_targets: list[int] = []
    sequences = StepSequences()
    sampling, scored = sequences.sampling, sequences.scored
    for seq in step.decodes:
        position = seq.num_computed_tokens
        decode_rows.append(PlanRow(len(input_ids), 1, position + 1, _pages(seq, position + 1, page_size)))
        input_ids.append(seq.token_ids_range(position, position + 1)[0])
        positions.append(position)
        slots.append(_slot(seq.page_ids, position, page_size))
        logits_rows.append(len(input_ids) - 1)
        sampling.append(seq)
    for work in step.prefills:
        seq, start = work.seq, work.seq.num_computed_tokens
        end = start + work.num_new_tokens
        prefill_rows.append(PlanRow(len(input_ids), work.num_new_tokens, end, _pages(seq, end, page_size)))
        if seq.params.prompt_logprobs is not None:
            rows, targets = rows_to_score(seq, start, end, first_row=len(input_ids))
            if rows:
                scored_rows += rows
                scored_targets += targets
                scored.append(ScoredPrompt(seq, len(rows)))
        if seq.params.pooling is not None:
            sequences.pooled.append(chunk_to_pool(seq, start, end, first_row=len(input_ids)))
        input_ids.extend(seq.token_ids_range(start, end))
        positions.extend(range(start, end))
        pages = seq.page_ids
        slots.extend(_slot(pages, p, page_size) for p in range(start, end))
        if end == seq.num_tokens and seq.params.pooling is None:  # its last token is in: it samples
            logits_rows.append(len(input_ids) - 1)
            sampling.append(seq)
    num_real_decodes = len(decode_rows)
    for seq in step.padding:
        # A static batch's finished sequence: its last computed position again, attending over its own pages,
        # as a padded batch row would. Its K/V is not stored (rows past the slot mapping are not).
        context = seq.num_computed_tokens
        if context == 0:
            continue
        decode_rows.append(PlanRow(len(input_ids), 1, context, _pages(seq, context, page_size)))
        input_ids.extend(seq.token_ids_range(context - 1, context))
        positions.append(context - 1)
    other_groups = [_group_plan(step, group, page_size) for group in range(1, num_groups)]
    plan = StepPlan(input_ids, positions, slots, logits_rows, decode_rows, prefill_rows, num_real_decodes,
                    scored_rows, scored_targets, other_groups)  # fmt: skip
    return plan, sequences


def _group_plan(step: SchedulerOutput, group: int, page_size: int) -> GroupPlan:
    """KV group `group`'s slots and pages for the rows plan_step laid out, in the same order."""
    slots: list[int] = []
    decode_pages: list[list[int]] = []
    prefill_pages: list[list[int]] = []
    for seq in step.decodes:
        pages, position = seq.tables[group].page_ids, seq.num_computed_tokens
        slots.append(_slot(pages, position, page_size))
        decode_pages.append(pages[: position // page_size + 1])
    for work in step.prefills:
        pages, start = work.seq.tables[group].page_ids, work.seq.num_computed_tokens
        end = start + work.num_new_tokens
        slots.extend(_slot(pages, p, page_size) for p in range(start, end))
        prefill_pages.append(pages[: -(-end // page_size)])
    for seq in step.padding:
        if seq.num_computed_tokens:
            decode_pages.append(seq.tables[group].page_ids[: -(-seq.num_computed_tokens // page_size)])
    return GroupPlan(slots, decode_pages, prefill_pages)


def inputs_of_plan(plan: StepPlan, device: torch.device, sequences: StepSequences | None = None) -> StepInputs:
    """The plan's tensors on `device`, in one host-to-device copy (`sequences`: rank 0's; the others have none)."""
    sequences = sequences or StepSequences()
    decode_rows, prefill_rows, num_real_decodes = plan.decode_rows, plan.prefill_rows, plan.num_real_decodes
    buffer = _HostBuffer()
    ids_at, positions_at = buffer.add(plan.input_ids), buffer.add(plan.positions)
    slots_at, logits_at = buffer.add(plan.slots), buffer.add(plan.logits_rows)
    decode_sections = _add_decode_sections(buffer, decode_rows, has_padding=len(decode_rows) > num_real_decodes)
    prefill_sections = _add_prefill_sections(buffer, prefill_rows)
    scored_at = (buffer.add(plan.scored_rows), buffer.add(plan.scored_targets)) if plan.scored_rows else None
    group_sections = [_add_group_sections(buffer, group) for group in plan.other_groups]
    tensors = buffer.to_device(device)

    decode = _decode_batch(tensors, decode_sections, decode_rows)
    prefill = _prefill_batch(tensors, prefill_sections, prefill_rows)
    meta = AttentionMetadata(slot_mapping=tensors[slots_at], decode=decode, prefill=prefill)
    if plan.other_groups:
        # Each group's metadata names this one as the step's (`planned`), and this one lists them: set once, here.
        groups = zip(group_sections, plan.other_groups, strict=True)
        object.__setattr__(meta, "other_groups", tuple(_group_meta(meta, tensors, *group) for group in groups))
    inputs = StepInputs(tensors[ids_at], tensors[positions_at], meta, tensors[logits_at], sequences.sampling,
                        pooled=tuple(sequences.pooled))  # fmt: skip
    if scored_at is None:
        return inputs
    rows_at, targets_at = scored_at
    return dataclasses.replace(inputs, scored_rows=tensors[rows_at], scored_targets=tensors[targets_at],
                               scored=tuple(sequences.scored))  # fmt: skip


def _slot(pages: list[int], position: int, page_size: int) -> int:
    """The flat cache slot of the token at `position`, by a block table."""
    return pages[position // page_size] * page_size + position % page_size


def _pages(seq: Sequence, num_tokens: int, page_size: int) -> list[int]:
    """The block table's first pages, those that hold the sequence's first `num_tokens` tokens."""
    return seq.page_ids[: -(-num_tokens // page_size)]


def _block_table(rows: list[PlanRow]) -> tuple[list[int], tuple[int, int]]:
    width = max(len(row.pages) for row in rows)
    flat: list[int] = []
    for row in rows:
        flat.extend(row.pages)
        flat.extend([0] * (width - len(row.pages)))
    return flat, (len(rows), width)


def _add_decode_sections(buffer: _HostBuffer, rows: list[PlanRow], has_padding: bool) -> dict[str, int]:
    if not rows:
        return {}
    table, shape = _block_table(rows)
    sections = {"table": buffer.add(table, shape), "context": buffer.add([row.context_len for row in rows])}
    if has_padding:  # the padding rows sit after the prefills: the decode rows are no longer one slice
        sections["rows"] = buffer.add([row.query_start for row in rows])
    return sections


def _add_prefill_sections(buffer: _HostBuffer, rows: list[PlanRow]) -> dict[str, int]:
    if not rows:
        return {}
    table, shape = _block_table(rows)
    max_query = max(row.query_len for row in rows)
    query_rows: list[int] = []
    query_positions: list[int] = []  # each padded query's position; a pad repeats its chunk's last query
    real: list[int] = []
    for index, row in enumerate(rows):
        first_position = row.context_len - row.query_len
        for j in range(max_query):
            last = min(j, row.query_len - 1)
            query_rows.append(row.query_start + last)
            query_positions.append(first_position + last)
        real.extend(range(index * max_query, index * max_query + row.query_len))
    return {
        "table": buffer.add(table, shape),
        "query_rows": buffer.add(query_rows, (len(rows), max_query)),
        "query_positions": buffer.add(query_positions, (len(rows), max_query)),
        "real": buffer.add(real),
    }


def _add_group_sections(buffer: _HostBuffer, group: GroupPlan) -> dict[str, int]:
    sections = {"slots": buffer.add(group.slots)}
    for kind, pages in (("decode", group.decode_pages), ("prefill", group.prefill_pages)):
        if pages:
            table, shape = _block_table([PlanRow(0, 0, 0, row_pages) for row_pages in pages])
            sections[kind] = buffer.add(table, shape)
    return sections


def _group_meta(first: AttentionMetadata, tensors, sections: dict[str, int], group: GroupPlan) -> AttentionMetadata:
    """A KV group's metadata: the first group's rows, at its own slots and block tables."""
    decode, prefill = first.decode, first.prefill
    if decode is not None:
        rows = _at_pages(decode.plan_rows, group.decode_pages)
        decode = dataclasses.replace(decode, block_table=tensors[sections["decode"]], plan_rows=rows)
    if prefill is not None:
        rows = _at_pages(prefill.plan_rows, group.prefill_pages)
        prefill = dataclasses.replace(prefill, block_table=tensors[sections["prefill"]], plan_rows=rows)
    return AttentionMetadata(tensors[sections["slots"]], decode, prefill, planned=first)


def _at_pages(rows: tuple[PlanRow, ...], pages: list[list[int]]) -> tuple[PlanRow, ...]:
    return tuple(msgspec.structs.replace(row, pages=row_pages) for row, row_pages in zip(rows, pages, strict=True))


def _decode_batch(tensors, sections: dict[str, int], rows: list[PlanRow]) -> DecodeBatch | None:
    if not rows:
        return None
    max_context = max(row.context_len for row in rows)
    batch_rows = tensors[sections["rows"]] if "rows" in sections else slice(0, len(rows))
    table, context_lens = tensors[sections["table"]], tensors[sections["context"]]
    return DecodeBatch(batch_rows, table, context_lens, max_context, tuple(rows))


def _prefill_batch(tensors, sections: dict[str, int], rows: list[PlanRow]) -> PrefillBatch | None:
    if not rows:
        return None
    first, last = rows[0], rows[-1]
    return PrefillBatch(
        rows=slice(first.query_start, last.query_start + last.query_len),
        block_table=tensors[sections["table"]],
        query_rows=tensors[sections["query_rows"]],
        query_positions=tensors[sections["query_positions"]],
        real_queries=tensors[sections["real"]],
        max_context=max(row.context_len for row in rows),
        is_one_fresh_prompt=len(rows) == 1 and first.context_len == first.query_len,
        plan_rows=tuple(rows),
    )
