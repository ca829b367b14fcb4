"""Inference engines behind one protocol (`protocol.py`, SGLang semantics): the embedded PyTorch
engine (`embedded/`), the SGLang and vLLM clients (`sglang/`, `vllm/`, on what both share in
`remote/`), teacher-forced scorers for each (`scoring/`), `axrl serve` (`serve/`) and the
OpenAI-compatible front-end it and the agent proxy share (`openai/`)."""

from axrl.inference.embedded import EmbeddedEngine
from axrl.inference.protocol import GenerateRequest, GenerateResult, InferenceEngine, SamplingParams

__all__ = ["EmbeddedEngine", "GenerateRequest", "GenerateResult", "InferenceEngine", "SamplingParams"]
