"""Every type that crosses between the frontend and a scheduler process: the messages, SamplingParams, the enums.

Torch-free on purpose (a test keeps it so): the frontend process imports this package and must never load torch.
"""
