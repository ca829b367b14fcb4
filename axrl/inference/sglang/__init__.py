"""The SGLang rollout engine: an HTTP client implementing `InferenceEngine` over SGLang's API
(`client`), a launcher for server processes (`launcher`), weight transport (`weight_sync`)
and the shared wire format (`wire`). `axrl serve` speaks the same API, so either server works."""

from axrl.inference.sglang.launcher import SGLangLauncher

__all__ = ["SGLangEngine", "SGLangLauncher"]


def __getattr__(name: str):  # the client pulls in httpx + asyncio machinery only when used
    if name == "SGLangEngine":
        from axrl.inference.sglang.client import SGLangEngine

        return SGLangEngine
    raise AttributeError(name)
