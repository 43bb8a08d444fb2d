"""tokend's GPU runtime: the model, the paged KV cache, and the continuous-batching engine."""

from gpu_runtime.engine import LLMEngine
from gpu_runtime.engine_config import EngineConfig
from gpu_runtime.llm import LLM
from gpu_runtime.outputs import CompletionOutput, Logprob, RequestOutput, StepOutput
from gpu_runtime.sampling_params import SamplingParams

__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineConfig",
    "LLMEngine",
    "Logprob",
    "RequestOutput",
    "SamplingParams",
    "StepOutput",
]
