"""A sparse Mixture-of-Experts MLP (Mixtral, Qwen3-MoE) and the decoders built with it.

The router (a linear layer to one logit per expert) picks each token's top_k experts by softmax probability; the
token's output is the sum of those experts' gated MLPs, each weighted by its probability (renormalised over the
top_k where the family does so: Mixtral always, Qwen3-MoE when norm_topk_prob). The experts' weights are stacked,
[num_experts, rows, columns], and run as grouped matmuls: the (token, expert) assignments are sorted by expert, and
each expert that has tokens runs one matmul over all of them. The loop is over experts, never over tokens, so a
step's cost is at most num_experts matmul pairs per layer whatever the batch.

Under tensor parallelism every expert is split the Megatron way (tensor_parallel.py): each rank holds 1/N of every
expert's gate/up rows (column-parallel) and the matching columns of down (row-parallel), routes every token itself
(the router is replicated, so every rank picks the same experts), and one all-reduce adds the partial sums.
"""

from __future__ import annotations

import torch
from torch import nn

from gpu_runtime.attention.backend import AttentionBackend
from gpu_runtime.model.config import ModelConfig
from gpu_runtime.model.cpu_weights import StackedMatrices, pack_matrix, packed_matmul
from gpu_runtime.model.llama import ACTIVATIONS, MLP, Attention, DecoderLayer, LlamaForCausalLM, window_options
from gpu_runtime.model.moe_kernel import load_grouped_matmul
from gpu_runtime.model.qwen3 import QKNormAttention
from gpu_runtime.model.tensor_parallel import TensorParallel


class Experts(StackedMatrices):
    """The experts' gated MLPs as two stacked parameters: gate_up_proj [experts, 2 * width, hidden] (each expert's
    gate rows, then its up rows) and down_proj [experts, hidden, width].

    On a CPU in float32 the loader prepares them as it packs every nn.Linear (prepack(), from cpu_weights'
    prepack_linears): the grouped-matmul kernel (moe_kernel.py) then runs every expert's rows in one call that
    reads each touched expert's weights once; where it cannot be built, each expert's matrices are packed for
    oneDNN. Either beats a plain F.linear per expert, which repacks the expert's weight at every call
    (scripts/bench_moe.py)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        moe = config.moe
        self.width = moe.intermediate_size  # a rank's share under tensor parallelism
        self.gate_up_proj = nn.Parameter(torch.empty(moe.num_experts, 2 * self.width, config.hidden_size))
        self.down_proj = nn.Parameter(torch.empty(moe.num_experts, config.hidden_size, self.width))
        self.act = ACTIVATIONS[config.hidden_act]
        self.grouped_matmul = None  # the CPU kernel, once prepack() found it
        self.packed: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # per expert (gate_up, down), if packed

    def prepack(self) -> None:
        self.grouped_matmul = load_grouped_matmul()
        if self.grouped_matmul is not None:
            return  # the kernel reads the stacked parameters as they are
        # Each expert's matrices packed, the stacked parameters dropped (the packed copies are buffers, counted in
        # the model's bytes).
        self.packed = []
        for expert, (gate_up, down) in enumerate(zip(self.gate_up_proj, self.down_proj, strict=True)):
            self.packed.append((pack_matrix(gate_up), pack_matrix(down)))
            self.register_buffer(f"packed_gate_up_{expert}", self.packed[-1][0], persistent=False)
            self.register_buffer(f"packed_down_{expert}", self.packed[-1][1], persistent=False)
        self.gate_up_proj = self.down_proj = None

    def _grouped(self, routed: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Every expert's rows through its gated MLP, two kernel calls for all of them."""
        gate, up = self.grouped_matmul(routed, counts, self.gate_up_proj).split(self.width, dim=-1)
        return self.grouped_matmul(self.act(gate) * up, counts, self.down_proj)

    def _expert(self, expert: int, rows: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            gate_up, down = self.packed[expert]
            gate, up = packed_matmul(rows, gate_up).split(self.width, dim=-1)
            return packed_matmul(self.act(gate) * up, down)
        gate, up = nn.functional.linear(rows, self.gate_up_proj[expert]).split(self.width, dim=-1)
        return nn.functional.linear(self.act(gate) * up, self.down_proj[expert])

    def forward(self, x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """[tokens, hidden]: each token's chosen experts ([tokens, top_k] ids) weighted by `weights`, summed."""
        top_k = chosen.shape[1]
        flat = chosen.flatten()
        order = flat.argsort(stable=True)  # assignments grouped by expert, tokens in order within each
        num_experts = len(self.packed) if self.packed is not None else self.gate_up_proj.shape[0]
        counts = torch.bincount(flat, minlength=num_experts)
        token_of = order // top_k
        routed = x.index_select(0, token_of)  # [tokens * top_k, hidden], expert by expert
        if self.grouped_matmul is not None and routed.dtype == torch.float32 and routed.device.type == "cpu":
            out = self._grouped(routed, counts)
        else:
            out = torch.empty_like(routed)
            start = 0
            for expert, count in enumerate(counts.tolist()):  # one host read per layer
                if count:
                    out[start : start + count] = self._expert(expert, routed[start : start + count])
                start += count
        # Back in (token, choice) order, each token's k outputs weighted and summed. (Not index_add_ into the
        # tokens' rows: on a CPU that is a serial scatter, 50 times the experts' matmuls at batch 1.)
        by_token = torch.empty_like(out).index_copy_(0, order, out).view(-1, top_k, out.shape[-1])
        return (by_token * weights.unsqueeze(-1)).sum(dim=1)


class SparseMoeBlock(nn.Module):
    """Router and experts: transformers' MixtralSparseMoeBlock / Qwen3MoeSparseMoeBlock."""

    def __init__(self, config: ModelConfig, tp: TensorParallel | None = None):
        super().__init__()
        self.top_k = config.moe.top_k
        self.renormalize = config.moe.renormalize
        self.gate = nn.Linear(config.hidden_size, config.moe.num_experts, bias=False)  # the router, replicated
        self.experts = Experts(config)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(self.gate(x), dim=-1, dtype=torch.float32)  # in float32, as transformers routes
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        out = self.experts(x, chosen, weights.to(x.dtype))
        return out if self.tp is None else self.tp.all_reduce(out)


class MixtralForCausalLM(LlamaForCausalLM):
    """Llama's decoder with every MLP sparse, under the checkpoint's name block_sparse_moe."""

    def make_layer(self, config: ModelConfig, backend: AttentionBackend, tp: TensorParallel | None, index: int):
        attention = Attention(config, backend, tp, window_options(config))  # Mistral's, its window if any
        return DecoderLayer(config, attention, SparseMoeBlock(config, tp), "block_sparse_moe")


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    """Qwen3's attention (per-head q/k norms); each layer's MLP sparse or dense as config.moe.layers says
    (decoder_sparse_step, mlp_only_layers)."""

    def make_layer(self, config: ModelConfig, backend: AttentionBackend, tp: TensorParallel | None, index: int):
        sparse = config.moe is not None and config.moe.layers[index]
        mlp = SparseMoeBlock(config, tp) if sparse else MLP(config, tp)
        return DecoderLayer(config, QKNormAttention(config, backend, tp), mlp)
