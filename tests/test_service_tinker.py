"""`axrl serve --training` with the real `tinker` SDK (0.38.0) and tinker-cookbook (0.6.1) recipes.

The server runs as its own process on 127.0.0.1; the cookbook's arithmetic math_rl recipe runs
unchanged as a subprocess against it; then the run directory is checked with `axrl-debug`
(summary, mismatch, replay bitwise). The SDK itself drives supervised steps with real gradients,
sampling with string and token stops, and user errors. Nothing here skips: a missing package fails.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import h5py
import httpx
import numpy as np
import pytest
import tinker
import tinker_cookbook
from tinker import types

from axrl.inference.sglang.launcher import free_port
from axrl.model import build_model, preset_config, save_hf
from axrl.tokenizer import Tokenizer
from axrl.trace import TraceReader

ENV = {"TINKER_API_KEY": "tml-local", "TINKER_TELEMETRY": "0", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1",
       "TOKENIZERS_PARALLELISM": "false"}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random-init tiny dense Qwen3 with AxRL's tokenizer (what `axrl model init` writes)."""
    tok = Tokenizer.default()
    cfg = preset_config("tiny-dense", vocab_size=tok.vocab_size, eos_token_id=tok.eos_token_id,
                        pad_token_id=tok.pad_token_id)
    return save_hf(build_model(cfg, seed=0), tmp_path_factory.mktemp("svc") / "model", tokenizer=tok)


class Server:
    def __init__(self, model: Path, run: Path, log: Path, *args: str) -> None:
        self.port, self.run = free_port(), run
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(log, "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "axrl.cli", "serve", "--model-path", str(model),
                                      "--training", "--run-dir", str(run), "--port", str(self.port), *args],
                                     stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, **ENV})
        deadline = time.time() + 120
        while time.time() < deadline:
            assert self.proc.poll() is None, f"axrl serve --training exited: {log.read_text()[-2000:]}"
            try:
                if httpx.get(f"{self.url}/api/v1/healthz", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.5)
        raise AssertionError(f"axrl serve --training did not come up: {log.read_text()[-2000:]}")

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)
        self.log.close()


@pytest.fixture()
def server(model_dir: Path, tmp_path: Path) -> Iterator[Server]:
    s = Server(model_dir, tmp_path / "run", tmp_path / "server.log")
    yield s
    s.close()
    assert s.proc.returncode is not None


def _debug(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "axrl_debug.cli", *args], capture_output=True, text=True,
                          env={**os.environ, **ENV}, timeout=600)


def test_cookbook_math_rl_runs_unchanged_and_every_step_is_recorded(server: Server, model_dir: Path,
                                                                    tmp_path: Path) -> None:
    assert tinker.__version__ == "0.38.0" and tinker_cookbook.__version__ == "0.6.1"
    log_path = tmp_path / "cookbook"
    cmd = [sys.executable, "-m", "tinker_cookbook.recipes.math_rl.train", "env=arithmetic", f"model_name={model_dir}",
           "renderer_name=role_colon", "loss_fn=importance_sampling", "group_size=4", "groups_per_batch=8",
           "max_tokens=5", "max_steps=3", "eval_every=0", "save_every=2", f"log_path={log_path}"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=tmp_path,
                          env={**os.environ, **ENV, "TINKER_BASE_URL": server.url})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    steps = [json.loads(line).get("step") for line in (log_path / "metrics.jsonl").read_text().splitlines()]
    assert {0, 1, 2} <= set(steps)
    _wait_for_step(server.run, 2)
    reader = TraceReader(server.run)
    assert reader.steps == [0, 1, 2]
    mismatch = _debug("mismatch", str(server.run), "--json")
    assert mismatch.returncode == 0, mismatch.stderr
    report = json.loads(mismatch.stdout)
    assert report["tokens"]["analysed"] > 0          # the sampled tokens, sampler vs trainer logprobs
    assert np.isfinite(report["metrics"]["mean_abs"])
    summary = _debug("summary", str(server.run), "--json")
    assert summary.returncode == 0, summary.stderr
    replay = _debug("replay", str(server.run), "--step", "1", "--json")
    assert replay.returncode == 0, replay.stdout[-2000:] + replay.stderr[-2000:]
    assert json.loads(replay.stdout)["verdict"] == "bitwise-equal"


def _wait_for_step(run: Path, step: int) -> None:
    """Step files are written in the background: wait until step `step`'s is on disk."""
    deadline = time.time() + 60
    while not (run / "trace" / f"step_{step:06d}.h5").is_file():
        assert time.time() < deadline, f"step {step} was never written to {run}/trace"
        time.sleep(0.1)


def _datum(ids: list[int]) -> types.Datum:
    return types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]),
                       loss_fn_inputs={"target_tokens": np.asarray(ids[1:]),
                                       "weights": np.ones(len(ids) - 1, np.float32)})


def test_sdk_supervised_steps_sampling_stops_and_errors(server: Server, model_dir: Path) -> None:
    sc = tinker.ServiceClient(base_url=server.url, api_key="tml-local")
    tc = sc.create_lora_training_client(base_model=str(model_dir), rank=4).result()
    info = tc.get_info()
    assert info.is_lora and info.lora_rank == 4 and info.model_data.model_name == str(model_dir)
    assert info.model_id.endswith(":train:0")
    tok = tc.get_tokenizer()
    ids = tok.encode("the quick brown fox jumps over the lazy dog")
    losses = []
    for _ in range(3):
        fb = tc.forward_backward([_datum(ids), _datum(ids[:6])], "cross_entropy").result()
        lp = fb.loss_fn_outputs[0]["logprobs"].tolist()
        assert len(lp) == len(ids) - 1
        assert fb.metrics["loss:sum"] == pytest.approx(-(sum(lp) + sum(fb.loss_fn_outputs[1]["logprobs"].tolist())),
                                                       rel=1e-4)
        losses.append(fb.metrics["loss:sum"])
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    assert losses[-1] < losses[0]
    _wait_for_step(server.run, 2)
    replay = _debug("replay", str(server.run), "--step", "2", "--json")
    assert replay.returncode == 0 and json.loads(replay.stdout)["verdict"] == "bitwise-equal", replay.stdout[-2000:]

    sampler = tc.save_weights_and_get_sampling_client().result()
    prompt = types.ModelInput.from_ints(ids[:4])
    free = sampler.sample(prompt, 1, types.SamplingParams(max_tokens=12, seed=5, stop=[])).result()
    out = free.sequences[0].tokens
    assert len(out) == 12 and free.sequences[0].stop_reason == "length"
    at_token = sampler.sample(prompt, 1, types.SamplingParams(max_tokens=12, seed=5, stop=[out[3]])).result()
    first = out.index(out[3])
    assert at_token.sequences[0].tokens == out[:first + 1] and at_token.sequences[0].stop_reason == "stop"
    text = tok.decode(out[5:7])
    at_text = sampler.sample(prompt, 1, types.SamplingParams(max_tokens=12, seed=5, stop=[text])).result()
    got = at_text.sequences[0]
    assert got.stop_reason == "stop" and text in tok.decode(got.tokens) and len(got.tokens) <= 7
    assert text not in tok.decode(got.tokens[:-1])          # cut right after the stop completed
    lp = sampler.sample(prompt, 1, types.SamplingParams(max_tokens=2), include_prompt_logprobs=True).result()
    assert lp.prompt_logprobs[0] is None and len(lp.prompt_logprobs) == 4

    # the RL losses through the SDK: sampler logprobs and advantages in, summed token losses out
    n = len(ids) - 1
    rl = types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]),
                     loss_fn_inputs={"target_tokens": np.asarray(ids[1:]),
                                     "logprobs": np.asarray([0.0] * 3 + [-2.0] * (n - 3), np.float32),
                                     "advantages": np.asarray([0.0] * 3 + [0.5] * (n - 3), np.float32)})
    for loss_fn, config in (("importance_sampling", None), ("ppo", {"clip_low_threshold": 0.9}),
                            ("cispo", None), ("dro", {"beta": 0.1})):
        out = tc.forward([rl], loss_fn, loss_fn_config=config).result()
        elementwise = out.loss_fn_outputs[0]["elementwise_loss"].tolist()
        assert out.metrics["loss:sum"] == pytest.approx(sum(elementwise), rel=1e-5)
        assert elementwise[:3] == [0.0, 0.0, 0.0]          # no advantage, no sampler logprob: no loss
    saved = tc.save_state("ck").result().path
    assert saved.endswith("/weights/ck")
    before = tc.forward([_datum(ids)], "cross_entropy").result().metrics["loss:sum"]
    tc.forward_backward([_datum(ids)], "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    assert tc.forward([_datum(ids)], "cross_entropy").result().metrics["loss:sum"] != before
    tc.load_state_with_optimizer(saved).result()
    assert tc.forward([_datum(ids)], "cross_entropy").result().metrics["loss:sum"] == before   # the same bits
    # The SDK's non-deprecated resume: a new training client from the state (create-via-load), with
    # the saved LoRA rank and AdamW moments; a step on it and on the reloaded client agree bitwise.
    resumed = sc.create_training_client_from_state_with_optimizer(saved).result()
    assert resumed.get_info().lora_rank == 4 and resumed.get_info().model_id != info.model_id
    after = []
    for client in (tc, resumed):
        client.forward_backward([_datum(ids)], "cross_entropy").result()
        client.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        after.append(client.forward([_datum(ids)], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist())
    assert after[0] == after[1]
    _wait_for_step(server.run / "models" / "model_1", 0)    # the resumed model's run replays from the state
    replay = _debug("replay", str(server.run / "models" / "model_1"), "--step", "0", "--json")
    assert replay.returncode == 0 and json.loads(replay.stdout)["verdict"] == "bitwise-equal", replay.stdout[-2000:]
    tc.load_state_with_optimizer(saved).result()

    with pytest.raises(tinker.RequestFailedError, match="unknown loss_fn 'nope'"):
        tc.forward_backward([_datum(ids)], "nope").result()
    bad = types.Datum(model_input=types.ModelInput.from_ints(ids[:4]),
                      loss_fn_inputs={"target_tokens": np.asarray(ids[:4]), "weights": np.ones(4, np.float32)})
    with pytest.raises(tinker.RequestFailedError, match="target_tokens must be model_input shifted by one"):
        tc.forward_backward([bad], "cross_entropy").result()
    # the refusal consumed its seq_id: the next request is served at once (it used to wait 10 s)
    t0 = time.perf_counter()
    assert tc.forward([_datum(ids)], "cross_entropy").result().metrics["loss:sum"] > 0
    assert time.perf_counter() - t0 < 5.0
    with pytest.raises(tinker.RequestFailedError, match="no forward_backward since the last optim_step"):
        tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    assert tc.forward([_datum(ids)], "cross_entropy").result().metrics["loss:sum"] > 0   # still serving

    # Prompts the engine cannot take are the user's mistake, named, and the server goes on sampling.
    with pytest.raises(tinker.RequestFailedError, match=r"prompt has 1100 tokens.*--context-length"):
        sampler.sample(types.ModelInput.from_ints((ids * 200)[:1100]), 1, types.SamplingParams(max_tokens=2)).result()
    with pytest.raises(tinker.RequestFailedError, match=r"prompt token 1 = 5000 is outside"):
        sampler.sample(types.ModelInput.from_ints([ids[0], 5000]), 1, types.SamplingParams(max_tokens=2)).result()
    for bad, field in ((dict(top_p=0.0), "top_p"), (dict(top_k=0), "top_k"), (dict(temperature=-1.0), "temperature"),
                       (dict(stop=[5000]), "stop_token_ids")):
        with pytest.raises(tinker.RequestFailedError, match=f"sampling_params.{field} must") as refused:
            sampler.sample(prompt, 1, types.SamplingParams(max_tokens=2, **bad)).result()
        assert refused.value.category == "user"          # the client's mistake, not a server fault
    near = sampler.sample(types.ModelInput.from_ints((ids * 200)[:1020]), 2,
                          types.SamplingParams(max_tokens=50, stop=[])).result()   # cut at the context's end
    assert [(len(s.tokens), s.stop_reason) for s in near.sequences] == [(4, "length")] * 2

    # A diverging run (a huge learning rate) answers its optim_step with NaN metrics, not a hung future.
    for _ in range(2):
        tc.forward_backward([_datum(ids)], "cross_entropy").result()
        metrics = tc.optim_step(types.AdamParams(learning_rate=1e30)).result(timeout=60).metrics
    assert np.isnan(metrics["grad_norm:mean"]) and np.isnan(metrics["loss:sum"])
    assert tc.get_info().model_id.endswith(":train:0")


def test_cookbook_supervised_loop_on_its_bundled_conversations(server: Server, model_dir: Path,
                                                               tmp_path: Path) -> None:
    data = Path(tinker_cookbook.__file__).parent / "example_data" / "conversations.jsonl"
    runner = Path(__file__).resolve().parents[1] / "examples" / "tinker" / "supervised.py"
    log_path = tmp_path / "sl"
    cmd = [sys.executable, str(runner), "recipe_name=sl_conversations", f"model_name={model_dir}",
           "renderer_name=role_colon", "dataset_builder=tinker_cookbook.supervised.data:FromConversationFileBuilder",
           f"dataset_builder.file_path={data}", f"dataset_builder.common_config.model_name_for_tokenizer={model_dir}",
           "dataset_builder.common_config.renderer_name=role_colon", "dataset_builder.common_config.max_length=512",
           "dataset_builder.common_config.batch_size=32", f"log_path={log_path}", "eval_every=0", "save_every=0",
           "lora_rank=8", "learning_rate=1e-3"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=tmp_path,
                          env={**os.environ, **ENV, "TINKER_BASE_URL": server.url})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    nll = [json.loads(line)["train_mean_nll"] for line in (log_path / "metrics.jsonl").read_text().splitlines()
           if "train_mean_nll" in line]
    assert len(nll) == 4 and nll[-1] < nll[0]          # 128 conversations, batches of 32
    _wait_for_step(server.run, 3)
    assert TraceReader(server.run).steps == [0, 1, 2, 3]


def test_retried_post_runs_once_and_sessions_are_isolated(server: Server, model_dir: Path) -> None:
    from tinker.proto.request_conv import forward_backward_request_to_proto

    clients = [tinker.ServiceClient(base_url=server.url, api_key="tml-local") for _ in range(2)]
    tcs = [c.create_lora_training_client(base_model=str(model_dir), rank=4).result() for c in clients]
    assert tcs[0].get_info().model_id.split(":")[0] != tcs[1].get_info().model_id.split(":")[0]
    ids = tcs[0].get_tokenizer().encode("one two three four five six")
    # The same forward_backward POSTed twice (a client retry): one future, applied once.
    req = types.ForwardBackwardRequest(forward_backward_input=types.ForwardBackwardInput(
        data=[_datum(ids)], loss_fn="cross_entropy"), model_id=tcs[0].get_info().model_id, seq_id=1)
    body = forward_backward_request_to_proto(req).SerializeToString()
    headers = {"X-API-Key": "tml-local", "Content-Type": "application/x-protobuf"}
    first = httpx.post(f"{server.url}/api/v1/forward_backward", content=body, headers=headers).json()
    again = httpx.post(f"{server.url}/api/v1/forward_backward", content=body, headers=headers).json()
    assert first["request_id"] == again["request_id"]
    done = httpx.post(f"{server.url}/api/v1/retrieve_future", json={"request_id": first["request_id"]},
                      headers={"X-API-Key": "tml-local", "Accept": "application/x-protobuf"}, timeout=60)
    assert done.headers["content-type"] == "application/x-protobuf"
    optim = {"adam_params": {"learning_rate": 1e-3}, "model_id": req.model_id, "seq_id": 2}
    rid = httpx.post(f"{server.url}/api/v1/optim_step", json=optim, headers=headers).json()["request_id"]
    httpx.post(f"{server.url}/api/v1/retrieve_future", json={"request_id": rid}, headers=headers, timeout=60)
    # The second session's model trains on its own and records into its own run directory.
    tcs[1].forward_backward([_datum(ids), _datum(ids)], "cross_entropy").result()
    tcs[1].optim_step(types.AdamParams(learning_rate=1e-3)).result()
    _wait_for_step(server.run, 0)
    _wait_for_step(server.run / "models" / "model_1", 0)
    with h5py.File(server.run / "trace" / "step_000000.h5") as f:
        assert len(f["samples/offsets"]) - 1 == 1           # the retried datum once, not twice
    with h5py.File(server.run / "models" / "model_1" / "trace" / "step_000000.h5") as f:
        assert len(f["samples/offsets"]) - 1 == 2
    bad = types.ForwardBackwardRequest(forward_backward_input=types.ForwardBackwardInput(
        data=[_datum(ids)], loss_fn="cross_entropy"), model_id="nope:train:0", seq_id=1)
    rid = httpx.post(f"{server.url}/api/v1/forward_backward", headers=headers,
                     content=forward_backward_request_to_proto(bad).SerializeToString()).json()["request_id"]
    answer = httpx.post(f"{server.url}/api/v1/retrieve_future", json={"request_id": rid}, headers=headers).json()
    assert answer["category"] == "user" and "unknown model_id 'nope:train:0'" in answer["error"]
    assert httpx.post(f"{server.url}/api/v1/create_session", json={}, headers={"X-API-Key": "sk-x"}).status_code == 401


def _two_steps(url: str, model_dir: Path) -> tuple[bool, list[list[float]]]:
    """Two forward_backward + optim_step rounds with the client's own AdamW settings (betas, eps,
    weight decay, clip); whether the model is LoRA, and the per-token logprobs after each."""
    tc = tinker.ServiceClient(base_url=url, api_key="tml-local").create_lora_training_client(
        base_model=str(model_dir), rank=4).result()
    ids = tc.get_tokenizer().encode("the quick brown fox jumps over the lazy dog")
    adam = types.AdamParams(learning_rate=5e-3, beta1=0.8, beta2=0.9, eps=1e-6, weight_decay=0.1,
                            grad_clip_norm=0.5)
    after = []
    for _ in range(2):
        tc.forward_backward([_datum(ids), _datum(ids[:7])], "cross_entropy").result()
        tc.optim_step(adam).result()
        # two datums: a data-parallel train group gives each rank at least one
        after.append(tc.forward([_datum(ids), _datum(ids[:5])], "cross_entropy").result()
                     .loss_fn_outputs[0]["logprobs"].tolist())
    return tc.get_info().is_lora, after


@pytest.mark.parametrize("name,args", [
    ("megatron", ["--set", "train.backend=megatron"]),
    ("ray", ["--set", "runtime.executor=ray", "--set", "runtime.ray.train_ranks=2",
             "--set", "runtime.ray.placement.train_cpus=0.5", "--set", "runtime.ray.placement.engine_cpus=0.5"]),
])
def test_other_trainers_train_the_same_steps_and_replay(name: str, args: list[str], model_dir: Path,
                                                         tmp_path: Path) -> None:
    """`--set train.backend=megatron`, or a Ray train group of two data-parallel ranks: the SDK's
    steps (with their own AdamW settings) give the weights the in-process torch backend gives
    within fp32 noise, the model trains every weight (Megatron has no LoRA; both compared fully
    fine-tuned), and a step replays bitwise."""
    results = {}
    for run, extra in ((name, [*args, "--full-finetune"]), ("torch", ["--full-finetune"])):
        server = Server(model_dir, tmp_path / run, tmp_path / f"{run}.log", *extra)
        try:
            results[run] = _two_steps(server.url, model_dir)
        finally:
            server.close()
    (lora_o, logprobs_o), (lora_t, logprobs_t) = results[name], results["torch"]
    assert lora_o is False and lora_t is False
    for o, t in zip(logprobs_o, logprobs_t):
        assert np.allclose(o, t, atol=1e-4), np.abs(np.asarray(o) - np.asarray(t)).max()
    assert logprobs_o[1] != logprobs_o[0]                     # the second step moved the weights
    _wait_for_step(tmp_path / name, 1)
    replay = _debug("replay", str(tmp_path / name), "--step", "1", "--json")
    assert replay.returncode == 0 and json.loads(replay.stdout)["verdict"] == "bitwise-equal", replay.stdout[-2000:]


def test_sampled_sequences_bring_their_moe_routing_into_the_trace(tmp_path: Path) -> None:
    """On an MoE model, an RL datum that is a sequence the service sampled (prompt + completion)
    is recorded with the engine's routing and the trainer's, so `mismatch` reports their routing
    agreement; a datum the service never sampled is not given a routing it did not have."""
    tok = Tokenizer.default()
    cfg = preset_config("tiny-moe", vocab_size=tok.vocab_size, eos_token_id=tok.eos_token_id,
                        pad_token_id=tok.pad_token_id)
    moe = save_hf(build_model(cfg, seed=0), tmp_path / "moe", tokenizer=tok)
    server = Server(moe, tmp_path / "run", tmp_path / "server.log", "--full-finetune")
    try:
        tc = tinker.ServiceClient(base_url=server.url, api_key="tml-local").create_lora_training_client(
            base_model=str(moe), rank=4).result()
        sampler = tc.save_weights_and_get_sampling_client().result()
        prompt = tok.encode("what is two plus three")
        out = sampler.sample(types.ModelInput.from_ints(prompt), 2,
                             types.SamplingParams(max_tokens=8, seed=1, stop=[])).result()

        def rl_datum(seq) -> types.Datum:
            full = prompt + list(seq.tokens)
            lp = [0.0] * (len(prompt) - 1) + list(seq.logprobs)
            return types.Datum(model_input=types.ModelInput.from_ints(full[:-1]),
                               loss_fn_inputs={"target_tokens": np.asarray(full[1:]),
                                               "logprobs": np.asarray(lp, np.float32),
                                               "advantages": np.asarray([0.0] * (len(prompt) - 1) + [1.0] * len(seq.tokens),
                                                                        np.float32)})
        datums = [rl_datum(s) for s in out.sequences]
        tc.forward_backward(datums, "importance_sampling").result()
        tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()
        tc.forward_backward([_datum(prompt + [5, 6, 7])], "cross_entropy").result()   # never sampled
        tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()
        _wait_for_step(server.run, 1)
    finally:
        server.close()
    with h5py.File(server.run / "trace" / "step_000000.h5") as f:
        valid, rollout, train = f["routing/rollout_valid"][:], f["routing/rollout"][:], f["routing/train"][:]
        lengths = np.diff(f["samples/offsets"][:])
    assert list(lengths) == [len(prompt) + len(s.tokens) for s in out.sequences]
    assert valid.sum() == len(valid) - 2                         # every token but each sequence's last
    assert rollout.shape == train.shape and rollout.shape[1:] == (cfg.num_hidden_layers, cfg.num_experts_per_tok)
    same = (np.sort(rollout[valid == 1], -1) == np.sort(train[valid == 1], -1)).all(-1).mean()
    assert same > 0.9                                            # the same weights: the trainer's fp32 path agrees
    with h5py.File(server.run / "trace" / "step_000001.h5") as f:
        assert "routing" not in f
    report = _debug("mismatch", str(server.run), "--step", "0", "--json")
    assert report.returncode == 0, report.stderr[-2000:]
    assert json.loads(report.stdout)["routing"]["agreement"] == pytest.approx(same, abs=1e-6)
    replay = _debug("replay", str(server.run), "--step", "0", "--json")
    assert replay.returncode == 0 and json.loads(replay.stdout)["verdict"] == "bitwise-equal", replay.stdout[-2000:]


def _moe_dir(tmp_path: Path) -> Path:
    tok = Tokenizer.default()
    cfg = preset_config("tiny-moe", vocab_size=tok.vocab_size, eos_token_id=tok.eos_token_id,
                        pad_token_id=tok.pad_token_id)
    return save_hf(build_model(cfg, seed=0), tmp_path / "moe", tokenizer=tok)


def test_sampling_on_the_runs_server_engine_equals_the_embedded_engine(tmp_path: Path) -> None:
    """`--set rollout.engine=sglang` (here `rollout.sglang.server=axrl`: servers launched by the
    service on the served directory): after a training step, sampler weights reach the server,
    whose sampled tokens, logprobs and prompt logprobs equal the in-process engine's, and the
    routing it returns is recorded for the sampled datums."""
    moe = _moe_dir(tmp_path)
    prompt = Tokenizer.default().encode("what is two plus three")
    results = {}
    for name, extra in (("embedded", []), ("server", ["--set", "rollout.engine=sglang",
                                                      "--set", "rollout.sglang.server=axrl"])):
        server = Server(moe, tmp_path / name, tmp_path / f"{name}.log", "--full-finetune", *extra)
        try:
            tc = tinker.ServiceClient(base_url=server.url, api_key="tml-local").create_lora_training_client(
                base_model=str(moe), rank=4).result()
            tc.forward_backward([_datum(prompt + [7, 8, 9])], "cross_entropy").result()
            tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
            sampler = tc.save_weights_and_get_sampling_client().result()
            out = sampler.sample(types.ModelInput.from_ints(prompt), 2, types.SamplingParams(max_tokens=8, seed=3, stop=[]),
                                 include_prompt_logprobs=True).result()
            seqs = out.sequences
            datums = [types.Datum(model_input=types.ModelInput.from_ints((prompt + s.tokens)[:-1]),
                                  loss_fn_inputs={"target_tokens": np.asarray((prompt + s.tokens)[1:]),
                                                  "logprobs": np.asarray([0.0] * (len(prompt) - 1) + s.logprobs, np.float32),
                                                  "advantages": np.asarray([0.0] * (len(prompt) - 1) + [1.0] * len(s.tokens),
                                                                           np.float32)}) for s in seqs]
            tc.forward_backward(datums, "importance_sampling").result()
            tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()
            _wait_for_step(server.run, 1)
            results[name] = ([s.tokens for s in seqs], [s.logprobs for s in seqs], out.prompt_logprobs[1:])
        finally:
            server.close()
        with h5py.File(server.run / "trace" / "step_000001.h5") as f:
            assert f["routing/rollout_valid"][:].sum() == sum(len(prompt) + len(s.tokens) - 1 for s in seqs)
    (tokens_e, lp_e, plp_e), (tokens_s, lp_s, plp_s) = results["embedded"], results["server"]
    assert tokens_s == tokens_e
    assert np.allclose(np.concatenate(lp_s), np.concatenate(lp_e), atol=1e-5)
    assert np.allclose(plp_s, plp_e, atol=1e-5)
