"""Unit tests of the Tinker-compatible service (axrl/service): the protobuf payloads against the
SDK's own codecs, each loss function against an independent per-token reference (sum reduction),
the futures' seq_id ordering, retry dedup and long-poll, datum validation."""

from __future__ import annotations

import asyncio
import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch
from tinker import types
from tinker.proto.request_conv import forward_backward_request_to_proto
from tinker.proto.response_conv import deserialize_forward_backward_output, deserialize_sample_response

from axrl.tinker_api.batch import pack
from axrl.tinker_api.errors import UserError
from axrl.tinker_api.futures import FutureStore
from axrl.tinker_api.losses import ServiceLoss, check_loss
from axrl.tinker_api.wire import Sequence, decode_forward_backward, encode_forward_backward_output, encode_sample_response
from axrl.train.protocol import LossContext


def _datum(tokens: list[int], **inputs: np.ndarray) -> types.Datum:
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": np.asarray(tokens[1:], np.int64), **inputs})


def _request(data: list[types.Datum], loss_fn: str = "importance_sampling", config=None) -> bytes:
    req = types.ForwardBackwardRequest(forward_backward_input=types.ForwardBackwardInput(
        data=data, loss_fn=loss_fn, loss_fn_config=config), model_id="s:train:0", seq_id=7)
    return forward_backward_request_to_proto(req).SerializeToString()


def test_forward_backward_request_round_trip_from_the_sdk_encoder() -> None:
    adv = np.asarray([0.0, 0.0, 1.5, -0.5], np.float32)
    lp = np.asarray([0.0, 0.0, -1.25, -2.5], np.float32)
    call = decode_forward_backward(_request([_datum([5, 6, 7, 8, 9], advantages=adv, logprobs=lp)],
                                            "ppo", {"clip_low_threshold": 0.7}))
    assert (call.model_id, call.seq_id, call.loss_fn) == ("s:train:0", 7, "ppo")
    assert call.loss_fn_config == {"clip_low_threshold": 0.7}
    d = call.data[0]
    assert d.tokens.tolist() == [5, 6, 7, 8, 9]
    assert d.inputs["advantages"].tolist() == adv.tolist() and d.inputs["logprobs"].tolist() == lp.tolist()
    batch = pack(call.data, "ppo")
    assert batch.loss_mask.tolist() == [0, 0, 0, 1, 1]
    assert bool(torch.isnan(batch.rollout_logprobs[:3]).all()) and batch.rollout_logprobs[3:].tolist() == [-1.25, -2.5]


def test_datum_errors_name_the_datum_and_field() -> None:
    bad_shift = types.Datum(model_input=types.ModelInput.from_ints([1, 2, 3]),
                            loss_fn_inputs={"target_tokens": np.asarray([2, 9, 4]), "weights": np.ones(3, np.float32)})
    with pytest.raises(UserError, match=r"data\[0\]: target_tokens\[1\] = 9 is not model_input\[2\] = 3"):
        decode_forward_backward(_request([bad_shift], "cross_entropy"))
    short = _datum([1, 2, 3, 4], weights=np.ones(2, np.float32))
    with pytest.raises(UserError, match=r"data\[0\].loss_fn_inputs\['weights'\] has 2 values for 3"):
        decode_forward_backward(_request([short], "cross_entropy"))
    call = decode_forward_backward(_request([_datum([1, 2, 3], weights=np.ones(2, np.float32))], "cross_entropy"))
    with pytest.raises(UserError, match="importance_sampling needs 'advantages'"):
        pack(call.data, "importance_sampling")
    with pytest.raises(UserError, match="unknown loss_fn 'nope'"):
        check_loss("nope", {})
    with pytest.raises(UserError, match="stable_reinforce"):
        check_loss("stable_reinforce", {})
    with pytest.raises(UserError, match=r"loss_fn_config\['beta'\]: not a parameter of ppo"):
        check_loss("ppo", {"beta": 1.0})


def test_forward_backward_output_and_sample_response_decode_in_the_sdk() -> None:
    lps = [np.asarray([-1.0, -2.0], np.float32), np.asarray([-0.5], np.float32)]
    out = deserialize_forward_backward_output(encode_forward_backward_output(
        {"logprobs": lps, "elementwise_loss": lps}, {"loss:sum": 3.5}, 2))
    assert out.metrics == {"loss:sum": 3.5}
    assert [o["logprobs"].tolist() for o in out.loss_fn_outputs] == [[-1.0, -2.0], [-0.5]]
    res = deserialize_sample_response(encode_sample_response(
        [Sequence([4, 5, 2], [-0.1, -0.2, -0.3], "stop"), Sequence([7], [-1.5], "length")],
        np.asarray([np.nan, -3.0], np.float32)))
    assert [s.tokens for s in res.sequences] == [[4, 5, 2], [7]]
    assert [s.stop_reason for s in res.sequences] == ["stop", "length"]
    assert res.sequences[0].logprobs == pytest.approx([-0.1, -0.2, -0.3])
    assert math.isnan(res.prompt_logprobs_np[0]) and res.prompt_logprobs_np[1] == -3.0


def _reference(name: str, lp: list[float], q: list[float], a: list[float], cfg: dict[str, float]) -> float:
    """Tinker's per-token definitions, summed, written out token by token."""
    lo, hi = cfg.get("clip_low_threshold", 0.8), cfg.get("clip_high_threshold", 1.2)
    total = 0.0
    for x, y, adv in zip(lp, q, a):
        r = math.exp(x - y)
        if name == "cross_entropy":
            total += -adv * x                     # adv holds the weight
        elif name == "importance_sampling":
            total += -r * adv
        elif name == "ppo":
            total += max(-r * adv, -min(max(r, lo), hi) * adv)
        elif name == "cispo":
            total += -min(max(r, lo), hi) * adv * x
        elif name == "dro":
            total += -(adv * x - (0.5 * cfg.get("beta", 0.05) * (x - y) ** 2 if y != 0 else 0.0))
    return total


@pytest.mark.parametrize("name,cfg", [("cross_entropy", {}), ("importance_sampling", {}), ("ppo", {}),
                                      ("ppo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.05}),
                                      ("cispo", {}), ("dro", {"beta": 0.3})])
def test_each_loss_matches_a_per_token_reference_sum(name: str, cfg: dict[str, float]) -> None:
    g = torch.Generator().manual_seed(3)
    datums = []
    for n in (4, 6):
        tokens = torch.randint(3, 50, (n + 1,), generator=g).tolist()
        a = torch.randn(n, generator=g).numpy().astype(np.float32)
        q = (-torch.rand(n, generator=g) * 3 - 0.01).numpy().astype(np.float32)
        a[:2], q[:2] = 0.0, 0.0          # the prompt: no advantage, no sampler logprob
        key = {"weights": np.abs(a)} if name == "cross_entropy" else {"advantages": a, "logprobs": q}
        datums.append(_datum(tokens, **key))
    call = decode_forward_backward(_request(datums, name))
    batch = pack(call.data, name)
    lp = (-torch.rand(batch.num_tokens, generator=g) * 3).requires_grad_(True)
    loss, cols = ServiceLoss(name, cfg)(lp, torch.zeros_like(lp), batch, LossContext.of(batch))
    expected = 0.0
    off = batch.offsets.tolist()
    for i, d in enumerate(call.data):
        rows = range(off[i] + 1, off[i + 1])
        a = d.inputs["weights"] if name == "cross_entropy" else d.inputs["advantages"]
        q = d.inputs.get("logprobs", np.zeros(d.n, np.float32))
        expected += _reference(name, [float(lp.detach()[r]) for r in rows], q.tolist(), a.tolist(), cfg)
    assert float(loss) == pytest.approx(expected, rel=1e-5, abs=1e-5)
    assert float(cols["tokens/elementwise_loss"].sum()) == pytest.approx(float(loss), rel=1e-6)
    loss.backward()
    assert lp.grad is not None and bool((lp.grad[batch.offsets[:-1]] == 0).all())  # row 0 predicts nothing


def _store_run(coro_fn):
    return asyncio.run(coro_fn())


def test_requests_of_a_model_run_in_seq_id_order_and_retries_run_once() -> None:
    ran: list[int] = []
    pool = ThreadPoolExecutor(1)

    async def main() -> None:
        store = FutureStore(poll_s=5.0, gap_s=5.0)
        store.open_model("m")

        def op(i: int):
            return lambda: (ran.append(i) or ("json", {"i": i}))
        # seq 3 and 2 arrive before seq 1: they wait for their turn
        t3 = asyncio.create_task(store.submit_ordered("m", 3, op(3), pool))
        t2 = asyncio.create_task(store.submit_ordered("m", 2, op(2), pool))
        await asyncio.sleep(0.05)
        assert not t3.done() and not t2.done()
        r1, _ = await store.submit_ordered("m", 1, op(1), pool)
        (r3, _), (r2, _) = await t3, await t2
        again, _ = await store.submit_ordered("m", 2, op(99), pool)   # a retried POST
        assert again == r2
        assert [await store.retrieve(r) for r in (r1, r2, r3)] == [("json", {"i": i}) for i in (1, 2, 3)]
    _store_run(main)
    assert ran == [1, 2, 3]


def test_retrieve_long_polls_then_answers_try_again() -> None:
    gate = threading.Event()
    pool = ThreadPoolExecutor(1)

    async def main() -> None:
        store = FutureStore(poll_s=0.3)
        rid = store.submit(lambda: (gate.wait(5) and ("json", {"ok": 1})), pool)
        t0 = time.perf_counter()
        first = await store.retrieve(rid)
        waited = time.perf_counter() - t0
        assert first == ("json", {"type": "try_again", "request_id": rid, "queue_state": "active"})
        assert waited >= 0.25                       # it held the poll instead of answering at once
        gate.set()
        assert await store.retrieve(rid) == ("json", {"ok": 1})
        unknown = await store.retrieve("nope")
        assert unknown[1]["category"] == "user"
        failing = store.submit(lambda: (_ for _ in ()).throw(UserError("bad datum")), pool)
        assert await store.retrieve(failing) == ("json", {"error": "bad datum", "category": "user"})
    _store_run(main)


def test_unnamed_sampler_snapshots_are_bounded_and_dropped_ones_say_so() -> None:
    from axrl.tinker_api.sampling import KEEP_EPHEMERAL, Sampler

    class Engine:
        def update_weights(self, source, version):   # noqa: ANN001 - a stand-in that only counts loads
            return version

    sampler = Sampler(Engine(), None, None, {"w": torch.zeros(2)})  # type: ignore[arg-type]
    paths = [f"tinker://m/sampler_weights/e{i}" for i in range(KEEP_EPHEMERAL + 2)]
    for i, p in enumerate(paths):
        sampler.add_snapshot(p, {"w": torch.full((2,), float(i))}, ephemeral=True)
    sampler.add_snapshot("tinker://m/sampler_weights/named", {"w": torch.ones(2)})
    for p in paths[-KEEP_EPHEMERAL:] + ["tinker://m/sampler_weights/named", "base"]:
        sampler.check(p)
    with pytest.raises(UserError, match="dropped"):
        sampler.check(paths[0])


def _tiny_dense(tmp_path):
    from axrl.model import build_model, preset_config, save_hf
    from axrl.tokenizer import Tokenizer

    tok = Tokenizer.default()
    cfg = preset_config("tiny-dense", vocab_size=tok.vocab_size, eos_token_id=tok.eos_token_id,
                        pad_token_id=tok.pad_token_id)
    return save_hf(build_model(cfg, seed=0), tmp_path / "model", tokenizer=tok)


def test_a_vllm_service_without_vllm_says_what_to_build(tmp_path) -> None:
    """`rollout.engine: vllm` is wired in: without a vLLM environment the service says how to get one."""
    from axrl.assembly.tinker_api import build_service
    from axrl.config import load_config
    from axrl.inference.serve import ServeConfig

    cfg = load_config(None, ["rollout.engine=vllm", f"rollout.vllm.python={tmp_path / 'none' / 'python'}"])
    with pytest.raises(ValueError, match="does not exist; build the CPU environment with scripts/vllm-cpu-env.sh"):
        build_service(ServeConfig(model_path=str(_tiny_dense(tmp_path))), cfg, tmp_path / "run")


def test_stopping_the_service_finishes_its_work_then_stops_the_engines(tmp_path, monkeypatch) -> None:
    """Shutting the app down runs the service's releases (queued training work and step files, then
    the sampling servers) before the served engine stops, each even when an earlier one fails —
    Starlette never runs `router.on_shutdown` beside a lifespan, which once left them undone."""
    from fastapi.testclient import TestClient

    from axrl.assembly.tinker_api import build_service
    from axrl.config import load_config
    from axrl.inference.serve import ServeConfig
    from axrl.tinker_api.state import ServiceState

    model = _tiny_dense(tmp_path)
    calls: list[str] = []

    def failing_close(self) -> None:
        calls.append("state")
        raise RuntimeError("a release failed")
    monkeypatch.setattr(ServiceState, "close", failing_close)
    app, server, _state = build_service(ServeConfig(model_path=str(model)), load_config(None, []), tmp_path / "run")
    stop_engine = server.engine.shutdown
    monkeypatch.setattr(server.engine, "shutdown", lambda: (calls.append("engine"), stop_engine()))
    with pytest.raises(RuntimeError, match="a release failed"):
        with TestClient(app):
            assert calls == []
    assert calls == ["state", "engine"]


def test_non_finite_datum_inputs_are_refused_naming_datum_field_and_position() -> None:
    # a NaN weight or an -inf sampler logprob would otherwise poison the accumulated gradients (and
    # the next optim_step moves every weight to NaN)
    good = _datum([1, 2, 3, 4], weights=np.ones(3, np.float32))
    nan_w = _datum([1, 2, 3, 4], weights=np.asarray([1.0, np.nan, 1.0], np.float32))
    with pytest.raises(UserError, match=r"data\[1\].loss_fn_inputs\['weights'\]\[1\] is nan"):
        decode_forward_backward(_request([good, nan_w], "cross_entropy"))
    inf_q = _datum([1, 2, 3, 4], advantages=np.ones(3, np.float32), logprobs=np.asarray([0, -np.inf, -1], np.float32))
    with pytest.raises(UserError, match=r"data\[0\].loss_fn_inputs\['logprobs'\]\[1\] is -inf"):
        decode_forward_backward(_request([inf_q]))


def test_token_ids_outside_the_vocabulary_are_refused_before_any_gradient() -> None:
    big = _datum([1, 2, 3, 5000], weights=np.ones(3, np.float32))
    call = decode_forward_backward(_request([_datum([1, 2, 3], weights=np.ones(2, np.float32)), big], "cross_entropy"))
    with pytest.raises(UserError, match=r"data\[1\].loss_fn_inputs\['target_tokens'\]\[2\] = 5000 is outside the "
                                        r"model's vocabulary \[0, 1024\)"):
        pack(call.data, "cross_entropy", vocab_size=1024)
    first = _datum([7000, 2, 3], weights=np.ones(2, np.float32))
    call = decode_forward_backward(_request([first], "cross_entropy"))
    with pytest.raises(UserError, match=r"data\[0\].model_input\[0\] = 7000 is outside"):
        pack(call.data, "cross_entropy", vocab_size=1024)


def test_a_datum_longer_than_the_models_positions_is_refused() -> None:
    call = decode_forward_backward(_request([_datum(list(range(1, 12)), weights=np.ones(10, np.float32))],
                                            "cross_entropy"))
    with pytest.raises(UserError, match=r"data\[0\] is 11 tokens \(model_input \+ the last target\), more than "
                                        r"the model's max_position_embeddings 8"):
        pack(call.data, "cross_entropy", vocab_size=1024, max_positions=8)
    assert pack(call.data, "cross_entropy", vocab_size=1024, max_positions=11).num_samples == 1


class _FakeModel:
    """A service model that answers every forward_backward / optim_step at once (the routes'
    ordering is under test, not the training)."""

    lora_rank = None

    def __init__(self, model_id: str) -> None:
        self.model_id, self.ran = model_id, []

    def forward_backward(self, call) -> bytes:     # noqa: ANN001 - a decoded ForwardBackwardCall
        self.ran.append(call.seq_id)
        return encode_forward_backward_output({}, {"loss:sum": 0.0}, len(call.data))

    def optim_step(self, params) -> dict:          # noqa: ANN001 - the request's AdamW params
        return {"metrics": {}}

    def close(self) -> None:
        pass


def _refused_bodies(model_id: str) -> dict[str, bytes]:
    """forward_backward bodies that decode_forward_backward refuses, one per kind, seq_id unset."""
    from tinker.proto import tinker_public_pb2 as pb

    def body(datum: types.Datum, loss_fn: str = "cross_entropy", tweak=None) -> bytes:   # noqa: ANN001
        req = types.ForwardBackwardRequest(forward_backward_input=types.ForwardBackwardInput(
            data=[datum], loss_fn=loss_fn), model_id=model_id, seq_id=0)
        msg = forward_backward_request_to_proto(req)
        if tweak is not None:
            tweak(msg.data[0].loss_fn_inputs)
        return msg.SerializeToString()

    ones = np.ones(3, np.float32)

    def bad_dtype(inputs) -> None:                 # noqa: ANN001 - the datum's protobuf map
        inputs["weights"].dtype = pb.DTYPE_BFLOAT16

    def two_d(inputs) -> None:                     # noqa: ANN001
        inputs["weights"].shape[:] = [3, 1]
    return {
        "nan weight": body(_datum([1, 2, 3, 4], weights=np.asarray([1, np.nan, 1], np.float32))),
        "inf logprob": body(_datum([1, 2, 3, 4], advantages=ones, logprobs=np.asarray([0, -np.inf, 0], np.float32)),
                            "importance_sampling"),
        "shape mismatch": body(_datum([1, 2, 3, 4], weights=np.ones(2, np.float32))),
        "bad dtype": body(_datum([1, 2, 3, 4], weights=ones), tweak=bad_dtype),
        "2-d input": body(_datum([1, 2, 3, 4], weights=ones), tweak=two_d),
        "unknown key": body(_datum([1, 2, 3, 4], weights=ones, extra=ones)),
        "not shifted": body(types.Datum(model_input=types.ModelInput.from_ints([1, 2, 3]),
                                        loss_fn_inputs={"target_tokens": np.asarray([2, 9, 4]), "weights": ones})),
    }


def _with_seq(body: bytes, seq: int) -> bytes:
    from tinker.proto import tinker_public_pb2 as pb

    msg = pb.ForwardBackwardRequest()
    msg.ParseFromString(body)
    msg.seq_id = seq
    return msg.SerializeToString()


def test_every_refused_request_consumes_its_seq_id_so_the_next_is_served_at_once() -> None:
    # A refused forward_backward used to be answered without taking its turn: its seq_id stayed
    # unused and the model's next request waited out the gap limit (10 s) for it.
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from axrl.tinker_api.routes import add_tinker_routes
    from axrl.tinker_api.state import ServiceState

    state = ServiceState(sampler=None, make_model=lambda i, mid, rank: _FakeModel(mid), base_model="m",
                         model_dir=Path("/nonexistent"), arch="qwen3", store=FutureStore(poll_s=60.0, gap_s=60.0))
    app = FastAPI()
    add_tinker_routes(app, state)
    model = state.create_model("s:train:0", None)
    good = _request([_datum([1, 2, 3], weights=np.ones(2, np.float32))], "cross_entropy")
    headers = {"x-api-key": "tml-test"}
    seq = 1
    with TestClient(app) as client:
        def post(path: str, **kw) -> tuple[dict, float]:   # noqa: ANN003
            t0 = time.perf_counter()
            r = client.post(f"/api/v1/{path}", headers=headers, **kw)
            assert r.status_code == 200, r.text
            res = client.post("/api/v1/retrieve_future", headers=headers, json={"request_id": r.json()["request_id"]})
            return res, time.perf_counter() - t0

        for kind, bad in _refused_bodies("s:train:0").items():
            res, _ = post("forward_backward", content=_with_seq(bad, seq))
            assert res.json()["category"] == "user", (kind, res.text)
            assert state.store.next_seq["s:train:0"] == seq + 1, f"the refusal ({kind}) did not take its turn"
            _, waited = post("forward_backward", content=_with_seq(good, seq + 1))
            # the bug waits out the gap limit (60 s here); a busy CI machine still answers in seconds
            assert waited < 20.0, f"after a refused forward_backward ({kind}) the next request waited {waited:.1f} s"
            seq += 2
        # a request for an unknown model is refused in its turn too (the model may be created later)
        res, _ = post("forward_backward", content=_with_seq(_request([], "cross_entropy").replace(b"s:train:0",
                                                                                                b"s:train:9"), 1))
        assert "unknown model_id" in res.json()["error"]
        _, waited = post("optim_step", json={"model_id": "s:train:9", "seq_id": 2})
        assert waited < 20.0
        _, waited = post("optim_step", json={"model_id": "s:train:0", "seq_id": seq})
        assert waited < 20.0
    assert model.ran == list(range(2, seq, 2))      # only the good requests ran, in order
    state.close()


def test_a_sampler_logprob_of_exactly_zero_is_kept_and_unknown_stays_nan() -> None:
    # a token sampled with p = 1 (logprob 0.0 in float32) used to be stored as NaN ("unknown"), so
    # it left the trace's rollout logprobs and the mismatch statistics
    adv = np.asarray([0.0, 0.0, 1.0, 1.0, 0.0], np.float32)
    lp = np.asarray([0.0, 0.0, 0.0, -1.5, 0.0], np.float32)
    mask = np.asarray([0, 0, 1, 1, 1], np.float32)
    call = decode_forward_backward(_request([_datum([5, 6, 7, 8, 9, 10], advantages=adv, logprobs=lp),
                                             _datum([5, 6, 7, 8, 9, 10], advantages=adv, logprobs=lp, mask=mask),
                                             _datum([5, 6, 7], weights=np.ones(2, np.float32))]))
    batch = pack(call.data[:2], "importance_sampling")
    q = batch.rollout_logprobs.tolist()
    assert q[3:5] == [0.0, -1.5]                          # sampled at p = 1: 0.0, not NaN
    assert all(math.isnan(v) for v in q[:3] + [q[5]])      # prompt filler and the untrained tail: unknown
    assert q[6 + 3:6 + 6] == [0.0, -1.5, 0.0]              # the mask names the last position as sampled
    ce = pack(call.data[2:], "cross_entropy")
    assert bool(torch.isnan(ce.rollout_logprobs).all())   # no logprobs sent: unknown everywhere
