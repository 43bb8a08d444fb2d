"""Tensor parallelism's processes: rank 0 (the scheduler's engine) starts the other ranks and sends them each step."""
