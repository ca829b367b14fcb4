"""`EngineSettings`: the embedded engine's constructor knobs, owned here and composed by the YAML
section `rollout` (`RolloutSection` extends it), so YAML and Python share one set of defaults and
one validation. `axrl.runtime.components.make_embedded_engine` builds the engine from it."""

from __future__ import annotations

from pydantic import Field

from axrl.core.settings import Section
from axrl.inference.quant import KVDtype, Precision, WeightDtype

__all__ = ["EngineSettings"]


class EngineSettings(Section):
    """The embedded engine's constructor knobs (slots, context, prefix cache, precision): the
    YAML section `rollout`'s engine keys (`RolloutSection` extends this type; one set of defaults
    and validation for the YAML and Python)."""

    max_context_len: int = Field(512, ge=8)
    max_batch_size: int = Field(64, ge=1, description="engine slots (concurrent sequences)")
    prefix_cache: bool = Field(True, description="embedded engine: reuse the K/V of cached prompt prefixes "
                                                 "(earlier turns, a group's shared prompt); docs/prefix-merge.md")
    prefix_cache_tokens: int = Field(0, ge=0, description="embedded engine: prefix-cache pool in tokens "
                                                          "(0 = max_batch_size × max_context_len)")
    weight_dtype: WeightDtype = Field(
        "fp32", description="precision of the rollout engine's linear weights, quantised from the trainer's at "
                            "every sync (fp8: e4m3, 128×128 block scales; router, lm_head, embeddings and norms "
                            "keep model.dtype); docs/debugging.md \"Low-precision rollout\"")
    precision: Precision = Field(
        "auto", description="rollout numerics as a recipe: auto = weight_dtype alone; fp8_w8a8 = block-fp8 weights "
                            "and fp8 activations (one dynamic scale per token and 128 channels) into every "
                            "quantised linear, as SGLang/vLLM fp8 serving; docs/debugging.md \"Low-precision rollout\"")
    kv_dtype: KVDtype = Field(
        "auto", description="embedded engine: K/V cache precision (auto = model.dtype; fp8: e4m3, one scale per "
                            "token and head)")
    exact: bool = Field(False, description="true on-policy: the embedded engine and the torch trainer run one "
                                            "batch- and position-invariant op set (axrl/model/exact.py), so rollout "
                                            "logprobs and MoE routing equal the trainer's bitwise; docs/train.md "
                                            "\"True on-policy\"")

    def engine_settings(self) -> "EngineSettings":
        """This object's `EngineSettings` fields alone (a `RolloutSection`'s other keys left out)."""
        return EngineSettings(**{name: getattr(self, name) for name in EngineSettings.model_fields})
