"""The SGLang client (`SGLangEngine`) against real `axrl serve` subprocesses (2 servers, launched
by `SGLangLauncher`): results equal the in-process engine, sticky routing, weight sync by disk
and by a gloo process group (served weights bitwise equal to the trainer's), abort, a killed
server restarted with its in-flight requests re-sent, and clear errors."""

from __future__ import annotations

import asyncio
import time

import httpx
import numpy as np
import pytest
import torch

from axrl.inference import GenerateRequest, InferenceEngine, SamplingParams
from axrl.inference.sglang import SGLangEngine, SGLangLauncher
from axrl.inference.sglang.client import ServerUnavailable
from axrl.inference.sglang.launcher import ServerStartError, free_port
from axrl.model import hf_state_dict, load_hf
from serve_util import SERVE, copies, launch, make_model_dir, perturbed, reference

torch.set_num_threads(1)

PROMPTS = [[5, 17, 300, 42, 9], [100, 200, 300, 400, 500, 600, 700, 800, 900, 1000, 11], [7], [64, 65, 66]]
CHECKED = ["model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
           "model.layers.3.mlp.experts.7.down_proj.weight", "model.layers.2.mlp.gate.weight", "lm_head.weight"]


def _req(ids, max_new=12, temperature=0.0, seed=None, routed=False, start=0, key=None, rid=None):
    req = GenerateRequest(input_ids=list(ids), return_logprob=True, return_routed_experts=routed,
                          routed_experts_start_len=start, sticky_key=key,
                          sampling_params=SamplingParams(max_new_tokens=max_new, temperature=temperature,
                                                         ignore_eos=True, seed=seed))
    if rid:
        req.rid = rid
    return req


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("client")
    model_dir = make_model_dir(root / "model")
    launcher = launch(model_dir, num_servers=2, log_dir=root / "logs")
    engine = SGLangEngine(launcher.urls, launcher=launcher, own_launcher=False, retries=4, backoff_s=0.05,
                          export_dir=root / "export")
    ref = reference(model_dir)
    yield {"dir": model_dir, "launcher": launcher, "engine": engine, "ref": ref, "root": root,
           "weights": hf_state_dict(load_hf(model_dir))}
    engine.shutdown()
    launcher.stop()
    ref.shutdown()


def _served(url: str, name: str) -> torch.Tensor:
    values = httpx.post(url + "/get_weights_by_name", json={"name": name, "truncate_size": 10 ** 9}, timeout=30).json()
    return torch.tensor(values, dtype=torch.float32)


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _restore(setup) -> None:
    setup["engine"].update_weights(setup["weights"], version=0)
    setup["ref"].update_weights(setup["weights"], version=0)


def test_client_implements_the_protocol_and_matches_the_embedded_engine(setup):
    engine, ref = setup["engine"], setup["ref"]
    assert isinstance(engine, InferenceEngine)
    assert engine.routing_shape == (4, 2)
    reqs = [_req(p, routed=True, key="k") for p in PROMPTS]
    got = engine.generate_batch(copies(reqs))
    exp = ref.generate_batch(copies(reqs))
    worst = 0.0
    for g, e in zip(got, exp):
        assert g.output_ids == e.output_ids
        worst = max(worst, max(abs(a - b) for a, b in zip(g.output_logprobs, e.output_logprobs)))
        assert g.routed_experts.dtype == np.int32 and np.array_equal(g.routed_experts, e.routed_experts)
        assert g.finish_reason == {"type": "length", "length": 12}
        assert g.weight_version == 0 and g.output_weight_versions == [0] * 12
        assert g.prompt_tokens == len(g.routed_experts) - 11
    print(f"max |logprob(client → axrl serve) - logprob(in-process)| = {worst:.3g}")
    assert worst <= 1e-5
    # The async API, from a fresh event loop, with a seeded sample and a multi-turn start length.
    async def two_turns():
        first = await engine.generate(_req(PROMPTS[1], 6, 0.9, seed=7, routed=True, key="episode"))
        stream = PROMPTS[1] + first.output_ids + [40, 41]
        held = len(PROMPTS[1]) + 6 - 1
        second = await engine.generate(_req(stream, 4, 0.9, seed=8, routed=True, start=held, key="episode"))
        return first, second, stream, held
    first, second, stream, held = asyncio.run(two_turns())
    (e1,) = ref.generate_batch([_req(PROMPTS[1], 6, 0.9, seed=7, routed=True)])
    (e2,) = ref.generate_batch([_req(stream, 4, 0.9, seed=8, routed=True)])
    assert first.output_ids == e1.output_ids and second.output_ids == e2.output_ids
    assert np.array_equal(second.routed_experts, e2.routed_experts[held:])
    assert first.meta["server"] == second.meta["server"]


def test_sticky_routing_keeps_an_episode_on_one_server(setup):
    engine = setup["engine"]
    keys = [f"{g}:{s}" for g in range(4) for s in range(3)]
    seen: dict[str, set[str]] = {}
    for turn in range(3):
        results = engine.generate_batch([_req(PROMPTS[0], 2, key=k) for k in keys])
        for k, r in zip(keys, results):
            seen.setdefault(k, set()).add(r.meta["server"])
    assert all(len(servers) == 1 for servers in seen.values())
    assert {s for servers in seen.values() for s in servers} == set(setup["launcher"].urls)  # both used
    unkeyed = engine.generate_batch([_req(PROMPTS[0], 1) for _ in range(4)])
    assert len({r.meta["server"] for r in unkeyed}) == 2  # round robin


@pytest.mark.parametrize("mode", ["disk", "distributed"])
def test_weight_sync_changes_outputs_bumps_version_and_is_bitwise(setup, mode):
    launcher, ref = setup["launcher"], setup["ref"]
    engine = setup["engine"] if mode == "disk" else SGLangEngine(
        launcher.urls, weight_sync="distributed", model_dir=setup["dir"], bucket_bytes=1 << 20)
    try:
        before = engine.generate_batch([_req(PROMPTS[1], key="a")])[0]
        new = perturbed(setup["weights"], seed=11 if mode == "disk" else 12)
        t0 = time.perf_counter()
        assert engine.update_weights(new) == engine.weight_version == 1
        print(f"{mode} weight sync of {sum(t.numel() for t in new.values()) / 1e6:.2f}M params to 2 servers: "
              f"{time.perf_counter() - t0:.3f} s")
        for url in launcher.urls:
            for name in CHECKED:
                assert torch.equal(_served(url, name), new[name].reshape(-1)), (url, name)
            assert httpx.get(url + "/get_weight_version").json()["weight_version"] == "1"
        after = engine.generate_batch([_req(PROMPTS[1], key="a")])[0]
        assert after.weight_version == 1 and after.output_weight_versions == [1] * 12
        assert after.output_logprobs != before.output_logprobs
        ref.update_weights(new, version=1)
        (exp,) = ref.generate_batch([_req(PROMPTS[1])])
        assert after.output_ids == exp.output_ids and after.output_logprobs == exp.output_logprobs
        if mode == "distributed":  # a second update reuses the group; explicit version
            assert engine.update_weights(setup["weights"], version=5) == 5
            assert torch.equal(_served(launcher.urls[1], CHECKED[1]), setup["weights"][CHECKED[1]].reshape(-1))
    finally:
        if engine is not setup["engine"]:
            engine.shutdown()
        _restore(setup)


def test_distributed_update_rejected_by_the_server_fails_clearly_then_recovers(setup):
    engine = SGLangEngine(setup["launcher"].urls, weight_sync="distributed", model_dir=setup["dir"])
    try:
        bad = dict(setup["weights"])
        bad["model.norm.weight"] = torch.ones(3)
        with pytest.raises((ValueError, RuntimeError), match="model.norm.weight"):
            engine.update_weights(bad)
        assert engine.weight_version == 0
        assert engine.update_weights(setup["weights"], version=2) == 2  # a fresh group is formed
        assert engine.generate_batch([_req(PROMPTS[0], 2)])[0].weight_version == 2
    finally:
        engine.shutdown()
        _restore(setup)


def test_abort_by_rid(setup):
    engine = setup["engine"]
    future = engine.submit(_req(PROMPTS[0], 1000, rid="abort-me", key="x"))
    url = setup["launcher"].urls[engine._route(_req([1], key="x"))]
    deadline = time.monotonic() + 30
    while httpx.get(url + "/get_server_info").json()["running"] < 1:
        assert time.monotonic() < deadline, "the request never started"
        time.sleep(0.01)
    assert engine.abort("abort-me") is True
    res = future.result(30)
    assert res.finish_type == "abort" and 0 < len(res.output_ids) < 1000
    assert len(res.output_logprobs) == len(res.output_ids)
    assert engine.abort("abort-me") is False and engine.abort("never-sent") is False


def test_killed_server_is_restarted_resynced_and_requests_complete(setup):
    engine, launcher, ref = setup["engine"], setup["launcher"], setup["ref"]
    new = perturbed(setup["weights"], seed=21)
    engine.update_weights(new, version=3)  # the restarted server must get these back, not model_path's
    ref.update_weights(new, version=3)
    # Keys that land on server 0, 600 greedy tokens each: still running when the server dies.
    keys = [k for k in (f"r{i}" for i in range(64)) if engine._route(_req([1], key=k)) == 0][:4]
    reqs = [_req(PROMPTS[i % 4], 600, key=k) for i, k in enumerate(keys)]
    pid = launcher.pid(0)
    futures = engine.submit_many(copies(reqs))
    deadline = time.monotonic() + 30
    while httpx.get(launcher.urls[0] + "/get_server_info").json()["running"] < len(reqs):
        assert time.monotonic() < deadline, "the requests never started"
        time.sleep(0.01)
    launcher.kill(0)
    assert not any(f.done() for f in futures)
    t0 = time.perf_counter()
    results = [f.result(120) for f in futures]
    print(f"server killed with {len(reqs)} requests in flight; restarted and all completed in "
          f"{time.perf_counter() - t0:.1f} s")
    assert launcher.restarts(0) == 1 and launcher.pid(0) != pid
    expected = ref.generate_batch(copies(reqs))
    for r, e in zip(results, expected):
        assert r.meta["attempts"] >= 2 and r.finish_reason == {"type": "length", "length": 600}
        assert r.output_ids == e.output_ids and r.weight_version == 3
    assert engine.health()["ok"] and [s["restarts"] for s in engine.health()["servers"]] == [1, 0]
    _restore(setup)


def test_the_callers_request_is_never_modified(setup):
    """`sampling_params` as an SGLang-style dict: sent parsed, the caller's request left as it was."""
    engine = setup["engine"]
    sp = {"max_new_tokens": 5, "temperature": 0.0, "ignore_eos": True}
    reqs = [GenerateRequest(list(p), dict(sp), return_logprob=True, rid=f"dict-{i}") for i, p in enumerate(PROMPTS)]
    before = [GenerateRequest(list(r.input_ids), dict(sp), return_logprob=True, rid=r.rid) for r in reqs]
    got = [f.result(timeout=120) for f in engine.submit_many(reqs)]
    assert reqs == before and all(type(r.sampling_params) is dict for r in reqs)
    typed = engine.generate_batch([_req(p, max_new=5) for p in PROMPTS])
    assert [g.output_ids for g in got] == [t.output_ids for t in typed]
    with pytest.raises(ValueError, match="sampling_params.top_k"):  # checked here, before anything is sent
        engine.submit(GenerateRequest([1, 2], {"top_k": 0}))


def test_errors_are_clear(setup, tmp_path):
    with pytest.raises(ValueError, match=r"urls\[0\]"):
        SGLangEngine(["localhost:30000"])
    with pytest.raises(ValueError, match="urls"):
        SGLangEngine([])
    dead = f"http://127.0.0.1:{free_port()}"
    t0 = time.perf_counter()
    with pytest.raises(ServerUnavailable, match=r"failed after 3 attempts") as info:
        SGLangEngine([dead], retries=2, backoff_s=0.05)
    assert dead in str(info.value) and time.perf_counter() - t0 >= 0.15  # back-off 0.05 + 0.1
    engine = setup["engine"]
    with pytest.raises(ValueError, match="sampling_params.top_p"):
        engine.generate_batch([GenerateRequest(input_ids=[1, 2], sampling_params=SamplingParams(top_p=2.0))])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.submit(_req([1, 10 ** 6]))
    with pytest.raises(FileNotFoundError, match="config.json"):
        engine.update_weights(tmp_path)
    with pytest.raises(ServerStartError, match="config.json"):
        SGLangLauncher(tmp_path, command=SERVE, base_port=free_port(), startup_timeout_s=60).start()


def test_timeout_aborts_on_the_server_and_fails_after_retries(setup):
    launcher = setup["launcher"]
    engine = SGLangEngine(launcher.urls, timeout_s=0.3, retries=1, backoff_s=0.05)
    try:
        with pytest.raises(ServerUnavailable, match="ReadTimeout"):
            engine.generate_batch([_req(PROMPTS[0], 1000, key="slow")])
    finally:
        engine.shutdown()
    # Each timed-out attempt was aborted on its server, so no slot stays busy.
    deadline = time.monotonic() + 10
    while any(httpx.get(u + "/get_server_info").json()["running"] for u in launcher.urls):
        assert time.monotonic() < deadline, "timed-out requests still running on the servers"
        time.sleep(0.05)


def test_without_a_launcher_requests_fail_over_to_another_server(setup):
    launcher = setup["launcher"]
    engine = SGLangEngine(launcher.urls, retries=2, backoff_s=0.05)  # no launcher: no restarts
    try:
        keys = [k for k in (f"f{i}" for i in range(64)) if engine._route(_req([1], key=k)) == 1][:3]
        launcher.kill(1)
        results = engine.generate_batch([_req(PROMPTS[0], 4, key=k) for k in keys])
        assert {r.meta["server"] for r in results} == {launcher.urls[0]}
        assert all(r.meta["attempts"] == 2 for r in results)
        # The episodes stay on the server they moved to.
        again = engine.generate_batch([_req(PROMPTS[0], 2, key=k) for k in keys])
        assert {r.meta["server"] for r in again} == {launcher.urls[0]} and all(r.meta["attempts"] == 1 for r in again)
    finally:
        engine.shutdown()
        launcher.ensure_alive(1)


def test_watchdog_restart_is_resynced_before_the_next_request(setup, tmp_path):
    # A server that crashes between rounds: nothing fails, the watchdog restarts it with its
    # start-up weights, and the client must re-apply the synced weights before using it again.
    launcher = SGLangLauncher(setup["dir"], command=SERVE, base_port=free_port(), env={"OMP_NUM_THREADS": "1"},
                              server_args=["--max-running-requests", "4"], watchdog_s=0.2, startup_timeout_s=120)
    launcher.start()
    engine = SGLangEngine(launcher.urls, launcher=launcher, export_dir=tmp_path / "export")
    try:
        new = perturbed(setup["weights"], seed=31)
        engine.update_weights(new, version=4)
        synced = engine.generate_batch([_req(PROMPTS[1])])[0]
        launcher.kill(0)
        deadline = time.monotonic() + 60
        while not (launcher.restarts(0) == 1 and _healthy(launcher.urls[0])):
            assert time.monotonic() < deadline, "the watchdog did not restart the server"
            time.sleep(0.1)
        again = engine.generate_batch([_req(PROMPTS[1])])[0]
        assert again.meta["attempts"] == 1  # re-synced before sending, not after a failure
        assert again.weight_version == 4 and again.output_ids == synced.output_ids
        assert again.output_logprobs == synced.output_logprobs
    finally:
        engine.shutdown()


def test_run_connects_to_given_urls_and_pushes_its_weights(setup, tmp_path):
    from axrl.config import load_config
    from axrl.inference.sglang.factory import build_sglang_engine
    from axrl.assembly.build import make_train_backend
    from axrl.assembly.settings import rollout_settings
    from axrl.tokenizer import Tokenizer

    launcher = setup["launcher"]
    cfg = load_config(None, ["rollout.engine=sglang", "model.init_seed=1", f"rollout.sglang.export_dir={tmp_path}",
                             "rollout.sglang.urls=[" + ",".join(launcher.urls) + "]"])
    tok = Tokenizer.default()
    backend = make_train_backend(cfg, tok)
    engine = build_sglang_engine(cfg.rollout.sglang, rollout_settings(cfg).served, backend, tok)
    try:
        assert engine.launcher is None and engine.weight_version == 0
        for url in launcher.urls:  # the servers now hold the run's (seed 1) weights, not their own
            assert torch.equal(_served(url, CHECKED[1]), dict(backend.named_weights())[CHECKED[1]].reshape(-1))
    finally:
        engine.shutdown()
    assert all(launcher.alive(i) for i in range(2))  # servers it did not launch keep running
    _restore(setup)


def test_abort_of_a_request_still_queued_in_the_client(setup):
    # max_concurrency=1: the second request waits in the client; aborting it must not send it.
    engine = SGLangEngine(setup["launcher"].urls[:1], max_concurrency=1)
    try:
        first = engine.submit(_req(PROMPTS[0], 1000, rid="holds-the-slot"))
        queued = engine.submit(_req(PROMPTS[1], 1000, rid="queued"))
        assert engine.abort("queued") is True
        assert engine.abort("holds-the-slot") is True
        res = queued.result(30)
        assert res.finish_reason["type"] == "abort" and res.output_ids == [] and "before it was sent" in \
            res.finish_reason["message"]
        assert first.result(30).finish_type == "abort"
    finally:
        engine.shutdown()


# A server that, like SGLang's, does not notice that its launcher died.
_DEAF_SERVER = """
import http.server, sys
port = int(sys.argv[sys.argv.index('--port') + 1])
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b'ok')
    def log_message(self, *args):
        pass
http.server.HTTPServer(('127.0.0.1', port), Health).serve_forever()
"""


def test_a_killed_launchers_servers_are_stopped_by_the_next_launcher(tmp_path):
    """A launcher SIGKILLed (a dead Ray rollout actor) leaves its servers running in their own
    sessions; the next launcher stops them before it starts, so it gets the same ports back."""
    import os
    import signal
    import subprocess
    import sys

    from axrl.inference.sglang.launcher import port_is_free
    from axrl.core.processes import process_stat

    server = tmp_path / "deaf_server.py"
    server.write_text(_DEAF_SERVER)
    port = free_port()
    launch = (f"from axrl.inference.sglang.launcher import SGLangLauncher\n"
              f"l = SGLangLauncher({str(tmp_path)!r}, base_port={port}, command=[{sys.executable!r}, {str(server)!r}])\n"
              f"l.start(); print(l.pid(0), flush=True)\nimport time; time.sleep(600)\n")
    first = subprocess.Popen([sys.executable, "-c", launch], stdout=subprocess.PIPE, text=True)
    try:
        orphan = int(first.stdout.readline())
    finally:
        first.kill()
        first.wait()
    assert process_stat(orphan) is not None and not port_is_free("127.0.0.1", port)  # outlived its launcher
    again = SGLangLauncher(tmp_path, base_port=port, command=[sys.executable, str(server)], startup_timeout_s=30)
    try:
        assert again.start() == [f"http://127.0.0.1:{port}"]  # the same port, not the next free one
        assert process_stat(orphan) is None
        assert again.pid(0) != orphan
    finally:
        again.stop()
