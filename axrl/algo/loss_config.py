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
        `correction` names `tis`); tis_cap is also the cap of the `tis_*` diagnostics. `tis: null`
        (the default) is the default correction: token TIS applies only when `correction` names no
        correction — naming one (e.g. `{mis: …}`) replaces it, and `tis: true` asks for both.
        `tis: false`: off. The same in YAML and Python (`PolicyLossConfig()` has token TIS;
        `PolicyLossConfig(correction={"mis": …})` has MIS only). Not decoupled runs only: a
        decoupled loss's token weight is the behaviour weight below.
    decoupled: decoupled PPO (AReaL) — every loss token is weighted by the behaviour weight
        w_t = π_prox/μ = exp(old − rollout), a plain importance weight, uncapped unless
        `behaviour_weight_cap`. null: follow `runtime.mode` (true in asynchronous runs, where
        μ is a stale engine; resolved by `axrl.assembly.settings.loss_config`; a bare
        PolicyLossConfig with null is not decoupled). The weight is the token-level `tis`
        correction with cap `behaviour_weight_cap` (None: no cap), replacing the `tis` short form;
        an explicit `correction.tis` is used as the behaviour weight instead. Switching it off in a
        decoupled loss (`tis: false`, `correction.tis: null`) is refused: set `decoupled: false`.
    behaviour_weight_cap: truncate the behaviour weight at this value (null: uncapped, AReaL's
        default); only with a decoupled loss.
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
    tis: bool | None = Field(None, description="short form of correction.tis (token level, cap tis_cap); not "
                                               "decoupled runs. null: on only when algo.correction names no "
                                               "correction; true: on beside the named ones; false: off")
    tis_cap: float = Field(2.0, gt=0)
    decoupled: bool | None = Field(None, description="decoupled PPO: weight every loss token by π_prox/μ (the "
                                                     "behaviour weight); null: on in asynchronous runs")
    behaviour_weight_cap: float | None = Field(None, gt=0, description="truncate the decoupled behaviour weight "
                                                                       "at this value (null: uncapped)")
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
        self._corrections(undecided_ok=True)  # decoupled: null is decided by the run's mode (`resolved`)
        return self

    def resolved(self, asynchronous: bool) -> "PolicyLossConfig":
        """This loss config for a run of the given mode: `decoupled: null` becomes true in an
        asynchronous run (left null, i.e. off, in a synchronous one, so a default sync config stays
        equal to `PolicyLossConfig()`). Validated: a combination refused for the run's mode raises
        ValueError naming `algo.<key>`."""
        if self.decoupled is not None or not asynchronous:
            self.corrections()
            return self
        out = self.model_copy(update={"decoupled": True})
        out.corrections()
        return out

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

    def tis_short_form(self) -> bool:
        """Whether the `tis` short form adds token TIS (cap tis_cap) to a loss that is not decoupled:
        `tis: true`, or `tis: null` (the default) with no correction named in `correction`."""
        if self.tis is not None:
            return self.tis
        return not any(args is not None for args in self.correction.values()) and "tis" not in self.correction

    def effective_corrections(self) -> dict[str, dict[str, Any]]:
        """{name: parameters} of the corrections in effect — what `axrl train` prints at start and
        stores in the manifest (`extra.corrections`); {} when none."""
        return {c.name: params.model_dump(mode="json") for c, params in self.corrections()}

    def corrections(self) -> list[tuple[Any, BaseModel]]:
        """The corrections in effect with their validated parameters, in a fixed (name) order."""
        return self._corrections(undecided_ok=False)

    def _corrections(self, undecided_ok: bool) -> list[tuple[Any, BaseModel]]:
        from axrl.algo.corrections import CORRECTIONS

        chosen = dict(self.correction)
        if self.decoupled:
            self._check_decoupled()
            if "tis" not in chosen:
                chosen["tis"] = {"level": "token", "cap": self.behaviour_weight_cap}
        else:
            if self.behaviour_weight_cap is not None and not (undecided_ok and self.decoupled is None):
                raise ValueError("algo.behaviour_weight_cap caps the behaviour weight of decoupled PPO (asynchronous "
                                 "runs, or algo.decoupled: true); this loss is not decoupled: cap its TIS weight "
                                 "with algo.tis_cap or correction.tis.cap")
            if self.tis_short_form() and "tis" not in chosen:
                chosen["tis"] = {"level": "token", "cap": self.tis_cap}
        return [(CORRECTIONS.get(name), CORRECTIONS.params(name, args, f"algo.correction.{name}"))
                for name, args in sorted(chosen.items()) if args is not None]

    def _check_decoupled(self) -> None:
        """A decoupled loss never drops or silently re-caps its behaviour weight."""
        why = ("decoupled PPO (asynchronous runs) weights every loss token by the behaviour weight "
               "π_prox/μ = exp(old_logprob − rollout_logprob), the token `tis` correction")
        off = ("to train without it (a gradient biased by staleness) set algo.decoupled: false")
        if "tis" in self.correction:
            if self.correction["tis"] is None:
                raise ValueError(f"algo.correction.tis: null would drop the behaviour weight: {why}; {off}")
            if self.behaviour_weight_cap is not None:
                raise ValueError("algo.behaviour_weight_cap and algo.correction.tis both set the behaviour weight of "
                                 "decoupled PPO; keep one (correction.tis.cap caps it)")
            return
        if self.tis is False:
            raise ValueError(f"algo.tis: false would drop the behaviour weight: {why}; {off}")
        if self.tis_cap != PolicyLossConfig.model_fields["tis_cap"].default:
            raise ValueError(f"algo.tis_cap ({self.tis_cap:g}) caps the TIS weight of runs that are not decoupled; "
                             "the behaviour weight of decoupled PPO is uncapped unless algo.behaviour_weight_cap: "
                             f"set algo.behaviour_weight_cap: {self.tis_cap:g} to cap it (or leave tis_cap at its "
                             "default)")
