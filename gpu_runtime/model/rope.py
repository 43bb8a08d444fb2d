"""Rotary position embeddings: inverse frequencies (default and llama3 scaling) and a cos/sin table."""

from __future__ import annotations

import math

import torch

from gpu_runtime.model.config import RopeConfig


def inverse_frequencies(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """Per-pair rotation frequencies, computed exactly as transformers does so outputs match bit for bit."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").to(torch.float32) / head_dim
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.rope_type == "llama3":
        inv_freq = _llama3_scaled(inv_freq, rope)
    return inv_freq


def _llama3_scaled(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
    old_len = rope.original_max_position_embeddings
    low_freq_wavelen = old_len / rope.low_freq_factor
    high_freq_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(torch.nn.Module):
    """Applies RoPE to flattened [tokens, heads, head_dim] queries and keys at arbitrary positions.

    Built under a meta device (the loader's way), its cos/sin tables are placeholders until
    `compute_tables` fills them on the device the model was materialised on.
    """

    def __init__(self, rope: RopeConfig, head_dim: int, max_positions: int, dtype: torch.dtype):
        super().__init__()
        self.rope = rope
        self.head_dim = head_dim
        self.max_positions = max_positions
        device = torch.empty(0).device  # the ambient one: a `with torch.device(...)` block's, else the default
        if device.type == "meta":
            cos = sin = torch.empty((max_positions, head_dim), dtype=dtype)
        else:
            cos, sin = self._tables(dtype, device)
        self.register_buffer("cos_table", cos, persistent=False)
        self.register_buffer("sin_table", sin, persistent=False)

    def compute_tables(self) -> None:
        """Fills the cos/sin tables for real, in their dtype on their device (after `to_empty`)."""
        self.cos_table, self.sin_table = self._tables(self.cos_table.dtype, self.cos_table.device)

    def _tables(self, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        # The frequencies on the CPU, as transformers computes them at init; the angles on the device, as its
        # forward does.
        inv_freq = inverse_frequencies(self.rope, self.head_dim).to(device)
        positions = torch.arange(self.max_positions, dtype=torch.float32, device=device)
        freqs = torch.outer(positions, inv_freq)
        angles = torch.cat((freqs, freqs), dim=-1)
        # The sine's first half negated: rotate_half(x) * sin is then roll(x) * signed_sin, one op fewer per layer
        # and the same numbers (negating a product's factor instead of the product is exact).
        half = self.head_dim // 2
        sin = angles.sin()
        signed_sin = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)
        return angles.cos().to(dtype), signed_sin.to(dtype)

    def at(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The [tokens, 1, head_dim] cos and signed sin rows of these positions: looked up once per step, for every
        layer."""
        return self.cos_table[positions].unsqueeze(1), self.sin_table[positions].unsqueeze(1)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return apply_rotary(x, *self.at(positions))


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """RoPE on [tokens, heads, head_dim] (queries and keys side by side, in one pass): transformers'
    x * cos + rotate_half(x) * sin, with rotate_half(x) = (-x2, x1) written as roll(x) = (x2, x1) times a sine whose
    first half is negated."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin
