"""A small run with known values for the TUI tests (imported by the other test_tui* modules),
and tests of the TUI's data layer (axrl_debug/tui/data.py, metrics.py) on it.

Sample 0 of every step is a two-turn tool-use trajectory:

    tokens  0..14  prompt                  (turn 0, loss_mask 0)
           15..26  assistant tool call     (turn 1, loss_mask 1)
           27..38  tool/env response       (turn 1, loss_mask 0)
           39..45  assistant answer        (turn 2, loss_mask 1)

with Δ = old − rollout = 1e-4 everywhere except token 40 (' answer', Δ = +0.7, the worst),
token 21 ('al', Δ = −0.25) and token 44 ('.', Δ = +0.05); MoE routing (2 layers, top-2) agrees
everywhere except layer 1 of token 42 (rollout 3,4 vs trainer 3,5); token 30 has the same experts
in another order (not a disagreement) and the last token has no rollout row. Sample 1 failed
(prompt only); sample 2 is a short one-turn answer. Step 5's loss spikes.
"""

from __future__ import annotations

import math
from pathlib import Path

import h5py
import numpy as np
import pytest

from axrl.tokenizer import Tokenizer
from axrl.trace import RunDir, StepRecord

PROMPT = "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
CALL = '<tool_call>{"name": "calc"}</tool_call><|im_end|>'
TOOL = "\n<|im_start|>user\n<tool_response>4</tool_response><|im_end|>\n<|im_start|>assistant\n"
ANSWER = "The answer is 4.<|im_end|>"
SHORT = "4.<|im_end|>"

STEPS = 6
LOSS = [0.5, 0.51, 0.49, 0.5, 0.52, 3.0]          # step 5: a loss spike
REWARD = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6]
WORST, SECOND, THIRD, DISAGREE, SWAPPED = 40, 21, 44, 42, 30
ADVANTAGE = [1.25, 0.0, -0.5]


def _segments(tok: Tokenizer) -> dict[str, list[int]]:
    return {k: tok.encode(v) for k, v in
            {"prompt": PROMPT, "call": CALL, "tool": TOOL, "answer": ANSWER, "short": SHORT}.items()}


def make_record(step: int, tok: Tokenizer) -> StepRecord:
    seg = _segments(tok)
    p, c, t, a, s = (len(seg[k]) for k in ("prompt", "call", "tool", "answer", "short"))
    assert (p, c, t, a) == (15, 12, 12, 7), "tokenizer changed: update the token positions in this module"
    ids0 = seg["prompt"] + seg["call"] + seg["tool"] + seg["answer"]
    ids1 = seg["prompt"]
    ids2 = seg["prompt"] + seg["short"]
    lens = [len(ids0), len(ids1), len(ids2)]
    off = np.cumsum([0] + lens).astype(np.int64)
    n = int(off[-1])
    lm = np.zeros(n, np.uint8)
    turn = np.zeros(n, np.int16)
    lm[p:p + c] = 1
    lm[p + c + t:lens[0]] = 1
    turn[p:p + c + t] = 1
    turn[p + c + t:lens[0]] = 2
    b = off[2]
    lm[b + p:b + lens[2]] = 1
    turn[b + p:b + lens[2]] = 1
    gen = lm == 1
    rollout = np.where(gen, -1.0 - 0.01 * np.arange(n), np.nan).astype(np.float32)
    old = np.where(gen, rollout + 1e-4, -3.0).astype(np.float32)
    rollout[WORST], old[WORST] = -1.5, -0.8
    rollout[SECOND], old[SECOND] = -2.0, -2.25
    rollout[THIRD], old[THIRD] = -0.5, -0.45
    pv = np.where(gen, step, -1).astype(np.int32)
    pv[p:p + c] = max(step - 1, 0)                    # the tool call came from the previous policy
    adv = np.repeat(np.array(ADVANTAGE, np.float32), lens)
    ent = np.where(gen, 0.5, 0.0).astype(np.float16)
    rr = np.tile(np.array([[1, 2], [3, 4]], np.uint8), (n, 1, 1))
    rt = rr.copy()
    rt[DISAGREE, 1] = [3, 5]
    rt[SWAPPED, 0] = [2, 1]
    valid = np.ones(n, np.uint8)
    valid[off[1:] - 1] = 0
    rr[valid == 0] = 0
    return StepRecord(
        step=step, policy_version=step, sample_offsets=off,
        sample_id=np.array([100, 101, 102]) + 10 * step, group_id=np.array([7, 7, 8]) + 10 * step,
        prompt_id=["math/0", "math/0", "math/1"], prompt_len=np.full(3, p, np.int32),
        num_turns=np.array([2, 0, 1], np.int32), reward=[1.0, math.nan, 0.0],
        finish_reason=["stop", "failed", "stop"], status=["ok", "failed", "ok"],
        error=["", "env crashed", ""],
        token_ids=np.array(ids0 + ids1 + ids2, np.int32), loss_mask=lm, turn=turn, token_policy_version=pv,
        rollout_logprob=rollout, old_logprob=old, advantage=adv, entropy=ent,
        num_experts=8, routing_rollout=rr, routing_rollout_valid=valid, routing_train=rt,
        update_sample_offsets=np.array([0, 3], np.int64), update_samples=np.array([0, 1, 2], np.int64),
        update_metrics={"loss": [LOSS[step]], "grad_norm": [1.0], "lr": [1e-6], "clipfrac": [0.0]},
        weights_fingerprint_before="a" * 64, weights_fingerprint_after="b" * 64,
        wall_times={"rollout": 1.0, "train": 1.0},
        extra_samples={"advantage": np.array(ADVANTAGE, np.float32)},
    )


def build_run(path: Path, *, steps: int = STEPS, missing_file: int | None = None) -> Path:
    """Write the known run at ``path`` (a step in ``missing_file`` keeps its metrics line but has
    no step file, as after a crash between the two)."""
    tok = Tokenizer.default()
    run = RunDir(path)
    run.write_manifest(seed=0, backend="torch", engine="embedded", command=["tests"])
    run.write_config({"steps": steps, "algo": {"clip_low": 0.2, "clip_high": 0.28, "tis_cap": 2.0}})
    for step in range(steps):
        if step != missing_file:
            run.write_step(make_record(step, tok))
        run.append_metrics({"step": step, "policy_version": step, "reward": REWARD[step], "loss": LOSS[step],
                            "grad_norm": 1.0, "clipfrac": 0.0, "mismatch": 0.05, "samples": 3, "failed": 1,
                            "generated_tokens": 22})
    return path


def write_replay_dump(run: Path, step: int, num_tokens: int) -> Path:
    """A minimal ``RUN/replay/step_N.h5`` in the replay tool's layout (replay/dump.py)."""
    path = run / "replay" / f"step_{step:06d}.h5"
    path.parent.mkdir(parents=True, exist_ok=True)
    with h5py.File(path, "w") as f:
        f.attrs["format"] = "axrl-replay-dump"
        f["tokens/loss_contribution"] = np.arange(num_tokens, dtype=np.float32) * 1e-3
        f["tokens/ratio"] = np.full(num_tokens, 1.5, np.float32)
        f["tokens/ids"] = np.zeros(num_tokens, np.int32)          # a copy: not shown
        f["samples/loss"] = np.array([0.25, 0.0, -0.125])
    return path


@pytest.fixture
def known_run(tmp_path: Path) -> Path:
    return build_run(tmp_path / "demo-run")


# ============================================================================ data-layer tests
def test_run_model_opens_lazily_from_metrics(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import axrl_debug.tui.data as data

    run = build_run(tmp_path / "demo-run", missing_file=3)
    opened: list[str] = []
    orig = data.StepFile

    class Counting(orig):  # type: ignore[misc, valid-type]
        def __init__(self, path, *a, **kw) -> None:
            opened.append(str(path))
            super().__init__(path, *a, **kw)

    monkeypatch.setattr(data, "StepFile", Counting)
    model = data.RunModel(run)
    assert opened == []                                     # nothing read to list the steps
    assert model.steps == list(range(STEPS)) and 3 not in model.files
    assert model.rows[5]["loss"] == 3.0 and math.isnan(model.rows[0]["routing_agreement"])
    step = model.step(0)
    assert len(opened) == 1 and step.num_samples == 3
    model.step(0)
    assert len(opened) == 1                                 # cached
    with pytest.raises(Exception, match="no step file"):
        model.step(3)


def test_sample_stats_and_tokens(known_run: Path) -> None:
    from axrl_debug.tui.data import RunModel
    from axrl_debug.tui.metrics import delta_bins, worst_order

    step = RunModel(known_run).step(0)
    st = step.stats
    assert st.analysed.tolist() == [19, 0, 3]
    assert st.max_abs[0] == pytest.approx(0.7, abs=1e-6) and math.isnan(st.max_abs[1])
    # 19 analysed tokens: 0.7 + 0.25 + 0.05 + 16 × 1e-4 (float32 rounding of the stored values)
    assert st.mean_abs[0] == pytest.approx((0.7 + 0.25 + 0.05 + 16e-4) / 19, rel=1e-3)
    # 45 valid rows × 2 layers, one (row, layer) differs; the swapped-order row agrees
    assert st.routing_agree[0] == pytest.approx(89 / 90)
    assert step.generated.tolist() == [19, 0, 3]
    t = step.sample(0)
    assert t.n == 46 and t.text[WORST] == " answer" and t.text[0] == "<|im_start|>"
    assert worst_order(t.delta)[:3].tolist() == [WORST, SECOND, THIRD]
    assert np.flatnonzero(t.disagrees()).tolist() == [DISAGREE]
    assert t.segment_kind(0) == "prompt" and t.segment_kind(20) == "assistant" and t.segment_kind(30) == "tool/env"
    assert len(set(t.segments().tolist())) == 4
    bins = delta_bins(t.delta)
    assert bins[WORST] == 4 and bins[SECOND] == 3 and bins[THIRD] == 2 and bins[0] == -1 and bins[16] == 0


def test_scan_and_spikes_in_process(known_run: Path) -> None:
    from axrl_debug.tui.data import RunModel

    model = RunModel(known_run)
    model.scan(model.steps)
    row = model.rows[0]
    assert row["mismatch_max"] == pytest.approx(0.7, abs=1e-6)
    assert row["routing_agreement"] < 1.0 and row["loss"] == LOSS[0]   # metrics.jsonl value kept
    spikes = model.detect_spikes()
    assert [s["metric"] for s in spikes.get(5, [])] == ["loss"] and set(spikes) == {5}


def test_replay_dump_is_read(known_run: Path) -> None:
    from axrl_debug.tui.data import RunModel

    n = 46 + 15 + 18
    write_replay_dump(known_run, 0, n)
    step = RunModel(known_run).step(0)
    assert step.replay_path is not None and step.replay_loss.tolist() == [0.25, 0.0, -0.125]
    t = step.sample(2)
    assert set(t.replay) == {"loss_contribution", "ratio"}
    assert t.replay["loss_contribution"][0] == pytest.approx(61e-3)   # row 61 of the step = token 0 of sample 2
