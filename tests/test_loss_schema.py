"""One schema for the policy loss: the YAML `algo` section *is* a `PolicyLossConfig` (plus the
advantage knobs), so the YAML and the loss share their defaults, their validation and every knob."""

from __future__ import annotations

import pytest

from axrl.algo import PolicyLossConfig
from axrl.assembly.settings import loss_config, step_settings
from axrl.config import AlgoSection, ConfigError, load_config


def test_the_yaml_defaults_are_the_loss_defaults() -> None:
    assert loss_config(load_config(None)) == PolicyLossConfig()
    assert set(PolicyLossConfig.model_fields) <= set(AlgoSection.model_fields)


@pytest.mark.parametrize("key, value", [("agg_norm_len", 96.0), ("log_ratio_clamp", 5.0),
                                        ("kl_log_ratio_clamp", 10.0), ("tis_cap", 1.5)])
def test_every_loss_knob_reaches_the_loss_from_yaml(key: str, value: float) -> None:
    base = ["algo.loss_agg=seq-mean-token-sum-norm", "algo.agg_norm_len=64"]
    cfg = load_config(None, [*base, f"algo.{key}={value}"])
    assert getattr(step_settings(cfg).loss_fn.cfg, key) == value


def test_the_yaml_and_the_loss_refuse_the_same_values_with_the_same_words() -> None:
    with pytest.raises(ConfigError, match=r"algo: .*'seq-mean-token-sum-norm' needs agg_norm_len"):
        load_config(None, ["algo.loss_agg=seq-mean-token-sum-norm"])
    with pytest.raises(ValueError, match=r"'seq-mean-token-sum-norm' needs agg_norm_len"):
        PolicyLossConfig(loss_agg="seq-mean-token-sum-norm")
    with pytest.raises(ConfigError, match=r"algo.loss_args.eps: .*not a parameter|algo.loss_args"):
        load_config(None, ["algo.loss_args={eps: 1}"])
    with pytest.raises(ValueError, match="algo.loss_args"):
        PolicyLossConfig(loss_args={"eps": 1})


def test_the_train_step_builds_its_loss_once() -> None:
    s = step_settings(load_config(None, ["algo.kl_coef=0.05"]))
    assert s.loss_fn is s.loss_fn and s.needs_reference
