"""The token embedding as the models build it: its weight left for the loader to fill."""

from __future__ import annotations

import torch
from torch import nn


def unfilled_embedding(num_embeddings: int, embedding_dim: int) -> nn.Embedding:
    """nn.Embedding(num_embeddings, embedding_dim) without its random initialisation. The models are built on the
    meta device, where nn.Embedding's own init (normal_) runs torch's Python reference of it, whose first call
    imports torch._dynamo: 1-2 s of every scheduler's start, for values the checkpoint overwrites."""
    return nn.Embedding(num_embeddings, embedding_dim, _weight=torch.empty(num_embeddings, embedding_dim))
