"""The vLLM rollout engine: a client implementing `InferenceEngine` over vLLM's token-in/token-out
API (`client`, `wire`), its weight route (`weight_updater`) and the factory that launches or
connects to servers (`factory`). Launching, health, port claims and retries are shared with the
SGLang engine (`axrl/inference/remote`)."""

__all__ = ["VLLMEngine"]


def __getattr__(name: str):  # the client pulls in httpx + asyncio machinery only when used
    if name == "VLLMEngine":
        from axrl.inference.vllm.client import VLLMEngine

        return VLLMEngine
    raise AttributeError(name)
