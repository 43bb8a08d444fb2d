"""The CUDA backend whose Triton kernels read K/V in place in the page pool: split-KV decode, varlen prefill.

`plan` fills the step's int32 tables once (triton_plan.py); each layer's `forward` stores its new K/V in the pages,
then makes at most three launches: the decodes' partitions and their combine, and one for every prompt chunk of the
step together. Every option a layer can ask for (scale, sliding window, soft-capped logits) is in the kernels.

On a CPU it runs only under Triton's interpreter (TRITON_INTERPRET=1, set before triton is first imported): slow,
for tests; `auto` never picks it there.
"""

from __future__ import annotations

import torch

from gpu_runtime.attention.backend import AttentionBackend, LayerAttentionOptions, require_planned
from gpu_runtime.attention.metadata import AttentionMetadata
from gpu_runtime.attention.pages import write_pages
from gpu_runtime.attention.triton_plan import StepBuffers, TritonStepPlan, TritonTuning, decode_partition_size


def _power_of_two_at_least(n: int, floor: int = 16) -> int:
    # Triton's tiles are powers of two, and tl.dot's sides at least 16: the masks hide the padding.
    return max(floor, 1 << (n - 1).bit_length())


class TritonPagedAttention(AttentionBackend):
    name = "triton"
    reads_group_tables = False  # its plan copies the one block table into its kernels' buffers

    def __init__(self, device: torch.device, tuning: TritonTuning | None = None) -> None:
        self._kernels = _kernels_for(device)
        self._tuning = tuning or TritonTuning()
        self._buffers = StepBuffers.on(device)
        self._step: TritonStepPlan | None = None
        self._partials: tuple[torch.Tensor, ...] | None = None  # split-KV scratch: _partial_buffers

    @classmethod
    def create(cls, device: torch.device) -> TritonPagedAttention:
        _kernels_for(device)
        tuning = TritonTuning()
        if device.type == "cuda":
            tuning = TritonTuning(num_sms=torch.cuda.get_device_properties(device).multi_processor_count)
        return cls(device, tuning)

    def check_options(self, options: LayerAttentionOptions) -> None:
        pass  # scale, window and soft-cap are all in the kernels

    def plan(self, meta: AttentionMetadata) -> None:
        self._step = TritonStepPlan.of(meta, self._buffers)

    def forward(self, q, k, v, k_pages, v_pages, meta: AttentionMetadata, options: LayerAttentionOptions):
        step = require_planned(self._step, meta, self.name)
        write_pages(k, v, k_pages, v_pages, meta.slot_mapping)
        q = q if q.stride(-1) == 1 else q.contiguous()  # the kernels step through a head's dims one by one
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # every row is a decode's or a chunk's
        if step.decode is not None:
            self._decode(q, k_pages, v_pages, out, step, options)
        if step.prefill is not None:
            self._prefill(q, k_pages, v_pages, out, step, options)
        return out

    def _decode(self, q, k_pages, v_pages, out, step: TritonStepPlan, options: LayerAttentionOptions) -> None:
        tables = step.decode
        num_heads, head_dim = q.shape[1], q.shape[2]
        num_kv_heads, page_size = k_pages.shape[2], k_pages.shape[1]
        group = num_heads // num_kv_heads
        block_d = _power_of_two_at_least(head_dim)
        window = options.sliding_window
        partition = decode_partition_size(step.decode_span(window), tables.num_seqs, num_kv_heads, self._tuning)
        num_parts = -(-step.decode_span(window) // partition)
        part_acc, part_max, part_sum = self._partial_buffers(tables.num_seqs * num_heads * num_parts, block_d, q.device)
        common = dict(window=window or 0, partition_size=partition, max_partitions=num_parts,
                      stride_o_row=out.stride(0), stride_o_head=out.stride(1), NUM_HEADS=num_heads,
                      HEAD_DIM=head_dim, BLOCK_D=block_d, USE_WINDOW=window is not None)  # fmt: skip
        self._kernels.decode_partition_kernel[(tables.num_seqs, num_kv_heads, num_parts)](
            q, k_pages, v_pages, out, tables.block_table, tables.context_lens, tables.query_rows,
            part_acc, part_max, part_sum, options.scale, options.logit_softcap or 0.0,
            stride_q_row=q.stride(0), stride_q_head=q.stride(1), stride_table=tables.block_table.stride(0),
            **_page_strides(k_pages, v_pages), GROUP=group, BLOCK_G=_power_of_two_at_least(group),
            PAGE_SIZE=page_size, BLOCK_N=self._tuning.decode_block_n, USE_SOFT_CAP=options.logit_softcap is not None,
            ONE_PARTITION=num_parts == 1, DOT_PRECISION=_dot_precision(q), **common,
        )  # fmt: skip
        if num_parts > 1:
            self._kernels.decode_combine_kernel[(tables.num_seqs, num_heads)](
                out, tables.context_lens, tables.query_rows, part_acc, part_max, part_sum,
                BLOCK_P=_power_of_two_at_least(num_parts, floor=1), **common,
            )  # fmt: skip

    def _prefill(self, q, k_pages, v_pages, out, step: TritonStepPlan, options: LayerAttentionOptions) -> None:
        tables = step.prefill
        num_heads, head_dim = q.shape[1], q.shape[2]
        num_kv_heads, page_size = k_pages.shape[2], k_pages.shape[1]
        group = num_heads // num_kv_heads
        block_m = max(self._tuning.prefill_block_m, _power_of_two_at_least(group))
        block_q = block_m // group  # whole queries per program: a group that is not a power of two leaves rows idle
        programs, num_programs = step.prefill_grid(block_q)
        self._kernels.prefill_kernel[(num_programs, num_kv_heads)](
            q, k_pages, v_pages, out, tables.block_table, tables.chunks, programs,
            options.scale, options.logit_softcap or 0.0, options.sliding_window or 0,
            stride_q_row=q.stride(0), stride_q_head=q.stride(1), stride_o_row=out.stride(0),
            stride_o_head=out.stride(1), stride_table=tables.block_table.stride(0), **_page_strides(k_pages, v_pages),
            GROUP=group, BLOCK_Q=block_q, BLOCK_M=block_m, HEAD_DIM=head_dim,
            BLOCK_D=_power_of_two_at_least(head_dim), PAGE_SIZE=page_size, BLOCK_N=self._tuning.prefill_block_n,
            USE_SOFT_CAP=options.logit_softcap is not None, USE_WINDOW=options.sliding_window is not None,
            DOT_PRECISION=_dot_precision(q),
        )  # fmt: skip

    def _partial_buffers(self, num_slots: int, block_d: int, device: torch.device):
        """Split-KV scratch for `num_slots` (sequence, head, partition) triples: float32 sums [slots, block_d],
        maxima and denominators [slots]; kept between steps and layers, regrown (doubling) only when one needs more."""
        acc, maxima, sums = self._partials or (None, None, None)
        if maxima is None or maxima.numel() < num_slots or acc.numel() < num_slots * block_d:
            slots = max(num_slots, 2 * (maxima.numel() if maxima is not None else 0))
            acc = torch.empty(slots * block_d, dtype=torch.float32, device=device)
            maxima = torch.empty(slots, dtype=torch.float32, device=device)
            sums = torch.empty(slots, dtype=torch.float32, device=device)
            self._partials = (acc, maxima, sums)
        return acc, maxima, sums


def _page_strides(k_pages: torch.Tensor, v_pages: torch.Tensor) -> dict[str, int]:
    """The pools' strides, which the kernels take once for both: a token's K and V rows sit at the same offset."""
    if k_pages.stride() != v_pages.stride() or k_pages.stride(-1) != 1:
        raise ValueError("attention backend triton: the K and V pools must share one layout, head dimension last")
    return dict(stride_page=k_pages.stride(0), stride_slot=k_pages.stride(1), stride_head=k_pages.stride(2))


def _dot_precision(q: torch.Tensor) -> str:
    # float32 models get float32 products (a GPU's default TF32 would cost about 1e-3 relative); half-precision
    # inputs are exact in any mode.
    return "ieee" if q.dtype == torch.float32 else "tf32"


def _kernels_for(device: torch.device):
    """The kernels' module, where they can run on `device`; else ValueError naming why. Whether they are compiled
    or interpreted was decided as the module was first imported (Triton reads TRITON_INTERPRET as it decorates)."""
    try:
        from gpu_runtime.attention import triton_kernels
    except ImportError as error:
        raise ValueError(f"attention_backend: triton cannot be imported here ({error})") from error
    import triton
    from triton.runtime.interpreter import InterpretedFunction

    # Interpreted kernels also need the variable while they run (parts of triton.language read it at each call).
    interpreted = isinstance(triton_kernels.prefill_kernel, InterpretedFunction) and triton.knobs.runtime.interpret
    if device.type != "cuda" and not interpreted:
        raise ValueError(
            f"attention_backend: triton needs a CUDA device, not {device}; on a CPU it runs only under Triton's "
            "interpreter, for tests (TRITON_INTERPRET=1 set before its kernels are first imported)"
        )
    return triton_kernels
