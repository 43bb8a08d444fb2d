"""The scheduler process: one per GPU group, driving an LLMEngine and talking to the frontend over ZeroMQ."""
