"""Rollout: paged KV cache, sampling with logprobs, pure prefill/decode steps, and the engine."""

from dora_jax.rollout.engine import Engine, EngineError, EngineLoad, StepReport
from dora_jax.rollout.page_allocator import OutOfPages, PageAllocator
from dora_jax.rollout.requests import EngineFinished, ExportedRequests, Request, request_key
from dora_jax.rollout.sampling import SamplingParams, sample

__all__ = [
    "Engine",
    "EngineError",
    "EngineLoad",
    "ExportedRequests",
    "EngineFinished",
    "OutOfPages",
    "PageAllocator",
    "Request",
    "SamplingParams",
    "StepReport",
    "request_key",
    "sample",
]
