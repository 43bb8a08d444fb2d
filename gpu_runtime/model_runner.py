"""Runs a scheduled step's forward over the flattened batch and returns the sampling rows' logits (and the scores
of the prompt tokens whose logprobs are wanted)."""

from __future__ import annotations

import time
from typing import NamedTuple

import msgspec
import torch

from gpu_runtime.kv_cache.host_tier import HostPages, KVCopy
from gpu_runtime.kv_cache.kv_pool import KVPool
from gpu_runtime.model.registry import CausalLM
from gpu_runtime.pooling import pool_chunks
from gpu_runtime.prompt_logprobs import PromptScores, score_rows
from gpu_runtime.scheduler import SchedulerOutput
from gpu_runtime.step_inputs import StepInputs, StepPlan, inputs_of_plan, plan_step
from gpu_runtime.tp.step_channel import RunStep, StepChannel


class StepLogits(NamedTuple):
    # [sampling rows, vocab] float32; None on a tensor-parallel rank other than 0, and when no row samples
    sampling: torch.Tensor | None
    prompt: PromptScores | None  # the scored prompt rows' logprobs (None when no sequence wants them, and off rank 0)


class ModelRunner:
    """Owns the model and the KV pool; knows nothing of queues or sampling policy.

    Each step's inputs are planned by the model's attention backend as they are built (its `plan`, once per step,
    before the forward), on rank 0 and on every other tensor-parallel rank alike. Under tensor parallelism, rank
    0's runner has the group's `channel`: each step's plan goes to the other ranks before its own forward, and
    theirs (gpu_runtime/tp/rank_main.py) run it from the plan."""

    def __init__(self, model: CausalLM, pool: KVPool, device: torch.device, channel: StepChannel | None = None,
                 host_pages: HostPages | None = None):  # fmt: skip
        self.model = model
        self.pool = pool
        self.device = device
        self.channel = channel
        # The host KV tier's bytes (gpu_runtime/kv_cache/host_tier.py): its copies finish before each forward; a
        # tensor-parallel rank other than 0 replays rank 0's copies into its own.
        self.host_pages = host_pages
        self.forward_seconds = 0.0  # time inside forward + logits, for the efficiency figure

    def prepare(self, step: SchedulerOutput, kv_copies: list[KVCopy] = ()) -> StepInputs:
        """The step's inputs; `kv_copies`: rank 0's host-tier copies since the last step, for the other ranks."""
        plan, sequences = plan_step(step, self.pool.page_size, self.pool.layout.num_groups)
        if self.channel is not None:
            self.channel.send(RunStep(msgspec.structs.replace(plan, kv_copies=list(kv_copies))))
        return self._planned(inputs_of_plan(plan, self.device, sequences))

    def prepare_plan(self, plan: StepPlan) -> StepInputs:
        """A tensor-parallel rank's inputs, from rank 0's plan (it samples nothing), after its host-tier copies."""
        if plan.kv_copies:
            self.host_pages.replay(plan.kv_copies)
        return self._planned(inputs_of_plan(plan, self.device))

    def _planned(self, inputs: StepInputs) -> StepInputs:
        self.model.attention_backend.plan(inputs.meta)
        return inputs

    @torch.inference_mode()
    def execute(self, inputs: StepInputs) -> StepLogits:
        """Runs one forward over the flattened batch (the last inputs prepared); returns [num_sequences, vocab]
        float32 logits (None on a tensor-parallel rank other than 0: the logits are gathered to rank 0), and the
        scores of the step's prompt rows when some sequence wants its prompt's logprobs.

        Nothing here waits for the device: on CUDA the sampler's one read-back of the tokens is the step's only
        synchronisation, so this time is the host's (launching the kernels) there, and the whole forward on CPU.
        """
        started = time.perf_counter()
        if self.host_pages is not None:
            self.host_pages.before_forward()
        hidden = self.model(inputs.input_ids, inputs.positions, self.pool.layers, inputs.meta)
        # Every rank alike (the plan's logits rows are the same everywhere): a step of embeddings only samples nothing.
        logits = None
        if inputs.logits_rows.numel():
            logits = self.model.compute_logits(hidden.index_select(0, inputs.logits_rows))
        if inputs.pooled:
            pool_chunks(self.model, hidden, inputs.pooled)
        prompt = None
        if inputs.scored_rows is not None:
            scored = hidden.index_select(0, inputs.scored_rows)
            prompt = score_rows(self.model, scored, inputs.scored_targets, inputs.scored_top)
        self.forward_seconds += time.perf_counter() - started
        return StepLogits(logits, prompt)
