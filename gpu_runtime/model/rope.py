"""Rotary position embeddings: inverse frequencies (default, linear, llama3 and longrope scaling) and a cos/sin
table; a partial rotary (Phi-4-mini) rotates each head's first dimensions and leaves the rest."""

from __future__ import annotations

import math

import torch

from gpu_runtime.model.config import RopeConfig


def rotary_dim(rope: RopeConfig, head_dim: int) -> int:
    """The dimensions of each head that rotate (all of them unless partial_rotary_factor says fewer)."""
    return int(head_dim * rope.partial_rotary_factor)


def inverse_frequencies(rope: RopeConfig, head_dim: int, long: bool = False) -> torch.Tensor:
    """Per-pair rotation frequencies, computed exactly as transformers does so outputs match bit for bit (`head_dim`:
    the rotated dimensions; `long`: longrope's set for the positions past its original context)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").to(torch.float32) / head_dim
    if rope.rope_type == "longrope":
        factors = torch.tensor(rope.long_factor if long else rope.short_factor, dtype=torch.float32)
        return 1.0 / (factors * rope.theta**exponents)
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.rope_type == "llama3":
        inv_freq = _llama3_scaled(inv_freq, rope)
    elif rope.rope_type == "linear":  # positions interpolated: every frequency slowed by `factor` (Gemma 3's global)
        inv_freq = inv_freq / rope.factor
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
        self.head_dim = head_dim = rotary_dim(rope, head_dim)  # the rotated dimensions, the tables' width
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
        if self.rope.rope_type == "longrope":
            # The long factors rotate the positions past the original context. transformers picks one set per
            # forward instead (long for every position once its longest passes it), which no cache of rotated keys
            # can follow; within the original context both are the short set, so outputs there are equal.
            long = torch.outer(positions, inverse_frequencies(self.rope, self.head_dim, long=True).to(device))
            beyond = positions[:, None] >= self.rope.original_max_position_embeddings
            freqs = torch.where(beyond, long, freqs)
        angles = torch.cat((freqs, freqs), dim=-1)
        # The sine's first half negated: rotate_half(x) * sin is then roll(x) * signed_sin, one op fewer per layer
        # and the same numbers (negating a product's factor instead of the product is exact).
        half = self.head_dim // 2
        cos, sin = angles.cos(), angles.sin()
        if self.rope.attention_factor != 1.0:  # longrope's scaling of cos and sin, as transformers applies it
            cos, sin = cos * self.rope.attention_factor, sin * self.rope.attention_factor
        signed_sin = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)
        return cos.to(dtype), signed_sin.to(dtype)

    def at(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The [tokens, 1, head_dim] cos and signed sin rows of these positions: looked up once per step, for every
        layer."""
        return self.cos_table[positions].unsqueeze(1), self.sin_table[positions].unsqueeze(1)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return apply_rotary(x, *self.at(positions))


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """RoPE on [tokens, heads, head_dim] (queries and keys side by side, in one pass): transformers'
    x * cos + rotate_half(x) * sin, with rotate_half(x) = (-x2, x1) written as roll(x) = (x2, x1) times a sine whose
    first half is negated. Tables narrower than the heads (a partial rotary) rotate their first dimensions only."""
    dim = cos.shape[-1]
    if dim < x.shape[-1]:
        rotated = x[..., :dim]
        return torch.cat((rotated * cos + rotated.roll(dim // 2, dims=-1) * signed_sin, x[..., dim:]), dim=-1)
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin
