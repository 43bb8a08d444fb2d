"""Weights served in their GGUF blocks: the CPU kernel (csrc/), its loader, and the modules that call it."""
