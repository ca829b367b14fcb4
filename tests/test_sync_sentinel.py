"""The sync sentinel (issue #40 §1) on the embedded engine: faults injected through the engine's
weight-loading function (a code hook, not a config key) are caught after the sync they happen
in, named by tensor, (layer, expert) and step; `stop` stops, `resync` repairs, a clean run has no
event, and a resume is verified like a sync."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

import axrl.inference.embedded.scheduler as scheduler
from axrl.assembly.build import train
from axrl.config import load_config
from axrl.rollout.pool import PoolFailure
from axrl.runtime.recording.events import read_events
from axrl.sync.checksums import compare_checksums, state_checksums, tensor_checksum, tensor_location
from axrl.sync.verify import SyncVerificationError

REWARD = "def score(prompt, response):\n    return float(len(response) % 2)\n"   # varies from step 0: weights move
RUN = ["model.preset=micro-moe", "warmup.steps=0", "data.reward=sentinel_reward:score", "data.prompts_per_step=2",
       "rollout.group_size=4", "rollout.max_new_tokens=6", "eval.every=0", "checkpoint.every=1", "runtime.threads=1"]
STALE = ".layers.1.mlp.experts.3."   # micro-moe: layer 1, expert 3


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("sentinel_data")
    (d / "sentinel_reward.py").write_text(REWARD)
    (d / "prompts.jsonl").write_text("".join(json.dumps({"prompt": f"Say something about {w}."}) + "\n"
                                             for w in ("cats", "rain", "maps", "dogs")))
    return d


def run(data: Path, out: Path, *overrides: str, resume: bool = False) -> list[dict[str, Any]]:
    """Train (or resume) a small run whose rewards vary (so every sync changes the weights); its
    sentinel events."""
    import sys

    if str(data) not in sys.path:
        sys.path.insert(0, str(data))
    train(load_config(None, [*RUN, f"data.path={data / 'prompts.jsonl'}", *overrides]), out, resume=resume)
    return [e for e in read_events(out) if e["event"].startswith("sync_")]


def faulty_load(keep_old: Callable[[str, int], bool]) -> Callable[..., None]:
    """The engine's weight-loading function, leaving the tensors `keep_old(name, load_index)` at
    their old values (load 0 is the run's first `update_weights`: version 0, or the resumed one)."""
    original, loads = scheduler.load_weights_into, [0]

    def load(model: torch.nn.Module, state_dict: dict[str, torch.Tensor], source: str = "state dict") -> None:
        params = dict(model.named_parameters())
        kept = {k: params[k].detach().clone() if k in params and keep_old(k, loads[0]) else v
                for k, v in state_dict.items()}
        loads[0] += 1
        original(model, kept, source)
    return load


def test_checksums_are_exact_and_name_layer_and_expert() -> None:
    w = torch.randn(64, 48)
    assert tensor_checksum(w) == tensor_checksum(w.clone())
    nudged = w.clone()
    nudged[7, 3] = torch.nextafter(nudged[7, 3], torch.tensor(1.0))  # one ulp of one element
    assert tensor_checksum(nudged).digest != tensor_checksum(w).digest
    swapped = w.clone()
    swapped[[0, 1]] = swapped[[1, 0]]  # same values, other places: the position-weighted sum sees it
    assert tensor_checksum(swapped).digest != tensor_checksum(w).digest
    assert tensor_checksum(w.bfloat16()).digest != tensor_checksum(w).digest
    assert tensor_location("model.layers.3.mlp.experts.5.up_proj.weight") == (3, 5)
    assert tensor_location("model.layers.12.self_attn.q_proj.weight") == (12, None)
    assert tensor_location("model.embed_tokens.weight") == (None, None)
    bad = compare_checksums(state_checksums({"a": w, "model.layers.0.mlp.experts.2.w": w}),
                            state_checksums({"a": w, "model.layers.0.mlp.experts.2.w": nudged}))
    assert [(m.name, m.layer, m.expert) for m in bad] == [("model.layers.0.mlp.experts.2.w", 0, 2)]


@pytest.fixture(scope="module")
def clean_run(data, tmp_path_factory) -> tuple[Path, list[dict[str, Any]]]:
    out = tmp_path_factory.mktemp("sentinel_clean") / "run"
    return out, run(data, out, "steps=2")


def test_a_clean_run_has_no_event_and_stores_its_floor(clean_run) -> None:
    out, events = clean_run
    assert events == []
    stored = json.loads((out / "manifest.json").read_text())["sync_sentinel"]
    assert stored["verify"] == "both" and stored["engine"] == "embedded" and stored["probe"] == 2
    assert stored["floor"]["logprob_max_abs"] == 0.0 and stored["floor"]["calibrated_at_version"] == 0
    assert stored["floor"]["limit_logprob"] > 0


def test_the_sentinel_changes_no_recorded_bit(clean_run, data, tmp_path) -> None:
    """Verifying is read-only: the same run with `sync.verify: off` records the same steps, down to
    the digest of the process' RNG state (the trainer-side probe model's initial draw moved it)."""
    from axrl.trace import StepFile

    out, _ = clean_run
    off = tmp_path / "off"
    run(data, off, "steps=2", "sync.verify=off")
    for step in range(2):
        name = f"step_{step:06d}.h5"
        with StepFile(out / "trace" / name) as a, StepFile(off / "trace" / name) as b:
            assert a.attrs["rng_digest"] == b.attrs["rng_digest"]
            for key in ("/tokens/ids", "/tokens/rollout_logprob", "/tokens/old_logprob", "/tokens/advantage"):
                assert a[key].tobytes() == b[key].tobytes(), key


def test_a_stale_expert_is_named_with_its_layer_expert_and_step(data, tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(scheduler, "load_weights_into", faulty_load(lambda k, i: STALE in k and i >= 1))
    events = run(data, tmp_path / "run", "steps=2")   # warn: the run goes on
    checksum = [e for e in events if e["check"] == "checksum"]
    assert [(e["event"], e["step"], e["action"]) for e in checksum][:2] == \
        [("sync_mismatch", 1, "warn"), ("sync_mismatch", 2, "warn")]
    assert {e["check"] for e in events if e["step"] == 1} == {"checksum", "probe"}   # the re-score sees it too
    first = checksum[0]
    assert first["reason"] == "sync" and first["layers"] == [1] and first["experts"] == [[1, 3]]
    assert {t["tensor"] for t in first["tensors"]} == {f"model.layers.1.mlp.experts.3.{p}_proj.weight"
                                                       for p in ("gate", "up", "down")}
    assert len(list((tmp_path / "run" / "trace").glob("step_*.h5"))) == 2


def test_a_skipped_sync_names_every_tensor_and_stop_stops(data, tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(scheduler, "load_weights_into", faulty_load(lambda k, i: i == 1))   # load 1 = v1: skipped
    with pytest.raises(PoolFailure) as e:   # the rollout thread's error, raised where the trainer waits
        run(data, tmp_path / "run", "steps=2", "sync.on_failure=stop")
    assert isinstance(e.value.__cause__, SyncVerificationError)
    message = str(e.value)
    assert "weights version 1 (step 1)" in message and "tensor(s) differ" in message
    (event,) = [e for e in read_events(tmp_path / "run") if e["event"] == "sync_mismatch" and e["check"] == "checksum"]
    assert event["step"] == 1 and event["action"] == "stop" and event["count"] >= 20   # every trained tensor
    assert not (tmp_path / "run" / "trace" / "step_000001.h5").exists()   # no step trained on the stale engine


def test_resync_repairs_a_transient_fault(data, tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(scheduler, "load_weights_into", faulty_load(lambda k, i: STALE in k and i == 1))
    events = run(data, tmp_path / "run", "steps=2", "sync.on_failure=resync")
    assert [(e["event"], e["step"], e.get("check")) for e in events] == \
        [("sync_mismatch", 1, "checksum"), ("sync_mismatch", 1, "probe"), ("sync_resync", 1, None)]
    assert events[-1]["repaired"] is True and events[-1]["remaining"] == []   # and no event after it


def test_probe_rescore_names_the_tokens_when_checksums_are_off(data, tmp_path, monkeypatch) -> None:
    """Checksums off: the floor is calibrated at version 1 (clean), the stale expert from version 2
    on is caught by the re-score of the run's own samples, naming the worst tokens."""
    monkeypatch.setattr(scheduler, "load_weights_into", faulty_load(lambda k, i: ".layers.0.mlp.experts." in k
                                                                    and i >= 2))
    events = run(data, tmp_path / "run", "steps=3", "sync.verify=probe")
    assert events and {e["check"] for e in events} == {"probe"} and events[0]["step"] == 2
    worst = events[0]["tokens"][0]
    assert worst["delta"] == events[0]["logprob_max_abs"] > events[0]["floor"]["limit_logprob"]
    assert {"probe", "position", "token", "engine_logprob", "trainer_logprob"} <= set(worst)


def test_a_resume_is_verified(clean_run, data, tmp_path, monkeypatch) -> None:
    out = tmp_path / "run"
    shutil.copytree(clean_run[0], out)
    monkeypatch.setattr(scheduler, "load_weights_into", faulty_load(lambda k, i: STALE in k and i == 0))
    events = run(data, out, "steps=3", resume=True)   # load 0: the resume's (version 2)
    assert [(e["event"], e["reason"], e["step"], e["experts"]) for e in events][:1] == \
        [("sync_mismatch", "resume", 2, [[1, 3]])]


def test_sync_section_defaults_equal_from_yaml_and_python() -> None:
    from axrl.sync.settings import SyncSettings

    cfg = load_config(None)
    assert type(cfg.sync) is SyncSettings and cfg.sync == SyncSettings()
    assert load_config(None, ["sync.verify=off"]).sync.verify == "off"
    with pytest.raises(Exception, match="sync.on_failure"):
        load_config(None, ["sync.on_failure=ignore"])


class _CountingSide:
    """An embedded-like engine side over `model` that counts its probe re-scores."""

    name, weight_dtype, unavailable = "fake", "fp32", None

    def __init__(self, model: torch.nn.Module, has_checksums: bool = True, unreadable: tuple[str, ...] = ()) -> None:
        self.model, self.has_checksums, self.unreadable, self.scores = model, has_checksums, unreadable, 0

    def checksum_pair(self, weights):
        from axrl.model import hf_state_dict
        from axrl.sync.checksums import ChecksumPair
        if not self.has_checksums:
            return None
        held = {k: v for k, v in state_checksums(hf_state_dict(self.model)).items() if k not in self.unreadable}
        expected = {k: v for k, v in state_checksums(weights).items() if k not in self.unreadable}
        return ChecksumPair(expected, held, self.unreadable)

    def score(self, sequences):
        from axrl.sync.probe import score_with_model
        self.scores += 1
        return score_with_model(self.model, sequences)


@pytest.mark.parametrize("has_checksums,partial", [(True, False), (False, False), (True, True)])
def test_both_pays_the_probe_only_where_checksums_cannot_settle_it(has_checksums, partial) -> None:
    """`sync.verify: both` (the default, within its 2 % budget because of this): after clean exact
    checksums no probe re-score; it calibrates once, runs after a checksum failure (naming tokens),
    and at every verification of an engine without checksums, or whose checksums cannot read every
    tensor (vLLM's CPU build: linears behind opaque handles), which one event says once."""
    import numpy as np

    from axrl.model import build_model, hf_state_dict, preset_config
    from axrl.sync.settings import SyncSettings
    from axrl.sync.verify import SyncSentinel

    cfg = preset_config("micro-moe")
    engine = build_model(cfg, seed=0)
    unreadable = ("model.layers.0.self_attn.q_proj.weight",) if partial else ()
    side = _CountingSide(engine, has_checksums, unreadable)
    events: list[dict] = []
    sentinel = SyncSentinel(SyncSettings(verify="both"), side, cfg, record=lambda e, **f: events.append({"event": e, **f}))
    weights = {k: v.detach().clone() for k, v in hf_state_dict(engine).items()}
    assert sentinel.verify(weights, 0, reason="start", resend=lambda: None) == []
    for seed in range(2):
        sentinel.observe(np.random.default_rng(seed).integers(3, cfg.vocab_size, size=12))
    assert sentinel.floor is not None and side.scores == 1          # calibrated once
    assert sentinel.verify(weights, 1, reason="sync", resend=lambda: None) == []
    every_time = partial or not has_checksums
    assert side.scores == (2 if every_time else 1)
    stale = dict(weights)
    key = "model.layers.1.mlp.experts.3.up_proj.weight"
    stale[key] = weights[key] + 0.5                                  # the trainer moved, the engine did not
    findings = sentinel.verify(stale, 2, reason="sync", resend=lambda: None)
    assert side.scores == (3 if every_time else 2)
    assert [f["check"] for f in findings] == (["checksum", "probe"] if has_checksums else ["probe"])
    told = [e for e in events if e["event"] == "sync_checksum_partial"]
    assert [t["tensors"] for t in told] == ([list(unreadable)] if partial else [])
