"""`PolicyLossConfig`: the knobs of the policy loss — the one schema behind both the YAML `algo`
section (which adds the advantage knobs to it, `axrl.config.AlgoSection`) and `PolicyLoss`.

One type, one set of defaults, one validation: a value that the YAML refuses, the loss refuses
too, with the same message naming `algo.<key>`. Light on purpose (pydantic only): reading a
config never imports torch; the objective and correction registries are consulted lazily.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from axrl.algo.modes import KLEstimator, LossAgg

__all__ = ["PolicyLossConfig"]


class PolicyLossConfig(BaseModel):
    """Knobs of the policy loss (`axrl.algo.losses` has the formulas).

    loss / loss_args: the objective's registry name and its parameters (validated by it).
    correction: {name: params} of the rollout↔trainer corrections (validated by each; None = off).
    clip_low / clip_high: ε_low, ε_high of the ratio band [1 − ε_low, 1 + ε_high].
    dual_clip: c > 1 for dual-clip PPO, None to disable.
    tis / tis_cap: short form of `correction: {tis: {level: token, cap: tis_cap}}` (ignored when
        `correction` names `tis`); tis_cap is also the cap of the `tis_*` diagnostics.
    kl_coef / kl_estimator: β and "k1" | "k2" | "k3" for the KL(π ‖ π_ref) penalty (β > 0 needs
        ref_logprobs). kl_log_ratio_clamp: optional clamp of ref − lp inside the estimator.
    entropy_coef: α of the entropy bonus (subtracted from the loss).
    loss_agg: see `axrl.algo.aggregation`; agg_norm_len: L for "seq-mean-token-sum-norm".
    log_ratio_clamp: lp − old is clamped to [−c, c] before exp, so a wildly off-policy token
        cannot overflow ρ to inf (and inf · 0 → NaN). ±20 (ρ ∈ [2e-9, 5e8]) never binds in a
        sane update. None disables.
    """

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    loss: str = Field("ppo", description="policy objective (docs/algorithms.md): ppo, grpo2, gspo, gspo_token, "
                                         "cispo, topr")
    loss_args: dict[str, Any] = Field(default_factory=dict, description="the objective's own parameters")
    correction: dict[str, dict[str, Any] | None] = Field(
        default_factory=dict, description="rollout↔trainer corrections by name (tis, mis, veto, icepop) → "
                                          "their parameters; null switches one off")
    clip_low: float = Field(0.2, ge=0, le=1)
    clip_high: float = Field(0.28, ge=0)
    dual_clip: float | None = Field(None, gt=1)
    tis: bool = Field(True, description="short form of correction.tis (token level, cap tis_cap)")
    tis_cap: float = Field(2.0, gt=0)
    kl_coef: float = Field(0.0, ge=0, description="KL penalty against the frozen reference (the weights at RL start)")
    kl_estimator: KLEstimator = "k3"
    kl_log_ratio_clamp: float | None = Field(None, gt=0, description="clamp ref − logprob to [−c, c] inside the "
                                                                     "KL estimator (null: off)")
    entropy_coef: float = Field(0.0, ge=0)
    loss_agg: LossAgg = "token-mean"
    agg_norm_len: float | None = Field(None, gt=0, description="L of loss_agg 'seq-mean-token-sum-norm' (Dr. GRPO: "
                                                               "e.g. the longest generation)")
    log_ratio_clamp: float | None = Field(20.0, gt=0, description="clamp logprob − old to [−c, c] before exp "
                                                                  "(null: off)")

    @model_validator(mode="after")
    def _check(self) -> "PolicyLossConfig":
        if self.loss_agg == "seq-mean-token-sum-norm" and self.agg_norm_len is None:
            raise ValueError("loss_agg 'seq-mean-token-sum-norm' needs agg_norm_len > 0 (the constant L it "
                             "divides by, e.g. rollout.max_new_tokens × rollout.max_turns)")
        self.objective_params()
        self.corrections()
        return self

    def loss_fields(self) -> "PolicyLossConfig":
        """This config as a plain `PolicyLossConfig` (a YAML `algo` section minus its advantage knobs),
        already validated: what the loss and the trainer's settings carry."""
        if type(self) is PolicyLossConfig:
            return self
        return PolicyLossConfig.model_construct(**{k: getattr(self, k) for k in PolicyLossConfig.model_fields})

    def objective_params(self) -> BaseModel:
        """The objective's validated parameters (ValueError naming `algo.loss_args.<key>`)."""
        from axrl.algo.objectives import OBJECTIVES  # torch code: only when a loss is really checked

        return OBJECTIVES.params(self.loss, self.loss_args, "algo.loss_args")

    def corrections(self) -> list[tuple[Any, BaseModel]]:
        """The corrections in effect with their validated parameters, in a fixed (name) order."""
        from axrl.algo.corrections import CORRECTIONS

        chosen = dict(self.correction)
        if self.tis and "tis" not in chosen:
            chosen["tis"] = {"level": "token", "cap": self.tis_cap}
        return [(CORRECTIONS.get(name), CORRECTIONS.params(name, args, f"algo.correction.{name}"))
                for name, args in sorted(chosen.items()) if args is not None]
