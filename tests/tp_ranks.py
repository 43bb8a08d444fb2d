"""One rank of a tensor-parallel group, for tests/test_tensor_parallel_model.py: loads its shard of a checkpoint
and runs a job's steps through the model over its own paged KV pool; rank 0 writes the logits.

    python tests/tp_ranks.py JOB_DIR RANK WORLD_SIZE

JOB_DIR/job.json says what to run (JSON in, safetensors and JSON out: nothing is pickled). The ranks meet through
the file JOB_DIR/rendezvous (gloo); every collective times out after COLLECTIVE_TIMEOUT, so a rank whose partner
died exits with an error instead of hanging.
"""

from __future__ import annotations

import json
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from gpu_runtime.attention.backend import make_attention_backend
from gpu_runtime.ipc.sampling_params import SamplingParams
from gpu_runtime.kv_cache.kv_pool import KVPool
from gpu_runtime.memory_profile import kv_layout_of
from gpu_runtime.model.config import load_model_config
from gpu_runtime.model.cpu_weights import can_prepack, prepack_linears
from gpu_runtime.model.llama import LlamaForCausalLM, place_kv_groups
from gpu_runtime.model.loader import load_model
from gpu_runtime.model.tensor_parallel import TensorParallel
from gpu_runtime.scheduler import PrefillWork, SchedulerOutput
from gpu_runtime.sequence import BlockTable, Sequence
from gpu_runtime.step_inputs import build_step_inputs

CPU = torch.device("cpu")
COLLECTIVE_TIMEOUT = timedelta(seconds=600)  # a hang guard: a loaded machine starts ranks slowly
PAGE_SIZE = 4


def parameter_bytes(model: torch.nn.Module) -> int:
    """The parameters' bytes, a tied tensor once (buffers such as the rotary tables left out)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


@torch.inference_mode()
def run_steps(model: LlamaForCausalLM, job: dict) -> list[torch.Tensor] | None:
    """Each sequence's prompt, then its continuation one decode at a time, through the model's forward as the engine
    runs a step (a flattened batch, decodes first; attention metadata from build_step_inputs; K/V written into and
    read back from the pages). Prompts go in chunks of job["chunk"] tokens, so later steps mix decodes with chunks
    that read a cached prefix. The pool is laid out in the model's KV groups, as the engine's (a hybrid model's: a
    block table per group, every group's pages its own). Returns, per sequence, the logits of every position
    ([tokens, vocab], in position order), on rank 0; None on the other ranks."""
    config = model.config  # the rank's own view: its KV heads only
    backend = model.attention_backend
    layout = kv_layout_of(model)
    place_kv_groups(model, layout)
    prompts, continuations, chunk = job["prompts"], job["continuations"], job["chunk"]
    pages_per_seq = [-(-(len(p) + len(c)) // PAGE_SIZE) for p, c in zip(prompts, continuations, strict=True)]
    pool = KVPool(config, sum(pages_per_seq) * layout.num_groups, PAGE_SIZE, torch.float32, CPU, layout)
    seqs, free_pages = [], iter(range(pool.num_pages))
    for index, (prompt, pages) in enumerate(zip(prompts, pages_per_seq, strict=True)):
        seq = Sequence(f"seq-{index}", prompt, SamplingParams(), config.max_model_len, frozenset())
        seq.tables = [BlockTable([next(free_pages) for _ in range(pages)]) for _ in range(layout.num_groups)]
        seqs.append(seq)
    rows: list[list[torch.Tensor]] = [[] for _ in seqs]
    while True:
        step = SchedulerOutput()
        for index, seq in enumerate(seqs):
            fed = len(seq.output_token_ids)
            if seq.num_computed_tokens < seq.num_prompt_tokens:
                new = min(chunk, seq.num_prompt_tokens - seq.num_computed_tokens)
                step.prefills.append(PrefillWork(seq, new))
            elif fed < len(continuations[index]):
                seq.output_token_ids.append(continuations[index][fed])
                step.decodes.append(seq)
        if step.is_empty:
            break
        inputs = build_step_inputs(step, PAGE_SIZE, CPU, layout.num_groups)
        backend.plan(inputs.meta)  # once per step, before the forward, as ModelRunner does
        hidden = model(inputs.input_ids, inputs.positions, pool.layers, inputs.meta)
        logits = model.compute_logits(hidden)  # every row, not just the sampling ones: all positions are compared
        row = 0
        for seq, new in [(s, 1) for s in step.decodes] + [(w.seq, w.num_new_tokens) for w in step.prefills]:
            if logits is not None:
                rows[seqs.index(seq)].append(logits[row : row + new])
            seq.num_computed_tokens += new
            row += new
    return [torch.cat(r) for r in rows] if model.tp is None or model.tp.is_first else None


def main(job_dir: Path, rank: int, world_size: int) -> None:
    job = json.loads((job_dir / "job.json").read_text())
    dist.init_process_group(
        "gloo", init_method=f"file://{job_dir}/rendezvous", rank=rank, world_size=world_size,
        timeout=COLLECTIVE_TIMEOUT,
    )  # fmt: skip
    try:
        tp = TensorParallel(rank, world_size)
        model_dir = job["model_dir"]
        config = load_model_config(model_dir)
        backend = make_attention_backend(job["backend"], CPU)
        stats = {}

        def load() -> LlamaForCausalLM:
            return load_model(model_dir, config, backend, torch.float32, CPU, tp=tp)

        if job.get("measure_load"):
            from test_meta_loading import allocator_peak_bytes

            stats["load_peak_bytes"], model = allocator_peak_bytes(load)
        else:
            model = load()
        stats["parameter_bytes"] = parameter_bytes(model)
        (job_dir / f"rank{rank}.json").write_text(json.dumps(stats))
        if job["prompts"]:
            if can_prepack(CPU, torch.float32):
                prepack_linears(model)  # as the engine does on a CPU: the sharded linears are plain nn.Linear
            logits = run_steps(model, job)
            if logits is not None:
                save_file(
                    {f"seq{i}": t.contiguous() for i, t in enumerate(logits)}, str(job_dir / "logits.safetensors")
                )
        dist.barrier()  # no rank leaves while another may still need it
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))
