"""The embedded engine: in-process continuous batching over a static KV cache (`engine.py`, whose
docstring says who owns which thread). Its parts: the request inbox (`inbox.py`), the scheduler
thread (`scheduler.py`), the forward passes over the slot batch (`batch_forward.py`, the fused
decode/prefill of `decode.py`), the static KV cache (`kv_cache.py`), the radix prefix cache and its
use around a prefill (`prefix_cache.py`, `prefix_reuse.py`), checked weight updates
(`weight_source.py`). The rollout precision it computes in is `axrl/inference/quant.py`, shared with
replay and the server engines' launch flags."""

from axrl.inference.embedded.engine import EmbeddedEngine

__all__ = ["EmbeddedEngine"]
