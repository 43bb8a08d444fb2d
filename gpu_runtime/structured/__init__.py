"""Structured outputs: a request's StructuredOutput compiled into an llguidance matcher (compiler.py, torch-free, also
used by the frontend to refuse bad specs before admission) and applied to each step's logits (masks.py)."""
