"""`axrl serve` over real HTTP: a server subprocess on a free localhost port, checked against the
in-process EmbeddedEngine on the same weights (tokens, logprobs, routed experts), plus SSE
streaming, the OpenAI endpoints, abort, weight updates from disk and errors that name the field."""

from __future__ import annotations

import base64
import json
import threading
import time

import httpx
import numpy as np
import pytest
import torch

from axrl.inference import GenerateRequest, SamplingParams
from axrl.model import hf_state_dict, load_hf, save_hf
from axrl.tokenizer import Tokenizer
from serve_util import SERVE as SERVE_CMD
from serve_util import launch, make_model_dir, perturbed, reference

torch.set_num_threads(1)

PROMPTS = [[5, 17, 300, 42, 9], [100, 200, 300, 400, 500, 600, 700, 800, 900, 1000, 11], [7], [64, 65, 66]]
LOGPROB_TOL = 1e-5  # measured: 0 (the server runs the same engine code on the same weights)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    model_dir = make_model_dir(tmp_path_factory.mktemp("serve") / "model")
    launcher = launch(model_dir, num_servers=1)
    ref = reference(model_dir)
    client = httpx.Client(base_url=launcher.urls[0], timeout=60)
    yield {"dir": model_dir, "launcher": launcher, "ref": ref, "http": client}
    client.close()
    launcher.stop()
    ref.shutdown()


def _body(ids, max_new=12, temperature=0.0, **extra):
    return {"input_ids": ids, "sampling_params": {"max_new_tokens": max_new, "temperature": temperature,
                                                  "ignore_eos": True}, "return_logprob": True, **extra}


def _req(ids, max_new=12, temperature=0.0, seed=None, routed=False, start=0):
    return GenerateRequest(input_ids=list(ids), return_logprob=True, return_routed_experts=routed,
                           routed_experts_start_len=start,
                           sampling_params=SamplingParams(max_new_tokens=max_new, temperature=temperature,
                                                          ignore_eos=True, seed=seed))


def _routing(meta, rows):
    flat = np.frombuffer(base64.b64decode(meta["routed_experts"]), dtype="<i4")
    return flat.reshape(rows, 4, 2)


def _logprobs(out):
    return [t[0] for t in out["meta_info"]["output_token_logprobs"]]


def test_generate_matches_embedded_engine(setup):
    http, ref = setup["http"], setup["ref"]
    # One batched call is admitted at once, like submit_many in-process: the same schedule, same bits.
    batch = http.post("/generate", json={"input_ids": PROMPTS, "return_logprob": True,
                                         "sampling_params": {"max_new_tokens": 12, "temperature": 0.0,
                                                             "ignore_eos": True}})
    assert batch.status_code == 200, batch.text
    expected = ref.generate_batch([_req(p) for p in PROMPTS])
    worst = 0.0
    for out, exp in zip(batch.json(), expected):
        assert out["output_ids"] == exp.output_ids
        assert [t[1] for t in out["meta_info"]["output_token_logprobs"]] == exp.output_ids
        worst = max(worst, max(abs(a - b) for a, b in zip(_logprobs(out), exp.output_logprobs)))
        assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 12}
        assert out["meta_info"]["prompt_tokens"] == exp.prompt_tokens
        assert out["meta_info"]["weight_version"] == "0"
    # Single requests one after another.
    for p in PROMPTS[:2]:
        out = http.post("/generate", json=_body(p)).json()
        (exp,) = ref.generate_batch([_req(p)])
        assert out["output_ids"] == exp.output_ids
        worst = max(worst, max(abs(a - b) for a, b in zip(_logprobs(out), exp.output_logprobs)))
    print(f"max |logprob(axrl serve) - logprob(in-process engine)| = {worst:.3g}")
    assert worst <= LOGPROB_TOL


def test_seeded_sampling_matches_embedded_engine(setup):
    http, ref = setup["http"], setup["ref"]
    body = _body(PROMPTS[1], max_new=16, temperature=0.8)
    body["sampling_params"]["sampling_seed"] = 1234
    out = http.post("/generate", json=body).json()
    (exp,) = ref.generate_batch([_req(PROMPTS[1], 16, 0.8, seed=1234)])
    assert out["output_ids"] == exp.output_ids
    assert np.allclose(_logprobs(out), exp.output_logprobs, atol=LOGPROB_TOL, rtol=0)


def test_routed_experts_and_multi_turn_start_len(setup):
    http, ref = setup["http"], setup["ref"]
    prompt = PROMPTS[1]
    first = http.post("/generate", json=_body(prompt, 6, return_routed_experts=True)).json()
    rows1 = len(prompt) + 6 - 1
    got1 = _routing(first["meta_info"], rows1)
    (exp1,) = ref.generate_batch([_req(prompt, 6, routed=True)])
    assert got1.shape == (rows1, 4, 2) and np.array_equal(got1, exp1.routed_experts)
    assert got1.min() >= 0 and got1.max() < 8
    # Turn 2: the whole stream so far + an observation; ask only for the rows not held yet.
    turn2 = prompt + first["output_ids"] + [33, 34, 35]
    second = http.post("/generate", json=_body(turn2, 5, return_routed_experts=True,
                                               routed_experts_start_len=rows1)).json()
    rows2 = len(turn2) + 5 - 1 - rows1
    got2 = _routing(second["meta_info"], rows2)
    (full,) = ref.generate_batch([_req(turn2, 5, routed=True)])
    assert np.array_equal(got2, full.routed_experts[rows1:])
    # The rows the first turn returned are the same tokens' routing in the second turn's forward.
    assert np.array_equal(full.routed_experts[:rows1], got1)


def test_stream_sends_cumulative_chunks_then_done(setup):
    http = setup["http"]
    final = http.post("/generate", json=_body(PROMPTS[0], 20)).json()
    chunks, done = [], False
    with http.stream("POST", "/generate", json=_body(PROMPTS[0], 20, stream=True)) as resp:
        assert resp.headers["content-type"].startswith("text/event-stream")
        for line in resp.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                continue
            chunks.append(json.loads(line[6:]))
    assert done and len(chunks) >= 2
    for a, b in zip(chunks, chunks[1:]):  # cumulative: each chunk extends the previous one
        assert b["output_ids"][:len(a["output_ids"])] == a["output_ids"]
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    assert chunks[-1]["output_ids"] == final["output_ids"]
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 20}
    assert _logprobs(chunks[-1]) == _logprobs(final)


def test_openai_endpoints(setup):
    http = setup["http"]
    tok = Tokenizer.from_dir(setup["dir"])
    native = http.post("/generate", json=_body(PROMPTS[1], 8)).json()
    comp = http.post("/v1/completions", json={"model": "model", "prompt": PROMPTS[1], "max_tokens": 8, "temperature": 0,
                                              "ignore_eos": True, "logprobs": 1, "return_token_ids": True}).json()
    choice = comp["choices"][0]
    assert comp["object"] == "text_completion"
    assert choice["response_token_ids"] == native["output_ids"] and choice["prompt_token_ids"] == PROMPTS[1]
    assert choice["logprobs"]["token_logprobs"] == _logprobs(native)
    assert choice["finish_reason"] == "length"
    usage = dict(comp["usage"])
    assert 0 <= usage.pop("prompt_tokens_details")["cached_tokens"] < len(PROMPTS[1])
    assert usage == {"prompt_tokens": len(PROMPTS[1]), "completion_tokens": 8, "total_tokens": len(PROMPTS[1]) + 8}
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 2 + 2?"}]
    chat = http.post("/v1/chat/completions", json={"model": "model", "messages": messages, "max_tokens": 6,
                                                   "temperature": 0, "logprobs": True, "return_token_ids": True,
                                                   "return_meta_info": True}).json()
    c = chat["choices"][0]
    assert chat["object"] == "chat.completion" and c["message"]["role"] == "assistant"
    assert c["prompt_token_ids"] == tok.apply_chat_template(messages, add_generation_prompt=True)
    assert len(c["logprobs"]["content"]) == len(c["response_token_ids"])
    assert c["meta_info"]["output_token_logprobs"][0][1] == c["response_token_ids"][0]
    # Pre-tokenized chat input, as SGLang accepts: the same reply.
    again = http.post("/v1/chat/completions", json={"input_ids": c["prompt_token_ids"], "max_tokens": 6,
                                                    "temperature": 0, "return_token_ids": True}).json()
    assert again["choices"][0]["response_token_ids"] == c["response_token_ids"]
    assert http.get("/v1/models").json()["data"][0]["max_model_len"] == 1024


def test_abort_request_by_rid(setup):
    http = setup["http"]
    out: dict = {}
    body = _body(PROMPTS[0], 1000, rid="long-one")
    worker = threading.Thread(target=lambda: out.update(http.post("/generate", json=body).json()))
    worker.start()
    deadline = time.monotonic() + 30
    while http.get("/get_server_info").json()["running"] < 1:
        assert time.monotonic() < deadline, "the request never started"
        time.sleep(0.01)
    assert http.post("/abort_request", json={"rid": "long-one"}).status_code == 200
    worker.join(30)
    reason = out["meta_info"]["finish_reason"]
    assert reason["type"] == "abort", reason
    assert 0 < len(out["output_ids"]) < 1000
    assert len(out["meta_info"]["output_token_logprobs"]) == len(out["output_ids"])


@pytest.mark.parametrize("body, field", [
    (_body([1, 2], temperature=-1.0), "sampling_params.temperature"),
    (_body([1, 10 ** 6]), "input_ids"),
    ({**_body([1, 2]), "foo": 1}, "foo"),
    ({"input_ids": [1, 2], "sampling_params": {"stop": ["x"]}}, "sampling_params.stop"),
    ({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": "ten"}}, "sampling_params.max_new_tokens"),
    (_body([1, 2], return_routed_experts=True, routed_experts_start_len=5), "routed_experts_start_len"),
    ({"input_ids": [[1, 2], [3]], "rid": "one"}, "rid"),
    ({"sampling_params": {}}, "input_ids"),
])
def test_bad_requests_are_400_naming_the_field(setup, body, field):
    resp = setup["http"].post("/generate", json=body)
    assert resp.status_code == 400, resp.text
    err = resp.json()
    assert err["object"] == "error" and err["code"] == 400
    assert field in err["message"], err["message"]


def test_control_errors_name_the_field(setup):
    http = setup["http"]
    assert http.post("/generate", content=b"{not json").status_code == 400
    resp = http.post("/update_weights_from_disk", json={})
    assert resp.status_code == 400 and "model_path" in resp.json()["message"]
    resp = http.post("/update_weights_from_disk", json={"model_path": "/nonexistent/dir"})
    assert resp.status_code == 400 and resp.json()["success"] is False and "config.json" in resp.json()["message"]
    resp = http.post("/update_weights_from_distributed", json={"names": ["x"], "dtypes": ["float32"], "shapes": [[1]]})
    assert resp.status_code == 400 and "init_weights_update_group" in resp.json()["message"]
    resp = http.post("/init_weights_update_group", json={"master_address": "127.0.0.1", "master_port": 1,
                                                         "rank_offset": 1, "world_size": 2, "backend": "nccl"})
    assert resp.status_code == 400 and "backend" in resp.json()["message"]


def test_info_and_health(setup):
    http = setup["http"]
    assert http.get("/health").status_code == 200
    assert http.get("/health_generate").status_code == 200
    info = http.get("/get_model_info").json()
    assert info["is_generation"] and info["weight_version"] == http.get("/get_weight_version").json()["weight_version"]
    assert (info["num_hidden_layers"], info["num_experts_per_tok"]) == (4, 2)
    assert http.post("/flush_cache").status_code == 200


def _followed(engine, req):
    """`token_stream.follow` of one request on `engine`: the snapshots, with the time each arrived."""
    import asyncio

    from axrl.inference.token_stream import follow

    async def run():
        t0, seen = time.perf_counter(), []
        async for snap in follow(engine, req.rid, engine.submit(req), poll_s=0.001):
            seen.append((time.perf_counter() - t0, snap))
        return seen
    return asyncio.run(run())


def _check_token_stream(seen, expected):
    """Snapshots grow by prefixes of the final result, the first arrives well before the end."""
    *partials, (t_end, final) = seen
    assert final.output_ids == expected.output_ids and final.output_logprobs == expected.output_logprobs
    assert len(partials) >= 3, f"only {len(partials)} chunks before the result"
    sizes = [len(ids) for _, (ids, _) in partials]
    assert sizes == sorted(set(sizes)) and sizes[-1] <= len(final.output_ids)
    for _, (ids, logprobs) in partials:
        assert ids == final.output_ids[:len(ids)] and logprobs == final.output_logprobs[:len(ids)]
    assert partials[0][0] < 0.5 * t_end, (partials[0][0], t_end)


def test_tokens_stream_from_the_embedded_engine_and_through_the_sglang_client(setup):
    """Token streaming on the engine protocol: the embedded engine reports a request's tokens while
    it generates them, and so does the SGLang client for a `stream=True` request (it streams
    `axrl serve`'s /generate) — every snapshot a prefix of the final result, the first long
    before it."""
    from axrl.inference.sglang.client import SGLangEngine

    ref = setup["ref"]
    expected = ref.generate_batch([_req(PROMPTS[1], 96)])[0]
    req = _req(PROMPTS[1], 96)
    _check_token_stream(_followed(ref, req), expected)
    client = SGLangEngine(setup["launcher"].urls, model_dir=setup["dir"])
    try:
        streamed = _req(PROMPTS[1], 96)
        streamed.stream = True
        _check_token_stream(_followed(client, streamed), expected)
        plain = _followed(client, _req(PROMPTS[1], 96))     # not streamed: one snapshot, the result
        assert len(plain) == 1 and plain[0][1].output_ids == expected.output_ids
        assert client.progress(streamed.rid) is None        # forgotten once finished
    finally:
        client.shutdown()


def test_release_and_resume_memory_occupation(setup):
    """SGLang's memory endpoints, through the SGLang client: the KV cache is freed and allocated
    again, and greedy outputs after a resume are the same as before the release."""
    from axrl.inference.sglang.client import SGLangEngine

    http = setup["http"]
    before = http.post("/generate", json=_body(PROMPTS[0])).json()
    client = SGLangEngine(setup["launcher"].urls, model_dir=setup["dir"])
    try:
        client.release_memory()
        client.resume_memory()
    finally:
        client.shutdown()
    after = http.post("/generate", json=_body(PROMPTS[0])).json()
    assert after["output_ids"] == before["output_ids"] and _logprobs(after) == _logprobs(before)
    assert http.post("/release_memory_occupation").json()["success"]
    resumed = http.post("/generate", json=_body(PROMPTS[0])).json()   # a request resumes it by itself
    assert resumed["output_ids"] == before["output_ids"]


def test_update_weights_from_disk_changes_outputs_and_version(setup, tmp_path):
    http, ref, model_dir = setup["http"], setup["ref"], setup["dir"]
    original = hf_state_dict(load_hf(model_dir))
    new_dir = tmp_path / "v3"
    model = load_hf(model_dir)
    model.load_state_dict({**model.state_dict(), **perturbed(original, 1)})
    save_hf(model, new_dir)
    before = http.post("/generate", json=_body(PROMPTS[1])).json()
    resp = http.post("/update_weights_from_disk", json={"model_path": str(new_dir), "weight_version": "3"})
    assert resp.status_code == 200 and resp.json()["success"], resp.text
    after = http.post("/generate", json=_body(PROMPTS[1])).json()
    assert after["meta_info"]["weight_version"] == "3"
    assert _logprobs(after) != _logprobs(before)
    ref.update_weights(new_dir, version=3)
    (exp,) = ref.generate_batch([_req(PROMPTS[1])])
    assert after["output_ids"] == exp.output_ids and _logprobs(after) == exp.output_logprobs
    name = "model.layers.0.mlp.experts.0.up_proj.weight"
    served = http.post("/get_weights_by_name", json={"name": name, "truncate_size": 10 ** 9}).json()
    assert torch.equal(torch.tensor(served, dtype=torch.float32), hf_state_dict(load_hf(new_dir))[name].reshape(-1))
    # A non-numeric label is kept as the served version; the engine's integer version moves on.
    http.post("/update_weight_version", json={"new_version": "run-a"})
    assert http.get("/get_weight_version").json()["weight_version"] == "run-a"
    # Back to the start weights for the other tests of this module.
    assert http.post("/update_weights_from_disk", json={"model_path": str(model_dir), "weight_version": "0"}).json()["success"]
    ref.update_weights(model_dir, version=0)
    assert http.post("/generate", json=_body(PROMPTS[1])).json()["output_ids"] == before["output_ids"]


# ---------------------------------------------------------------------------- OpenAI: model, n, stop, stream
CHAT = [{"role": "user", "content": "Tell me a story."}]


def _sse_events(resp) -> tuple[list[dict], bool]:
    events, done = [], False
    for line in resp.iter_lines():
        if line == "data: [DONE]":
            done = True
        elif line.startswith("data: "):
            events.append(json.loads(line[6:]))
    return events, done


def test_openai_model_name_is_validated(setup):
    http = setup["http"]
    served = http.get("/v1/models").json()["data"][0]["id"]
    resp = http.post("/v1/chat/completions", json={"model": "gpt-4o", "messages": CHAT, "max_tokens": 2})
    assert resp.status_code == 404 and f"serves {served!r}" in resp.json()["message"]
    assert http.post("/v1/completions", json={"model": served, "prompt": [5, 6], "max_tokens": 2}).status_code == 200


def test_openai_n_choices(setup):
    http = setup["http"]
    body = {"model": "model", "prompt": PROMPTS[1], "max_tokens": 10, "temperature": 1.0, "seed": 7,
            "ignore_eos": True, "return_token_ids": True}
    one = http.post("/v1/completions", json=body).json()["choices"][0]
    many = http.post("/v1/completions", json={**body, "n": 3}).json()
    ids = [c["response_token_ids"] for c in many["choices"]]
    assert [c["index"] for c in many["choices"]] == [0, 1, 2]
    assert ids[0] == one["response_token_ids"]           # choice 0 samples with the request's own seed
    assert len({tuple(i) for i in ids}) == 3              # the others with seeds derived from it
    assert many["usage"]["prompt_tokens"] == len(PROMPTS[1]) and many["usage"]["completion_tokens"] == 30
    chat = http.post("/v1/chat/completions", json={"model": "model", "messages": CHAT, "max_tokens": 4, "n": 2,
                                                   "temperature": 1.0, "seed": 1}).json()
    assert len(chat["choices"]) == 2
    assert http.post("/v1/completions", json={**body, "n": 0}).status_code == 400
    assert http.post("/v1/completions", json={**body, "n": 10 ** 4}).status_code == 400


def test_openai_stop_strings_cut_text_and_tokens(setup):
    http = setup["http"]
    tok = Tokenizer.from_dir(setup["dir"])
    body = {"model": "model", "prompt": PROMPTS[1], "max_tokens": 24, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, "skip_special_tokens": False}
    full = http.post("/v1/completions", json=body).json()["choices"][0]
    text = full["text"]
    stop = next(text[i:i + 2] for i in range(4, len(text) - 2) if text[i:i + 2].strip() and text[i:i + 2] not in text[:i])
    cut = http.post("/v1/completions", json={**body, "stop": [stop, "never-there"]}).json()["choices"][0]
    assert cut["text"] == text[:text.index(stop)]
    assert (cut["finish_reason"], cut["matched_stop"]) == ("stop", stop)
    kept = cut["response_token_ids"]
    assert kept == full["response_token_ids"][:len(kept)]
    assert stop not in tok.decode(kept) and stop in tok.decode(full["response_token_ids"][:len(kept) + 1])
    # the same cut when streamed: the text arrives in pieces, never past the stop
    with http.stream("POST", "/v1/completions", json={**body, "stop": stop, "stream": True}) as resp:
        events, done = _sse_events(resp)
    assert done and events[-1]["choices"][0]["finish_reason"] == "stop"
    assert "".join(e["choices"][0]["text"] for e in events) == cut["text"]
    assert events[-1]["choices"][0]["response_token_ids"] == kept


def test_openai_chat_stream_matches_the_plain_reply(setup):
    http = setup["http"]
    body = {"model": "model", "messages": CHAT, "max_tokens": 160, "temperature": 0, "ignore_eos": True}
    plain = http.post("/v1/chat/completions", json=body).json()
    with http.stream("POST", "/v1/chat/completions",
                     json={**body, "stream": True, "stream_options": {"include_usage": True}}) as resp:
        assert resp.headers["content-type"].startswith("text/event-stream")
        events, done = _sse_events(resp)
    assert done and all(e["object"] == "chat.completion.chunk" for e in events)
    assert events[0]["choices"][0]["delta"] == {"content": "", "role": "assistant"}
    deltas = [e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"]]
    assert len([d for d in deltas if d]) >= 2            # it really streams
    assert "".join(deltas) == plain["choices"][0]["message"]["content"]
    finals = [e["choices"][0]["finish_reason"] for e in events if e["choices"] and e["choices"][0]["finish_reason"]]
    assert finals == ["length"]
    assert events[-1]["choices"] == [] and events[-1]["usage"] == plain["usage"]
    assert http.post("/v1/chat/completions", json={**body, "stream": True, "logprobs": True}).status_code == 400


def test_serve_prints_the_address_and_model_at_start(setup):
    import subprocess

    from axrl.inference.sglang.launcher import free_port

    port = free_port()
    proc = subprocess.Popen([*SERVE_CMD, "--model-path", str(setup["dir"]), "--port", str(port)],
                            stderr=subprocess.PIPE, text=True, env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    try:
        lines = [proc.stderr.readline() for _ in range(2)]
    finally:
        proc.terminate()
        proc.wait(30)
    text = "".join(lines)
    assert f"model 'model' from {setup['dir']}" in text and "qwen3_moe, 4 layers, 8 experts top-2" in text
    assert f"listening on http://127.0.0.1:{port}" in text and "/v1/chat/completions" in text


@pytest.mark.parametrize("window", [None, 7])
def test_prefill_only_generate_scores_prompts_like_the_trainer(setup, monkeypatch, window):
    """The prefill-only /generate (max_new_tokens 0, logprob_start_len 0) that SGLang answers and a
    served distillation teacher is scored through: `SGLangScorer` against `axrl serve` gives the
    trainer's log_softmax(logits / T) of every prompt token, at T = 1 and (through the whole
    distribution, top_logprobs_num) at the rollout temperature; with a small reply budget the whole
    distribution comes in windows of 7 positions (logprob_start_len > 0 on cut streams)."""
    from axrl.inference.scoring import EmbeddedScorer
    from axrl.inference.scoring import sglang as sglang_scorer
    from axrl.inference.scoring.sglang import SGLangScorer

    if window is not None:
        monkeypatch.setattr(sglang_scorer, "FULL_VOCAB_BUDGET", window * Tokenizer.default().vocab_size)

    scorer = SGLangScorer(setup["launcher"].urls[0], vocab_size=Tokenizer.default().vocab_size)
    local = EmbeddedScorer(load_hf(setup["dir"]))
    try:
        for temperature in (1.0, 0.7):
            served, direct = scorer.score(PROMPTS, temperature), local.score(PROMPTS, temperature)
            for s, d in zip(served, direct):
                assert np.isnan(s[0]) and np.isnan(d[0])
                np.testing.assert_allclose(s[1:], d[1:], atol=1e-5, rtol=0)
        assert temperature != 1.0 and not np.allclose(served[1][1:], scorer.score(PROMPTS, 1.0)[1][1:])
    finally:
        scorer.close()
    bad = setup["http"].post("/generate", json={"input_ids": [1, 2], "logprob_start_len": 0,
                                                "sampling_params": {"max_new_tokens": 0}})
    assert bad.status_code == 400 and "return_logprob" in bad.json()["message"]
