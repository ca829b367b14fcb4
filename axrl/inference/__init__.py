"""Inference engines behind one protocol (SGLang semantics): the embedded PyTorch engine here,
the SGLang HTTP client elsewhere in this package."""

from axrl.inference.embedded import EmbeddedEngine
from axrl.inference.protocol import GenerateRequest, GenerateResult, InferenceEngine, SamplingParams

__all__ = ["EmbeddedEngine", "GenerateRequest", "GenerateResult", "InferenceEngine", "SamplingParams"]
