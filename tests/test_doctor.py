"""`axrl-debug doctor` on the fast fault zoo: faults injected through code hooks (tests/fault_zoo.py)
into small runs; the top finding names the injected cause (with its layer/expert/step where one
applies), a clean control's top finding is `within_envelope`, a re-executed hypothesis proves a
stale expert bitwise, and `check --envelope` gates on the calibrated envelope."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

import fault_zoo as fz
from axrl_debug.analysis.doctor import CAUSES, Finding, diagnose
from axrl_debug.cli import app as debug_app

#: the fast zoo: (injector, expected top cause) — two steps each, so a sync has happened; the
#: prefill/decode perturbation, router noise, async staleness and more controls are in the slow zoo
FAST = {
    "stale_expert": (lambda: fz.stale_expert(1, 2), "stale_tensor"),
    "skipped_sync": (lambda: fz.skipped_sync(1), "weights_out_of_sync"),
    "bf16_kv_cache": (lambda: fz.kv_cache_dtype(), "kv_cache_precision"),
    "unmasked_observations": (fz.unmasked_observations, "masking"),
}


@pytest.fixture(scope="session")
def zoo(tmp_path_factory):
    """name → run directory, each trained once per session (the clean control is "clean")."""
    root = tmp_path_factory.mktemp("zoo")
    runs: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in runs:
            inject = fz.no_fault() if name == "clean" else FAST[name][0]()
            with inject:
                runs[name] = fz.train_run(root / name, steps=2)
        return runs[name]
    return get


@pytest.mark.parametrize("fault", sorted(FAST))
def test_top_finding_is_the_injected_cause(zoo, fault):
    report = diagnose(zoo(fault), rescore=False, reexec=False)   # trace-only signatures
    top = report["findings"][0]
    assert top["cause"] == FAST[fault][1], [(f["cause"], f["confidence"]) for f in report["findings"]]
    if fault == "stale_expert":
        assert (top["evidence"]["layer"], top["evidence"]["expert"]) == (1, 2)
        assert top["next_command"].startswith("axrl-debug bisect ")
    if fault == "skipped_sync":
        assert top["steps"] == [1] and report["flagged_steps"] == [1]
    if fault == "unmasked_observations":
        assert top["evidence"]["trained_not_generated_tokens"] > 0


def test_clean_control_is_within_envelope(zoo):
    report = diagnose(zoo("clean"), rescore=False, reexec=False)
    assert report["top"] == "within_envelope" and not report["flagged_steps"]
    assert all(r["inside"] for r in report["per_step"])


def test_reexecution_proves_the_stale_expert_and_the_envelope_is_calibrated(zoo):
    run = zoo("stale_expert")
    report = diagnose(run, step=1)
    env = report["envelope"]
    assert env["source"] == "rescore" and 0 < env["floor_mean_abs"] < 1e-5   # fp32 numerics, measured
    assert (run / "doctor" / "envelope.json").is_file()
    top = report["findings"][0]
    assert top["cause"] == "stale_tensor" and top["proven"], top["proof"]
    assert "model.layers.1.mlp.experts.2." in top["proof"]["hypothesis"]
    assert not top["proof"]["clean_replay"]["reproduced"]   # the engine ran something else than clean code


def test_cli_exit_codes_and_json(zoo):
    clean = CliRunner().invoke(debug_app, ["doctor", str(zoo("clean")), "--no-reexec", "--json"])
    assert clean.exit_code == 0, clean.output
    doc = json.loads(clean.stdout)
    assert doc["top"] == "within_envelope" and set(f["cause"] for f in doc["findings"]) <= set(CAUSES)
    bad = CliRunner().invoke(debug_app, ["doctor", str(zoo("skipped_sync")), "--no-reexec"])
    assert bad.exit_code == 1 and "weights_out_of_sync" in bad.stdout
    missing = CliRunner().invoke(debug_app, ["doctor", str(zoo("clean")), "--step", "99"])
    assert missing.exit_code == 2 and "step 99" in missing.output


def test_check_envelope_gate(zoo):
    ok = CliRunner().invoke(debug_app, ["check", str(zoo("clean")), "--envelope", "--json"])
    assert ok.exit_code == 0, ok.output
    assert json.loads(ok.stdout)["passed"]
    bad = CliRunner().invoke(debug_app, ["check", str(zoo("bf16_kv_cache")), "--envelope"])
    assert bad.exit_code == 1 and "OUTSIDE" in bad.stdout
    neither = CliRunner().invoke(debug_app, ["check", str(zoo("clean"))])
    assert neither.exit_code == 2


def test_validate_recommends_the_masking_fix_with_numbers(zoo):
    """`--validate` on a run that trains observation tokens: the masking fix (loss only on generated
    tokens) brings the step's first gradient to the on-policy reference and is recommended, with
    the measured errors; a mitigation is never recommended without beating the baseline."""
    report = diagnose(zoo("unmasked_observations"), rescore=False, reexec=False, validate=True)
    top = report["findings"][0]
    assert top["cause"] == "masking"
    rows = {r["mitigation"]: r for r in top["validation"]}
    fix = rows["mask_untrained"]
    assert fix["measured"] and fix["recommended"]
    assert fix["grad_rel_error"] < 1e-6 < fix["baseline_grad_rel_error"]   # the baseline also trains observations
    assert fix["grad_cosine"] > fix["baseline_grad_cosine"]
    for r in rows.values():
        assert not r.get("recommended") or r["grad_rel_error"] < r["baseline_grad_rel_error"]


def test_reads_the_sync_sentinels_events_and_floor_when_present(zoo, tmp_path):
    """A run with the live sync sentinel's findings (RUN/events.jsonl `sync_mismatch`, the probe floor
    in the manifest, as axrl/sync writes them): the checksum's named expert is the top finding, and
    the envelope falls back to the sentinel's floor when re-scoring is off."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(zoo("clean"), run, ignore=shutil.ignore_patterns("doctor"))
    manifest = json.loads((run / "manifest.json").read_text())
    manifest["sync_sentinel"] = {"verify": "both", "engine": "embedded", "floor": {"logprob_max_abs": 2e-6}}
    (run / "manifest.json").write_text(json.dumps(manifest))
    event = {"event": "sync_mismatch", "engine": "embedded", "step": 1, "version": 1, "reason": "sync",
             "action": "warn", "check": "checksum", "count": 3, "layers": [1], "experts": [[1, 3]],
             "tensors": [{"tensor": "model.layers.1.mlp.experts.3.gate_proj.weight", "layer": 1, "expert": 3}]}
    (run / "events.jsonl").write_text(json.dumps({"event": "step_done"}) + "\n" + json.dumps(event) + "\n")
    report = diagnose(run, rescore=False, reexec=False)
    assert report["envelope"]["source"] == "sentinel" and report["envelope"]["floor_max_abs"] == 2e-6
    # the probe measures a max: the mean bound stays the dtype's (4 fp32 ulps), not 4 × the probe max
    assert report["envelope"]["mean_abs"] == 4 * 2.0 ** -23
    top = report["findings"][0]
    assert top["cause"] == "stale_tensor" and top["steps"] == [1]
    assert (top["evidence"]["layer"], top["evidence"]["expert"]) == (1, 3)
    assert top["next_command"] == f"axrl-debug bisect {run} --step 1"


def test_a_checksum_finding_of_every_expert_says_only_experts_differ(zoo, tmp_path):
    """vLLM's CPU in-place reload as the sentinel saw it (tests/test_sync_sentinel_vllm.py): every
    expert tensor of every layer differs, nothing else. The whole model is not late: the evidence
    and summary say only expert weights differ; a mixed finding does not say so."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(zoo("clean"), run, ignore=shutil.ignore_patterns("doctor"))
    experts = [[layer, e] for layer in range(2) for e in range(4)]
    event = {"event": "sync_mismatch", "engine": "vllm", "step": 1, "version": 1, "reason": "sync", "action": "warn",
             "check": "checksum", "count": 16, "expert_tensors": 16, "layers": [0, 1], "experts": experts,
             "tensors": [{"tensor": f"model.layers.{a}.mlp.experts.{b}.gate_up_proj.weight", "layer": a, "expert": b}
                         for a, b in experts]}
    (run / "events.jsonl").write_text(json.dumps(event) + "\n")
    top = diagnose(run, rescore=False, reexec=False)["findings"][0]
    assert top["cause"] == "weights_out_of_sync" and top["evidence"]["only_expert_tensors"] is True
    assert "all of them expert weights (8 experts in layers [0, 1]" in top["summary"]
    event["expert_tensors"] = 12
    (run / "events.jsonl").write_text(json.dumps(event) + "\n")
    top = diagnose(run, rescore=False, reexec=False)["findings"][0]
    assert top["evidence"]["only_expert_tensors"] is False and "expert weights" not in top["summary"]


def test_a_reading_refuted_by_reexecution_ranks_below_trace_only_ones():
    """A reading whose re-execution diverged (clean re-run and every hypothesis) keeps 60 % of its
    confidence and drops below a reading that has no re-executable hypothesis."""
    from axrl_debug.analysis.doctor.hypotheses import _demote_failed

    diverged = {"reproduced": False, "verdict": "diverged", "first_divergence": "token 3"}
    kv = Finding("kv_cache_precision", 0.65, {}, "kv", "cmd", [0],
                 proof={"tested": True, "reproduced": False, "clean_replay": diverged,
                        "hypotheses": [{"hypothesis": "bf16 KV", **diverged}]})
    prefill = Finding("prefill_decode", 0.35, {}, "prefill", "cmd", [0])
    _demote_failed([kv, prefill])
    assert kv.confidence < prefill.confidence and "NOT reproduced" in kv.summary
    alone = Finding("kv_cache_precision", 0.65, {}, "kv", "cmd", [0], proof=dict(kv.proof))
    _demote_failed([alone])
    assert alone.confidence == pytest.approx(0.39)   # below `unexplained` (0.4): diagnose names no guess


def test_context_variant_rewrites_later_turns_only(monkeypatch):
    """The context_drift injector / context_mismatch hypothesis: the engine is given a same-length
    rewrite of every later turn's request; the first turn's request is untouched."""
    from axrl.inference.embedded.engine import EmbeddedEngine
    from axrl.inference.protocol import GenerateRequest
    from axrl_debug.analysis.doctor.context_variants import engine_given

    seen = []
    monkeypatch.setattr(EmbeddedEngine, "_enqueue", lambda self, reqs: seen.extend(reqs) or [])
    with engine_given("generation_prompt_rerendered"):
        EmbeddedEngine._enqueue(None, [GenerateRequest([5, 6, 7], sticky_key="a")])
        EmbeddedEngine._enqueue(None, [GenerateRequest([5, 6, 7, 8, 9], sticky_key="a")])
    assert [r.input_ids for r in seen] == [[5, 6, 7], [5, 6, 7, 8, 5]]
    with pytest.raises(ValueError, match="context variant 'nope'"):
        with engine_given("nope"):
            pass


def _imported(tmp_path: Path, name: str, rollout_mean: float, gap: float, **recorder) -> Path:
    """A 2-step run another trainer recorded (`axrl.trace.Recorder`): 8 samples of 12 prompt and 16
    generated tokens; the trainer's logprob of each generated token is the engine's + `gap` ± noise."""
    import numpy as np

    from axrl.trace import Recorder

    rng = np.random.default_rng(0)
    rec = Recorder(tmp_path / name, engine="vllm", backend="trl", source={"framework": "test"}, **recorder)
    for step in range(2):
        ids = [rng.integers(3, 1000, 28) for _ in range(8)]
        mask = [np.r_[np.zeros(12), np.ones(16)] for _ in range(8)]
        rollout = [np.r_[np.zeros(12), rollout_mean + 0.3 * rng.standard_normal(16)] for _ in range(8)]
        trainer = [r + np.r_[np.zeros(12), gap + 0.05 * gap * rng.standard_normal(16)] for r in rollout]
        rec.write_step(step, token_ids=ids, loss_mask=mask, rollout_logprobs=rollout, trainer_logprobs=trainer,
                       rewards=np.zeros(8), advantages=np.zeros(8), group_ids=np.arange(8) // 4)
    return rec.path


def test_an_engine_off_by_nats_from_step_0_is_other_weights_not_a_kv_cache(tmp_path):
    """TRL's colocated push into vLLM's CPU build (docs/import.md): the engine samples near-uniformly
    from step 0, nats away from the trainer. No precision does that; the doctor names other weights,
    and, the run being imported (no checkpoints), points at `mismatch`, not `bisect`."""
    report = diagnose(_imported(tmp_path, "broken", rollout_mean=-6.9, gap=-4.8), rescore=False, reexec=False)
    top = report["findings"][0]
    assert top["cause"] == "weights_out_of_sync" and top["evidence"]["gross"], report["findings"]
    assert top["evidence"]["engine_mean_logprob"] == pytest.approx(-6.9, abs=0.1)
    assert "kv_cache_precision" not in [f["cause"] for f in report["findings"]]
    assert all(f["next_command"].startswith("axrl-debug mismatch ") for f in report["findings"])


def test_an_imported_bf16_engine_is_judged_by_its_precision(tmp_path):
    """The same shape at bf16 rounding (0.008 a token, TRL's repaired colocated run): inside the envelope
    of the sampler's dtype the hook records (config rollout.dtype), `precision`; the same run stated
    as float32 is outside the envelope and never called other weights."""
    bf16 = _imported(tmp_path, "bf16", rollout_mean=-0.6, gap=0.008,
                     config={"model": {"dtype": "float32"}, "rollout": {"dtype": "bfloat16"}})
    assert diagnose(bf16, rescore=False, reexec=False)["top"] == "precision"
    fp32 = diagnose(_imported(tmp_path, "fp32", rollout_mean=-0.6, gap=0.008), rescore=False, reexec=False)
    assert fp32["flagged_steps"] and "weights_out_of_sync" not in [f["cause"] for f in fp32["findings"]]
