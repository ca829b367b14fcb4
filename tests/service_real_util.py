"""What the real-server suites of `axrl serve --training` share (tests/test_service_vllm.py,
tests/test_service_sglang.py): one service per module, launched as its own process with
`rollout.engine` set to the real server, driven by the official `tinker` SDK, and the checks a
Tinker user relies on — sampled logprobs equal the trainer's teacher-forced ones, new sampler
weights reach the server, `compute_logprobs` agrees, and the run's trace is readable by
`axrl-debug mismatch`.

The model is the tiny-moe preset (float32, random init), the prompt a dozen tokens, each sample
eight: the suites measure weight-sync time, not throughput.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np
import tinker
from tinker import types

from axrl.inference.remote.launcher import free_port
from axrl.model import build_model, preset_config, save_hf
from axrl.tokenizer import Tokenizer

ENV = {"TINKER_API_KEY": "tml-local", "TINKER_TELEMETRY": "0", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1",
       "TOKENIZERS_PARALLELISM": "false"}
# float32 on both sides, as the real-server suites (tests/test_vllm_real.py, test_sglang_real.py)
# measure it: the same math up to kernel order (max |Δ| ~1e-6).
LOGPROB_TOL = 1e-4
PROMPT = "what is two plus three"
SAMPLES, MAX_TOKENS, SEED = 2, 8, 3


def moe_model(root: Path) -> Path:
    """A random-init tiny-moe Qwen3 (vLLM's CPU kernels take it) with AxRL's tokenizer."""
    tok = Tokenizer.default()
    cfg = preset_config("tiny-moe", vocab_size=tok.vocab_size, eos_token_id=tok.eos_token_id,
                        pad_token_id=tok.pad_token_id)
    return save_hf(build_model(cfg, seed=0), root / "moe", tokenizer=tok)


class Service:
    """`axrl serve --training --full-finetune` on `model` with `sets` (`--set key=value`), until closed."""

    def __init__(self, model: Path, root: Path, sets: dict[str, str], startup_s: float = 600) -> None:
        self.port, self.run, self.model = free_port(), root / "run", model
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = root / "service.log"
        self.log = open(self.log_path, "w")
        argv = [sys.executable, "-m", "axrl.cli", "serve", "--model-path", str(model), "--training",
                "--full-finetune", "--run-dir", str(self.run), "--port", str(self.port)]
        for k, v in sets.items():
            argv += ["--set", f"{k}={v}"]
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, **ENV})
        deadline = time.time() + startup_s
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"axrl serve --training exited: {self.log_text()[-3000:]}")
            try:
                if httpx.get(f"{self.url}/api/v1/healthz", timeout=2).status_code == 200:
                    self.startup_s = time.perf_counter() - t0
                    return
            except httpx.HTTPError:
                time.sleep(0.5)
        self.close()
        raise AssertionError(f"axrl serve --training did not come up in {startup_s:.0f} s: {self.log_text()[-3000:]}")

    def log_text(self) -> str:
        self.log.flush()
        return self.log_path.read_text(errors="replace")

    def close(self) -> None:
        """Stop the service (it stops the servers it launched) and wait for it."""
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(60)
        self.log.close()


@dataclass
class Scenario:
    """What one SDK session against the service did: sampling at the base weights, a training step
    on those samples, sampling at the new weights, a second step; each phase's trainer logprobs."""

    service: Service
    prompt: list[int]
    before: list[types.SampledSequence] = field(default_factory=list)
    after: list[types.SampledSequence] = field(default_factory=list)
    trainer_before: list[np.ndarray] = field(default_factory=list)    # forward logprobs, base weights
    trainer_after: list[np.ndarray] = field(default_factory=list)     # forward logprobs, new weights
    scored_before: list[float | None] = field(default_factory=list)   # compute_logprobs, base weights
    scored_after: list[float | None] = field(default_factory=list)
    times: dict[str, float] = field(default_factory=dict)


def rl_datum(prompt: list[int], seq: types.SampledSequence) -> types.Datum:
    """An RL datum as the cookbook builds it: prompt then completion, the sampler's logprobs and an
    advantage of 1 on the completion."""
    full = prompt + list(seq.tokens)
    pad = [0.0] * (len(prompt) - 1)
    return types.Datum(model_input=types.ModelInput.from_ints(full[:-1]),
                       loss_fn_inputs={"target_tokens": np.asarray(full[1:]),
                                       "logprobs": np.asarray(pad + list(seq.logprobs), np.float32),
                                       "advantages": np.asarray(pad + [1.0] * len(seq.tokens), np.float32)})


def trainer_logprobs(tc: tinker.TrainingClient, prompt: list[int], seqs: list[types.SampledSequence]) -> list[np.ndarray]:
    """The trainer's teacher-forced logprob of every token after the first of prompt + completion."""
    out = tc.forward([rl_datum(prompt, s) for s in seqs], "importance_sampling").result()   # no update
    return [np.asarray(o["logprobs"].tolist(), np.float64) for o in out.loss_fn_outputs]


def _timed(times: dict[str, float], key: str, call):
    t0 = time.perf_counter()
    out = call()
    times[key] = round(time.perf_counter() - t0, 2)
    return out


def run_scenario(service: Service) -> Scenario:
    """The SDK session every real-server suite checks (see `Scenario`)."""
    sc = tinker.ServiceClient(base_url=service.url, api_key="tml-local")
    tc = sc.create_lora_training_client(base_model=str(service.model), rank=4).result()
    sc_ = Scenario(service, Tokenizer.default().encode(PROMPT))
    params = types.SamplingParams(max_tokens=MAX_TOKENS, seed=SEED, stop=[])
    prompt_in = types.ModelInput.from_ints(sc_.prompt)

    base = sc.create_sampling_client(base_model=str(service.model)).result()
    sc_.before = _timed(sc_.times, "sample_base_s", lambda: base.sample(prompt_in, SAMPLES, params).result()).sequences
    sc_.trainer_before = trainer_logprobs(tc, sc_.prompt, sc_.before)
    whole = types.ModelInput.from_ints(sc_.prompt + list(sc_.before[0].tokens))
    sc_.scored_before = base.compute_logprobs(whole).result()

    tc.forward_backward([rl_datum(sc_.prompt, s) for s in sc_.before], "importance_sampling").result()
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()                          # trace step 0
    path = _timed(sc_.times, "save_weights_for_sampler_s", lambda: tc.save_weights_for_sampler("step1").result().path)
    new = sc.create_sampling_client(model_path=path).result()
    # the first request on new weights waits for the weight sync; the second samples only
    sc_.after = _timed(sc_.times, "sample_new_weights_first_s",
                       lambda: new.sample(prompt_in, SAMPLES, params).result()).sequences
    _timed(sc_.times, "sample_new_weights_again_s", lambda: new.sample(prompt_in, SAMPLES, params).result())
    sc_.times["weight_sync_s"] = round(sc_.times["sample_new_weights_first_s"] - sc_.times["sample_new_weights_again_s"], 2)
    sc_.trainer_after = trainer_logprobs(tc, sc_.prompt, sc_.after)
    sc_.scored_after = new.compute_logprobs(types.ModelInput.from_ints(sc_.prompt + list(sc_.after[0].tokens))).result()

    tc.forward_backward([rl_datum(sc_.prompt, s) for s in sc_.after], "importance_sampling").result()
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()                          # trace step 1
    wait_for_step(service.run, 1)
    return sc_


def session_on(engine: str, python: str, root: Path, sets: dict[str, str]) -> Scenario:
    """The module's session on real `engine` servers ("sglang" / "vllm") launched with `python`
    on a free port: the service started on tiny-moe, the SDK session run, the service stopped.
    `sets`: the engine's further `--set`s. The port is kept in `times[f"{engine}_port"]`."""
    port = free_port()
    service = Service(moe_model(root), root, {"rollout.engine": engine, f"rollout.{engine}.python": python,
                                              f"rollout.{engine}.base_port": str(port),
                                              f"rollout.{engine}.log_dir": str(root / f"{engine}-logs"), **sets})
    try:
        scenario = run_scenario(service)
    finally:
        service.close()
    scenario.times["service_startup_s"] = round(service.startup_s, 1)
    scenario.times[f"{engine}_port"] = port
    print(f"[service-{engine}] {json.dumps(measured(scenario))}", file=sys.__stderr__, flush=True)
    return scenario


def wait_for_step(run: Path, step: int) -> None:
    """Step files are written in the background: wait until step `step`'s is on disk."""
    deadline = time.time() + 120
    while not (run / "trace" / f"step_{step:06d}.h5").is_file():
        assert time.time() < deadline, f"step {step} was never written to {run}/trace"
        time.sleep(0.1)


def completion_gap(prompt: list[int], seqs: list[types.SampledSequence], trainer: list[np.ndarray]) -> float:
    """max |sampler − trainer| logprob over the sampled tokens."""
    n = len(prompt) - 1
    return max(float(np.max(np.abs(np.asarray(s.logprobs, np.float64) - t[n:]))) for s, t in zip(seqs, trainer))


def scoring_gap(scored: list[float | None], trainer: np.ndarray) -> float:
    """max |compute_logprobs − trainer| over every position but the first (which has none)."""
    assert scored[0] is None and len(scored) == len(trainer) + 1
    return float(np.max(np.abs(np.asarray(scored[1:], np.float64) - trainer)))


def check_base_sampling(sc: Scenario) -> None:
    """At the served weights the server's sampled logprobs and compute_logprobs are the trainer's."""
    assert [len(s.tokens) for s in sc.before] == [MAX_TOKENS] * SAMPLES
    assert completion_gap(sc.prompt, sc.before, sc.trainer_before) < LOGPROB_TOL
    assert scoring_gap(sc.scored_before, sc.trainer_before[0]) < LOGPROB_TOL


def check_new_weights(sc: Scenario) -> None:
    """After the step, the server samples from the saved sampler weights: its outputs change (same
    seed), and its logprobs and prompt scores are the trainer's new ones."""
    if [s.tokens for s in sc.after] == [s.tokens for s in sc.before]:
        moved = max(abs(a - b) for x, y in zip(sc.after, sc.before) for a, b in zip(x.logprobs, y.logprobs))
        assert moved > 100 * LOGPROB_TOL, "the samples at the new weights equal the base weights' samples"
    assert completion_gap(sc.prompt, sc.after, sc.trainer_after) < LOGPROB_TOL
    assert scoring_gap(sc.scored_after, sc.trainer_after[0]) < LOGPROB_TOL


def check_step_mismatch(sc: Scenario, step: int) -> dict:
    """`axrl-debug mismatch` reads the step: every sampled token, at float32 rounding; its report."""
    report = mismatch_report(sc.service.run, step)
    assert report["tokens"]["analysed"] == SAMPLES * MAX_TOKENS
    assert report["metrics"]["max_abs"] < LOGPROB_TOL
    return report


def measured(sc: Scenario) -> dict[str, float]:
    """The session's timings and its largest sampler–trainer and scorer–trainer gaps (printed by the suites)."""
    return {**sc.times,
            "max_gap_sampled": max(completion_gap(sc.prompt, sc.before, sc.trainer_before),
                                   completion_gap(sc.prompt, sc.after, sc.trainer_after)),
            "max_gap_scored": max(scoring_gap(sc.scored_before, sc.trainer_before[0]),
                                  scoring_gap(sc.scored_after, sc.trainer_after[0]))}


def axrl_debug(*args: str) -> subprocess.CompletedProcess:
    """Run `axrl-debug` as a user does."""
    return subprocess.run([sys.executable, "-m", "axrl_debug.cli", *args], capture_output=True, text=True,
                          env={**os.environ, **ENV}, timeout=600)


def mismatch_report(run: Path, step: int) -> dict:
    """`axrl-debug mismatch RUN --step N --json`, parsed (asserting it ran)."""
    out = axrl_debug("mismatch", str(run), "--step", str(step), "--json")
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    return json.loads(out.stdout)
