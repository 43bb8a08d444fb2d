"""Runs a scheduled step's forward over the flattened batch and returns the sampling rows' logits."""

from __future__ import annotations

import time

import torch

from gpu_runtime.kv_cache.kv_pool import KVPool
from gpu_runtime.model.llama import LlamaForCausalLM
from gpu_runtime.scheduler import SchedulerOutput
from gpu_runtime.step_inputs import StepInputs, build_step_inputs


class ModelRunner:
    """Owns the model and the KV pool; knows nothing of queues or sampling policy."""

    def __init__(self, model: LlamaForCausalLM, pool: KVPool, device: torch.device):
        self.model = model
        self.pool = pool
        self.device = device
        self.forward_seconds = 0.0  # time inside forward + logits, for the efficiency figure
        self._needs_spans = model.layers[0].self_attn.backend.uses_spans

    def prepare(self, step: SchedulerOutput) -> StepInputs:
        return build_step_inputs(step, self.pool.page_size, self.device, with_spans=self._needs_spans)

    @torch.inference_mode()
    def execute(self, inputs: StepInputs) -> torch.Tensor:
        """Runs one forward over the flattened batch; returns [num_sequences, vocab] float32 logits.

        Nothing here waits for the device: on CUDA the sampler's one read-back of the tokens is the step's only
        synchronisation, so this time is the host's (launching the kernels) there, and the whole forward on CPU.
        """
        started = time.perf_counter()
        hidden = self.model(inputs.input_ids, inputs.positions, self.pool.layers, inputs.meta)
        logits = self.model.compute_logits(hidden.index_select(0, inputs.logits_rows))
        self.forward_seconds += time.perf_counter() - started
        return logits
