"""The default correction (token TIS, `algo.tis: null`) applies only when no correction is named:
naming one replaces it, `tis: true` asks for both — the same in YAML and in Python — and the
corrections in effect are printed at the start of `axrl train` and stored in the manifest."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from axrl.algo import PolicyLossConfig
from axrl.assembly.settings import loss_config
from axrl.config import load_config
from tests.test_algo import loss_inputs
from tests.test_objectives import run_loss
from tests.train_util import QUICKSTART, train

MIS = {"level": "token", "lower": 0.7, "upper": 1.4}
TIS = {"level": "token", "cap": 2.0}


def test_naming_a_correction_replaces_the_default_tis_in_python_and_yaml() -> None:
    assert PolicyLossConfig().effective_corrections() == {"tis": TIS}
    assert PolicyLossConfig(correction={"mis": MIS}).effective_corrections() == {"mis": MIS}
    assert PolicyLossConfig(correction={"mis": MIS}, tis=True).effective_corrections() == {"mis": MIS, "tis": TIS}
    assert PolicyLossConfig(tis=False).effective_corrections() == {}
    assert PolicyLossConfig(correction={"tis": None}).effective_corrections() == {}
    for overrides, want in (([], {"tis": TIS}), (["algo.correction.mis={level: token, lower: 0.7, upper: 1.4}"],
                                                 {"mis": MIS}),
                            (["algo.correction.mis={level: token, lower: 0.7, upper: 1.4}", "algo.tis=true"],
                             {"mis": MIS, "tis": TIS})):
        assert loss_config(load_config(QUICKSTART, overrides)).effective_corrections() == want, overrides


def test_the_named_correction_alone_is_the_loss() -> None:
    # mis alone used to be multiplied by the default token TIS weight as well
    batch, lp0, _ = loss_inputs([6, 9, 4, 12, 7], seed=13, spread=0.4)
    named, _, _ = run_loss(PolicyLossConfig(correction={"mis": MIS}), batch, lp0)
    alone, _, _ = run_loss(PolicyLossConfig(correction={"mis": MIS}, tis=False), batch, lp0)
    both, _, _ = run_loss(PolicyLossConfig(correction={"mis": MIS}, tis=True), batch, lp0)
    assert torch.equal(named, alone) and not torch.equal(named, both)


def test_train_prints_and_records_the_corrections_in_effect(tmp_path: Path) -> None:
    short = ["steps=1", "warmup.steps=2", "eval.every=0", "data.prompts_per_step=2", "rollout.group_size=2",
             "runtime.threads=1", "rollout.max_turns=1"]
    out = train(tmp_path / "mis", [*short, "algo.correction.mis={level: token, lower: 0.7, upper: 1.4}"]).output
    assert "corrections: mis {'level': 'token', 'lower': 0.7, 'upper': 1.4}" in out, out[-2000:]
    manifest = json.loads((tmp_path / "mis" / "manifest.json").read_text())
    assert manifest["extra"]["corrections"] == {"mis": MIS}
    train(tmp_path / "default", short)
    assert json.loads((tmp_path / "default" / "manifest.json").read_text())["extra"]["corrections"] == {"tis": TIS}
