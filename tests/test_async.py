"""The asynchronous runtime end to end: the staleness bound read back from the trace, the three
partial-rollout modes, bitwise-reproducible async runs (two processes), SIGKILL + --resume with
groups in flight, the engine-vs-staleness split of the mismatch, and the logs (strict JSON,
TensorBoard). Real loop, real engine, real HDF5; a micro MoE warmed up once per module."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

from trace_util import trace_datasets
from train_util import QUICKSTART, debug, train_command
from axrl.agents.tasks import get_task
from axrl.config import load_config
from axrl.trace.kill_points import ENV as KILL_ENV
from axrl.model import build_model, preset_config, save_hf
from axrl.assembly.build import train
from axrl.runtime.warmup import warm_up
from axrl.tokenizer import Tokenizer
from axrl.train import TorchBackend, TorchBackendConfig

torch.set_num_threads(1)
ECHO_TAIL = "{turns: 1, long_turns: 4, long_share: 0.25}"  # a share of episodes 4x longer than the rest
# 8x longer episodes: some groups outlive two weight updates and are too stale for eta = 2.
LONG_TAIL = ("steps=5", "rollout.max_staleness=2", "rollout.partial_rollout=recompute", "rollout.max_turns=8",
             "data.task_args={turns: 1, long_turns: 8, long_share: 0.3}", "rollout.max_context_len=320")


@pytest.fixture(scope="module")
def warm_model(tmp_path_factory) -> Path:
    """A micro MoE taught the echo format (so rewards and gradients are real), as an HF directory."""
    tok = Tokenizer.default()
    model = build_model(preset_config("micro-moe", vocab_size=tok.vocab_size, eos_token_id=tok.eos_token_id,
                                      pad_token_id=tok.pad_token_id), seed=0)
    # weight_decay and micro_batch_tokens as before the Python defaults took the YAML's (0.0, 4096):
    # the staleness tests need this warm model's episode lengths to reach the bound.
    backend = TorchBackend(model, TorchBackendConfig(num_threads=1, weight_decay=0.01, micro_batch_tokens=0))
    warm_up(backend, tok, get_task("echo", turns=1, long_turns=4, long_share=0.25), steps=150, batch_size=16,
            lr=2e-3, seed=0)
    return save_hf(model, tmp_path_factory.mktemp("warm") / "model", tok)


def settings(model: Path, *extra: str) -> list[str]:
    return ["steps=4", f"model.path={model}", "warmup.steps=0", "data.task=echo", f"data.task_args={ECHO_TAIL}",
            "data.prompts_per_step=4", "rollout.group_size=4", "rollout.max_new_tokens=12", "rollout.max_turns=4",
            "rollout.max_context_len=192", "rollout.max_batch_size=8", "algo.loss_agg=token-mean", "train.lr=3e-3",
            "train.updates_per_step=1", "eval.every=0", "checkpoint.every=1", "checkpoint.quiescent=false", "runtime.threads=1",
            "runtime.mode=async", "trace.behaviour_logprob=true", *extra]


def run(tmp_path: Path, name: str, model: Path, *extra: str) -> Path:
    out = tmp_path / name
    train(load_config(QUICKSTART, settings(model, *extra)), out)
    return out


def steps(run_dir: Path) -> list[dict]:
    """Per step: the datasets the tests read."""
    out = []
    for f in sorted((run_dir / "trace").glob("step_*.h5")):
        with h5py.File(f) as h:
            out.append({k: h[k][()] for k in ("samples/offsets", "samples/group_id", "samples/sample_id",
                                                "tokens/loss_mask", "tokens/policy_version", "tokens/rollout_logprob",
                                                "tokens/old_logprob", "tokens/behaviour_train_logprob",
                                                "samples/continuations")}
                       | {"version": int(h.attrs["policy_version"])}
                       | {k: h[k][()] for k in ("pool/dropped_group_id", "pool/dropped_reason", "pool/rerun_group_id")
                          if k in h})
    return out


def sample_versions(s: dict) -> list[np.ndarray]:
    off, pv = s["samples/offsets"], s["tokens/policy_version"]
    return [pv[off[i]:off[i + 1]][pv[off[i]:off[i + 1]] >= 0] for i in range(len(off) - 1)]


def engine_gap(s: dict) -> np.ndarray:
    gen = s["tokens/policy_version"] >= 0
    return np.abs(s["tokens/behaviour_train_logprob"][gen].astype(np.float64) - s["tokens/rollout_logprob"][gen])


@pytest.fixture(scope="module")
def runs(warm_model, tmp_path_factory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("async")
    return {
        "continue": run(tmp, "continue", warm_model, "rollout.max_staleness=2"),
        "recompute": run(tmp, "recompute", warm_model, "rollout.max_staleness=2", "rollout.partial_rollout=recompute"),
        "drop": run(tmp, "drop", warm_model, "rollout.max_staleness=2", "rollout.partial_rollout=drop"),
        "eta1": run(tmp, "eta1", warm_model, "rollout.max_staleness=1", "rollout.partial_rollout=recompute"),
        **{f"stale_{policy}": run(tmp, f"stale_{policy}", warm_model, *LONG_TAIL, f"rollout.stale_policy={policy}")
           for policy in ("rerun", "drop")},
    }


# ---------------------------------------------------------------- the staleness bound

@pytest.mark.parametrize("name,eta", [("continue", 2), ("recompute", 2), ("drop", 2), ("eta1", 1),
                                      ("stale_rerun", 2), ("stale_drop", 2)])
def test_no_trained_token_is_staler_than_the_bound(runs, name, eta):
    lags = []
    for s in steps(runs[name]):
        trained = s["tokens/loss_mask"] > 0
        lag = s["version"] - s["tokens/policy_version"][trained]
        assert lag.min() >= 0 and lag.max() <= eta, (name, s["version"], lag.max())
        lags += lag.tolist()
    assert max(lags) == eta, f"{name}: the run never reached the bound, so it tests nothing"


@pytest.mark.parametrize("policy", ["rerun", "drop"])
def test_too_stale_groups_are_rerun_or_dropped_and_recorded(runs, policy):
    ss = steps(runs[f"stale_{policy}"])
    rows = [json.loads(line) for line in (runs[f"stale_{policy}"] / "metrics.jsonl").read_text().splitlines()]
    reruns = [g for s in ss for g in s.get("pool/rerun_group_id", [])]
    dropped = [g for s in ss for g in s.get("pool/dropped_group_id", [])]
    assert (reruns if policy == "rerun" else dropped), "no group outlived the bound"
    assert len(reruns) == sum(r["stale_reruns"] for r in rows) and len(dropped) == sum(r["stale_dropped"] for r in rows)
    trained = {int(g) for s in ss for g in s["samples/group_id"]}
    if policy == "rerun":  # a re-run group keeps its identity and is trained once, later
        assert set(reruns) & trained
    else:
        assert not set(dropped) & trained
        reasons = {str(r.decode() if isinstance(r, bytes) else r) for s in ss for r in s.get("pool/dropped_reason", [])}
        assert reasons == {"stale"}


# ---------------------------------------------------------------- partial rollout

def test_recompute_labels_every_token_with_the_weights_that_generated_it(runs):
    """Interrupted turns resume under the new weights; every token's recorded version is the one
    whose weights reproduce its rollout logprob (up to engine-vs-trainer kernel noise), on both
    sides of each update."""
    ss = steps(runs["recompute"])
    assert sum(int(s["samples/continuations"].sum()) for s in ss) > 0
    assert any(len(np.unique(v)) > 1 for s in ss for v in sample_versions(s)), "no sample spans an update"
    for s in ss:
        assert engine_gap(s).max() < 1e-4
        assert all((np.diff(v) >= 0).all() for v in sample_versions(s))


def test_continue_decodes_on_over_the_old_kv_cache(runs):
    """In place: tokens after an update within a request are generated by the new weights over KV
    entries of the old ones — the trainer cannot reproduce that, so those tokens (and only those)
    show a real engine gap."""
    ss = steps(runs["continue"])
    assert sum(int(s["samples/continuations"].sum()) for s in ss) == 0
    mixed = [(s, i) for s in ss for i, v in enumerate(sample_versions(s)) if len(np.unique(v)) > 1]
    assert mixed, "no request spans an update"
    for s in ss:
        assert all((np.diff(v) >= 0).all() for v in sample_versions(s))
    def gaps(single_version: bool) -> np.ndarray:
        out = []
        for s in ss:
            off, pv = s["samples/offsets"], s["tokens/policy_version"]
            for i, v in enumerate(sample_versions(s)):
                if (len(np.unique(v)) <= 1) == single_version:
                    t = slice(off[i], off[i + 1])
                    out.append(engine_gap({"tokens/policy_version": pv[t], "tokens/rollout_logprob":
                                           s["tokens/rollout_logprob"][t], "tokens/behaviour_train_logprob":
                                           s["tokens/behaviour_train_logprob"][t]}))
        return np.concatenate(out)
    pure, spanning = gaps(True), gaps(False)
    assert pure.max() < 1e-4                       # samples that never saw an update: kernel noise only
    assert spanning.max() > 10 * pure.max()        # decoding over old-weight KV entries: a real gap


def test_drop_keeps_only_episodes_generated_by_one_version(runs):
    ss = steps(runs["drop"])
    reasons = [r.decode() if isinstance(r, bytes) else str(r) for s in ss for r in s.get("pool/dropped_reason", [])]
    assert "partial_drop" in reasons
    assert all(len(np.unique(v)) <= 1 for s in ss for v in sample_versions(s))
    assert max(engine_gap(s).max() for s in ss) < 1e-4


# ---------------------------------------------------------------- identity and the split

def test_ids_are_stream_positions_and_each_group_is_trained_once(runs):
    for name in runs:
        ss = steps(runs[name])
        gids = np.concatenate([np.unique(s["samples/group_id"]) for s in ss])
        assert len(gids) == len(set(gids.tolist())), name
        for s in ss:
            assert (s["samples/sample_id"] // 4 == s["samples/group_id"]).all()


def test_lag0_tokens_have_no_staleness_and_the_split_adds_up(runs):
    """The logged split is the trace's, step by step: mismatch_engine = mean |behaviour − rollout|
    and mismatch_staleness = mean |old − behaviour| over the tokens of mismatch = mean |old − rollout|
    (so mismatch ≤ their sum). A token generated by the weights it is trained on (lag 0) has no
    staleness; lagged tokens do, and under recompute (engine part: kernel noise) the staleness
    part carries the step's mismatch."""
    run_dir = runs["recompute"]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    ss = steps(run_dir)
    assert [r["step"] for r in rows] == list(range(len(ss))) and len(ss) == 4
    lagged_steps = 0
    for s, row in zip(ss, rows):
        old, roll, beh = (s[k].astype(np.float64) for k in
                          ("tokens/old_logprob", "tokens/rollout_logprob", "tokens/behaviour_train_logprob"))
        tokens = (s["tokens/loss_mask"] > 0) & np.isfinite(old) & np.isfinite(roll) & np.isfinite(beh)
        lag = s["version"] - s["tokens/policy_version"]
        engine, stale, total = (float(np.abs(d[tokens]).mean()) for d in (beh - roll, old - beh, old - roll))
        assert row["mismatch_engine"] == pytest.approx(engine, rel=1e-12), row["step"]
        assert row["mismatch_staleness"] == pytest.approx(stale, rel=1e-12), row["step"]
        assert row["mismatch"] == pytest.approx(total, rel=1e-12), row["step"]
        assert total <= engine + stale + 1e-12
        lag0, lagged = tokens & (lag == 0), tokens & (lag > 0)
        assert np.array_equal(beh[lag0], old[lag0])     # no staleness without a weight update in between
        if lagged.any():
            lagged_steps += 1
            drift = np.abs(old - beh)[lagged]
            assert np.count_nonzero(drift) >= 0.9 * drift.size and drift.mean() > 1e-3, row["step"]
            assert stale > 1000 * engine and total == pytest.approx(stale, rel=1e-3), row
        else:
            assert stale == 0.0
    assert lagged_steps >= 2, "the run never trained a stale token, so the split was never tested"


def test_engine_noise_lands_in_the_engine_part(warm_model, tmp_path):
    """faults.rollout_logprob_noise corrupts what the engine reported: Δ_engine grows by the noise,
    Δ_staleness at that step is bit for bit the clean run's."""
    clean = run(tmp_path, "clean", warm_model, "steps=3", "rollout.partial_rollout=recompute")
    noisy = run(tmp_path, "noisy", warm_model, "steps=3", "rollout.partial_rollout=recompute",
                "faults.rollout_logprob_noise={step: 2, std: 0.5}")
    a, b = steps(clean)[2], steps(noisy)[2]
    assert np.array_equal(a["tokens/behaviour_train_logprob"], b["tokens/behaviour_train_logprob"], equal_nan=True)
    assert np.array_equal(a["tokens/old_logprob"], b["tokens/old_logprob"])
    rows = {p: [json.loads(x) for x in (p / "metrics.jsonl").read_text().splitlines()][2] for p in (clean, noisy)}
    assert rows[noisy]["mismatch_staleness"] == rows[clean]["mismatch_staleness"]
    assert rows[noisy]["mismatch_engine"] > 0.3 > 1000 * rows[clean]["mismatch_engine"]  # E|N(0, .5)| = 0.4
    out = debug("mismatch", noisy, "--step", 2, "--json")
    split = json.loads(out.stdout)["delta_split"]
    assert out.exit_code == 0 and split["engine"]["abs_share"] > 0.9


# ---------------------------------------------------------------- determinism, kill and resume

def _axrl(run_dir: Path, model: Path, *extra: str) -> list[str]:
    return train_command(run_dir, settings(model, *extra))


ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def test_deterministic_async_runs_write_identical_traces(warm_model, tmp_path):
    procs = [subprocess.Popen(_axrl(tmp_path / f"r{i}", warm_model, "rollout.max_staleness=2"), env=ENV,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) for i in range(2)]
    for p in procs:
        assert p.wait(timeout=600) == 0, p.stderr.read().decode()[-2000:]
    assert_same_traces(tmp_path / "r0", tmp_path / "r1")


def assert_same_traces(run_a: Path, run_b: Path) -> None:
    """Every dataset of every step file equal, bit for bit."""
    a, b = trace_datasets(run_a), trace_datasets(run_b)
    assert a.keys() == b.keys() and len(a) > 100

    def same(x, y) -> bool:
        x, y = np.asarray(x), np.asarray(y)
        return x.tolist() == y.tolist() if x.dtype == object else x.tobytes() == y.tobytes()
    differ = [k for k in a if not same(a[k], b[k])]
    assert not differ, differ[:5]


def test_sigkill_and_resume_lose_no_group_and_train_none_twice(warm_model, tmp_path):
    """SIGKILLed three times, each at a point the run itself signals (AXRL_KILL_AT: the run kills
    itself the moment it gets there, axrl/trace/kill_points.py) — step 1's trace file written but
    not yet renamed, the checkpoint before step 3 written but not renamed, the checkpoint before
    step 4 complete — with groups in flight each time (async), and resumed until done: every group
    started is trained once, recorded as dropped, or pending in the final checkpoint."""
    run_dir = tmp_path / "run"
    extra = ("steps=6", "rollout.max_staleness=2", "rollout.partial_rollout=recompute")
    args = _axrl(run_dir, warm_model, *extra)
    # (the kill point, the checkpoints a resume may start from: the trace is written in the
    # background, so the main loop may or may not have saved the next checkpoint by then)
    kill_points = [("written:step_000001.h5", (1, 2)), ("written:step_000003", (2,)), ("renamed:step_000004", (4,))]
    _kill_and_resume(args, run_dir, kill_points, tmp_path / "stderr.txt", steps=6)
    trained, dropped = [], []
    for s in steps(run_dir):
        trained += np.unique(s["samples/group_id"]).tolist()
        dropped += s.get("pool/dropped_group_id", np.zeros(0, int)).tolist()
    final = json.loads((run_dir / "checkpoints" / "step_000006" / "state.json").read_text())["rollout"]
    accounted = trained + dropped + final["pending"]
    assert len(accounted) == len(set(accounted)), "a group was trained (or dropped) twice"
    assert set(range(final["next_position"])) == set(accounted), "a started group was lost"


def _landed(run_dir: Path, point: str) -> bool:
    """The run directory shows the run died exactly at `point` (`written:NAME`: NAME's tmp is
    there and NAME is not; `renamed:NAME`: NAME is there, complete)."""
    kind, name = point.split(":")
    where = run_dir / ("trace" if name.endswith(".h5") else "checkpoints")
    tmp, final = where / (name + ".tmp"), where / name
    if kind == "written":
        return tmp.exists() and not final.exists()
    return final.exists() and not tmp.exists() and (name.endswith(".h5") or (final / "state.json").is_file())


def _kill_and_resume(args: list[str], run_dir: Path, kill_points: list[tuple[str, tuple[int, ...]]],
                     stderr: Path, steps: int) -> None:
    """Start the run with AXRL_KILL_AT set to each kill point in turn (the run SIGKILLs itself the
    moment it reaches it: no race with a watcher), check it died there, --resume it, then resume
    it to the end; each resume must start at a checkpoint the point allows."""
    for attempt, (point, _) in enumerate(kill_points):
        with open(stderr, "w") as err:
            proc = subprocess.run(args + (["--resume"] if attempt else []), env={**ENV, KILL_ENV: point},
                                  stdout=subprocess.DEVNULL, stderr=err, timeout=600)
        assert proc.returncode == -signal.SIGKILL, f"{point}: the run exited {proc.returncode}: " \
                                                   f"{stderr.read_text()[-2000:]}"
        assert _landed(run_dir, point), point
    with open(stderr, "w") as err:
        done = subprocess.run(args + ["--resume"], env=ENV, stdout=subprocess.DEVNULL, stderr=err, timeout=600)
    assert done.returncode == 0, stderr.read_text()[-2000:]
    assert len(list((run_dir / "trace").glob("step_*.h5"))) == steps
    resumes = [r["from_step"] for r in json.loads((run_dir / "manifest.json").read_text())["resumes"]]
    assert len(resumes) == len(kill_points), resumes
    for (point, expected), got in zip(kill_points, resumes):
        assert got in expected, (point, resumes)


def test_sigkill_and_resume_continue_the_uninterrupted_schedule_bitwise(warm_model, tmp_path):
    """checkpoint.quiescent (the default): a deterministic async run (η = 2, checkpoints every 2
    steps) killed (AXRL_KILL_AT, from inside) once step 1's trace file is written, once step 3's
    is, and just after the checkpoint before step 4 (groups of batch 4 already running), then
    resumed, writes every step file bit for bit as the uninterrupted run does. The pipeline
    drains only at the checkpoints: steps 2 and 4 train lag-0 tokens only, the others train stale ones."""
    extra = ("steps=6", "rollout.max_staleness=2", "rollout.partial_rollout=continue", "checkpoint.every=2",
             "checkpoint.quiescent=true")
    whole = subprocess.Popen(_axrl(tmp_path / "whole", warm_model, *extra), env=ENV, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE)
    run_dir = tmp_path / "killed"
    kill_points = [("written:step_000001.h5", (0,)), ("written:step_000003.h5", (2,)), ("renamed:step_000004", (4,))]
    _kill_and_resume(_axrl(run_dir, warm_model, *extra), run_dir, kill_points, tmp_path / "stderr.txt", steps=6)
    assert whole.wait(timeout=600) == 0, whole.stderr.read().decode()[-2000:]
    assert_same_traces(tmp_path / "whole", run_dir)
    lag_max = [max(int(s["version"] - v.min()) if v.size else 0 for v in sample_versions(s)) for s in steps(run_dir)]
    assert lag_max[2] == lag_max[4] == 0 and max(lag_max[1], lag_max[3], lag_max[5]) > 0, lag_max


# ---------------------------------------------------------------- logs

def test_metrics_are_strict_json_and_go_to_tensorboard(warm_model, tmp_path):
    out = run(tmp_path, "tb", warm_model, "steps=2", "logging.tensorboard=true",
              "faults.rollout_logprob_noise={step: 0, std: 100.0}")  # huge noise: non-finite metrics
    lines = (out / "metrics.jsonl").read_text().splitlines()
    rows = [json.loads(x, parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}")) for x in lines]
    assert len(rows) == 2 and "NaN" not in "".join(lines)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("grad_norm")] == [0, 1]
    assert events.Scalars("version_lag_max")[1].value == rows[1]["version_lag_max"]


def test_async_steps_replay_bitwise(runs):
    """Replay re-executes the training side of an asynchronous step from the trace, bit for bit."""
    for step in (2, 3):
        out = debug("replay", runs["recompute"], "--step", step, "--json")
        assert out.exit_code == 0, out.output
        assert json.loads(out.stdout)["verdict"] == "bitwise-equal"
