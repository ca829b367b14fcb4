"""What `axrl-debug` prints says what it measured: spikes' defaults are the type's, steps that
cannot be flagged are named; summary's agent-session table only for runs with sessions;
mismatch counts generated and trained tokens apart; its worst tokens list one row per distinct
token, identical samples collapsed."""

from __future__ import annotations

import dataclasses

import typer.main

from axrl_debug.analysis.spikes import SpikeConfig
from axrl_debug.cli import app
from axrl_debug.synthetic import TinySample, TinyToken, gen, tiny_record, write_run
from tests.test_debug_cli import cli_run, invoke, one_json


def test_spikes_options_default_to_the_spike_config() -> None:
    command = typer.main.get_command(app).commands["spikes"]
    defaults = {p.name: p.default for p in command.params}
    cfg = SpikeConfig()
    for name in ("window", "threshold", "min_history", "rel_floor", "min_ratio"):
        assert defaults[name] == getattr(cfg, name), name


def test_spikes_names_the_steps_it_cannot_flag(tmp_path) -> None:
    run = cli_run(tmp_path / "run", steps=range(8))
    text = " ".join(invoke("spikes", run).stdout.split())
    assert "steps 0–4: no baseline yet (--min-history 5), never flagged" in text
    assert "axrl-debug check RUN --golden" in text
    res = one_json(invoke("spikes", run, "--json"))
    assert res["unflaggable_steps"] == [0, 1, 2, 3, 4] and res["config"]["min_ratio"] == SpikeConfig().min_ratio


def _with_sessions(rec, session_ids: list[str], drift: list[int]):
    n = len(session_ids)
    return dataclasses.replace(rec, session_id=session_ids, fork_of=[-1] * n, fork_cause=[""] * n,
                               drift_tokens=drift)


def _samples() -> list[TinySample]:
    return [TinySample([TinyToken(id=1), gen(0.5, 0.01, id=2, advantage=1.0)]),
            TinySample([TinyToken(id=1), gen(0.5, 0.02, id=3, advantage=1.0)])]


def test_summary_prints_agent_sessions_only_for_runs_with_sessions(tmp_path) -> None:
    white = write_run(tmp_path / "white", [_with_sessions(tiny_record(0, 0, _samples()), ["", ""], [0, 2])]).path
    text = " ".join(invoke("summary", white).stdout.split())
    assert "black-box agent sessions" not in text
    assert "re-tokenisation drift: 1 sample(s) on 1 step(s)" in text
    assert one_json(invoke("summary", white, "--json"))["sessions"] == []
    black = write_run(tmp_path / "black", [_with_sessions(tiny_record(0, 0, _samples()), ["s1", "s2"], [0, 0])]).path
    assert "black-box agent sessions" in " ".join(invoke("summary", black).stdout.split())


def test_mismatch_counts_generated_and_trained_tokens_apart(tmp_path) -> None:
    masked = TinyToken(id=4, loss_mask=0, version=0, rollout=-0.5, old=-0.5)   # sampled, not trained
    run = write_run(tmp_path / "run", [tiny_record(0, 0, [TinySample([TinyToken(id=1), gen(0.5, 0.01, id=2),
                                                                       masked, gen(0.4, 0.02, id=3)])])]).path
    res = one_json(invoke("mismatch", run, "--json"))
    assert res["tokens"] == {"total": 4, "trained": 2, "generated": 3, "analysed": 2}
    assert res["per_step"][0]["trained"] == 2 and res["per_step"][0]["generated"] == 3
    assert "2 trained (loss_mask = 1), 3 generated" in " ".join(invoke("mismatch", run).stdout.split())


def test_top_collapses_the_same_token_of_identical_samples(tmp_path) -> None:
    same = [TinySample([TinyToken(id=1), gen(0.5, 0.3, id=2), gen(0.5, 0.01, id=3)], group_id=0) for _ in range(3)]
    other = TinySample([TinyToken(id=1), gen(0.5, 0.2, id=5)], group_id=1)
    run = write_run(tmp_path / "run", [tiny_record(0, 0, [*same, other])]).path
    top = one_json(invoke("mismatch", run, "--json", "--top", "3"))["top"]
    assert [(t["token_id"], t["identical"]) for t in top] == [(2, 3), (5, 1), (3, 3)]
    assert top[0]["sample_ids"] == [0, 1, 2]
    text = " ".join(invoke("mismatch", run, "--top", "3").stdout.split())
    assert "(+2 identical)" in text


def test_the_loss_proxy_reads_the_default_tis_as_the_loss_did() -> None:
    # config.yaml of a run that names no correction has algo.tis: null — its loss had token TIS
    import numpy as np

    from axrl_debug.analysis.spikes import loss_proxy
    cols = {"/samples/offsets": np.array([0, 3]), "/tokens/loss_mask": np.array([0, 1, 1]),
            "/tokens/advantage": np.array([0.0, 1.0, 1.0]), "/tokens/old_logprob": np.array([0.0, 0.0, 0.0]),
            "/tokens/rollout_logprob": np.array([0.0, -5.0, 0.0]), "/train/update_samples": np.array([0]),
            "/train/updates/sample_offsets": np.array([0, 1])}
    capped = loss_proxy(cols, {"tis": None, "tis_cap": 2.0, "loss_agg": "token-mean"})
    assert capped.tolist() == loss_proxy(cols, {"tis": True, "tis_cap": 2.0, "loss_agg": "token-mean"}).tolist()
    named = loss_proxy(cols, {"tis": None, "correction": {"mis": {}}, "tis_cap": 2.0, "loss_agg": "token-mean"})
    assert named.tolist() == loss_proxy(cols, {"tis": False, "loss_agg": "token-mean"}).tolist() != capped.tolist()
