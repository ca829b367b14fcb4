"""How close the other engines and trainers come to the exact trainer (`rollout.exact: true`), on
the same tokens, and what blocks bitwise equality.

* SGLang and vLLM (CPU servers): a short run with `rollout.exact: true` is recorded (tiny-moe,
  fp32, echo task, one step); its step-0 token streams are re-scored teacher-forced on a server
  launched on the step's policy (replay/server_rescore.py), and the server's logprobs are compared
  with the trace's `old_logprob` (the exact trainer's; bitwise the exact engine's rollout
  logprob). Each server runs once plain and once with its determinism switch: SGLang
  `--enable-deterministic-inference`, vLLM `VLLM_BATCH_INVARIANT=1` (vLLM 0.32's name). A switch the
  CPU build refuses is reported with the server's own error. `axrl-debug bisect --engine E`
  (replay/bisect.py) then names the first (layer, op) whose values differ at all (relative
  difference > 0) and the first over its numerics floor.
* Megatron (CPU, gloo): the exact embedded engine's samples are scored by the exact torch trainer
  and by the Megatron backend (same weights, recorded routing not replayed, then replayed: R3).

One server at a time, each stopped before the next starts. Prints a table and, last, one JSON
line: per engine `max_abs_delta`, `mean_abs_delta`, `tokens`, `first_nonzero_op`, `first_diverged_op`.

    nice -n 5 python bench/exact_beyond.py [--skip sglang,vllm,megatron,bisect] [--keep DIR]

The interpreters: $AXRL_SGLANG_PYTHON / $AXRL_VLLM_PYTHON (default ~/.cache/axrl/*-venv/bin/python).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
RUN_SETTINGS = ["steps=1", "model.preset=tiny-moe", "warmup.steps=30", "data.task=echo", "data.task_args={}",
                "data.prompts_per_step=2", "rollout.group_size=4", "eval.every=0", "runtime.threads=1",
                "checkpoint.every=1", "rollout.max_new_tokens=12", "train.micro_batch_tokens=200",
                "rollout.exact=true"]
PYTHONS = {"sglang": os.environ.get("AXRL_SGLANG_PYTHON", str(Path.home() / ".cache/axrl/sglang-venv/bin/python")),
           "vllm": os.environ.get("AXRL_VLLM_PYTHON", str(Path.home() / ".cache/axrl/vllm-venv/bin/python"))}
# (label, engine, extra server flags, extra environment)
SERVER_CASES = [("sglang", "sglang", [], {}),
                ("sglang_deterministic", "sglang", ["--enable-deterministic-inference"], {}),
                ("vllm", "vllm", [], {}),
                ("vllm_batch_invariant", "vllm", [], {"VLLM_BATCH_INVARIANT": "1"})]


def record_run(run: Path) -> None:
    """One step of the quickstart with `rollout.exact: true` and a checkpoint (the policy to serve)."""
    from typer.testing import CliRunner

    from axrl.cli import app

    args = ["train", str(ROOT / "examples" / "quickstart.yaml"), "--run-dir", str(run)]
    for s in RUN_SETTINGS:
        args += ["--set", s]
    res = CliRunner().invoke(app, args)
    if res.exit_code != 0:
        raise SystemExit(f"training the run failed:\n{res.output[-3000:]}")


def deltas(a: np.ndarray, b: np.ndarray) -> dict[str, Any]:
    """max / mean |a − b| over the positions both have, and how many are bitwise equal."""
    ok = np.isfinite(a) & np.isfinite(b)
    d = np.abs(a[ok].astype(np.float64) - b[ok].astype(np.float64))
    return {"tokens": int(ok.sum()), "max_abs_delta": float(d.max()) if d.size else None,
            "mean_abs_delta": float(d.mean()) if d.size else None, "bitwise_equal_tokens": int((d == 0).sum())}


def log_tail(log_dir: Path, lines: int = 6) -> str:
    """The last error-looking lines of the server logs (why a flag was refused)."""
    out = []
    for f in sorted(log_dir.glob("*")):
        text = f.read_text(errors="replace").splitlines()
        hits = [ln for ln in text if "Error" in ln or "error" in ln or "not supported" in ln.lower()]
        out += (hits or text)[-lines:]
    return " | ".join(s.strip()[:300] for s in out[-lines:])


def server_case(run: Path, label: str, engine: str, flags: list[str], env: dict[str, str], work: Path) -> dict:
    """Re-score step 0 on one server configuration against the exact trainer's old logprobs."""
    from replay.server_rescore import ServerOptions, rescore_on_server

    log_dir = work / f"logs_{label}"
    log_dir.mkdir(parents=True, exist_ok=True)
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # the launcher passes this process's environment on to the server
    t0 = time.perf_counter()
    try:
        opts = ServerOptions(python=PYTHONS[engine], cpu_compat=engine == "sglang", server_args=flags,
                             log_dir=log_dir)
        res = rescore_on_server(run, 0, engine, opts)
        out = deltas(res.served, res.columns["/tokens/old_logprob"])
        out["rollout_vs_old_max_abs_delta"] = deltas(res.recorded, res.columns["/tokens/old_logprob"])["max_abs_delta"]
        out["accepted"] = True
    except Exception as e:  # noqa: BLE001  (a refused flag is a result here, with the server's reason)
        out = {"accepted": False, "error": f"{type(e).__name__}: {str(e)[:400]}", "server_log": log_tail(log_dir)}
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    out["seconds"] = round(time.perf_counter() - t0, 1)
    return out


def bisect_case(run: Path, engine: str, work: Path) -> dict:
    """The first (layer, op) with any difference and the first over its floor, server vs exact trainer."""
    from replay.bisect import bisect_step
    from replay.server_rescore import ServerOptions

    opts = ServerOptions(python=PYTHONS[engine], cpu_compat=engine == "sglang", log_dir=work / f"logs_bisect_{engine}")
    try:
        res = bisect_step(run, 0, engine=engine, server=opts)
    except Exception as e:  # noqa: BLE001
        return {"error": f"{type(e).__name__}: {str(e)[:400]}"}
    nonzero = next((p for p in res.points if p.size > 0), None)
    return {"first_nonzero_op": None if nonzero is None else f"layer {nonzero.layer} {nonzero.op}",
            "first_nonzero_size": None if nonzero is None else nonzero.size,
            "first_nonzero_floor": None if nonzero is None else nonzero.floor,
            "first_diverged_op": res.first_divergence(),
            "topk_ids_agree": all(not p.diverged for p in res.points if p.op == "topk_ids"),
            "ops_bitwise_before": [f"{p.layer}:{p.op}" for p in res.points[:res.points.index(nonzero)]]
            if nonzero is not None else "all"}


# (Megatron module, its input or output, the torch model's module) at each probe point, in forward order
MEGATRON_POINTS = [("input_layernorm", "out", "input_layernorm"),
                   ("self_attention.linear_proj", "in", "self_attn.o_proj"),  # the attention context
                   ("self_attention", "out", "self_attn"),
                   ("pre_mlp_layernorm", "out", "post_attention_layernorm"),
                   ("mlp", "out", "mlp")]


def _capture(modules: dict[str, tuple[torch.nn.Module, str]], store: dict[str, torch.Tensor]) -> list:
    """Hooks storing each module's first input ("in") or first output ("out"), as [tokens, width]."""
    def first(t):
        t = t[0] if isinstance(t, (tuple, list)) else t
        return t.detach().reshape(-1, t.shape[-1]).clone()

    handles = []
    for key, (mod, side) in modules.items():
        if side == "in":
            handles.append(mod.register_forward_pre_hook(lambda m, a, key=key: store.__setitem__(key, first(a))))
        else:
            handles.append(mod.register_forward_hook(lambda m, a, o, key=key: store.__setitem__(key, first(o))))
    return handles


def megatron_first_op(meg, exact, batch) -> dict:
    """The first (layer, op) where Megatron's values differ at all from the exact trainer's, on one
    sample (world size 1: Megatron's model is in this process)."""
    mm, tm = meg._group.rank.model, exact.model.model
    layers = len(tm.layers)
    mods, got_m, got_t = {}, {}, {}
    for i in range(layers):
        for m_name, side, t_name in MEGATRON_POINTS:
            mods[f"m{i}:{m_name}"] = (mm.decoder.layers[i].get_submodule(m_name), side)
            mods[f"t{i}:{m_name}"] = (tm.layers[i].get_submodule(t_name), side)
    mods["mF:final_norm"], mods["tF:final_norm"] = (mm.decoder.final_layernorm, "out"), (tm.norm, "out")
    hm = _capture({k: v for k, v in mods.items() if k[0] == "m"}, got_m)
    ht = _capture({k: v for k, v in mods.items() if k[0] == "t"}, got_t)
    try:
        meg.forward(batch)
        exact.forward(batch)
    finally:
        for h in hm + ht:
            h.remove()
    points = []
    for key in [k[1:] for k in mods if k[0] == "m"]:
        a, b = got_m.get("m" + key), got_t.get("t" + key)
        if a is None or b is None:
            continue
        n = min(len(a), len(b))
        points.append((key, float((a[:n] - b[:n]).abs().max())))
    first = next(((k, d) for k, d in points if d > 0), None)
    return {"first_nonzero_op": None if first is None else first[0],
            "first_nonzero_max_abs": None if first is None else first[1],
            "points": {k: d for k, d in points}}


def megatron_case() -> dict:
    """The exact engine's samples scored by the exact torch trainer and by Megatron (CPU, gloo)."""
    from exact_mode import packed, requests

    from axrl.inference import EmbeddedEngine
    from axrl.model import build_model, preset_config
    from axrl.model.exact import set_exact
    from axrl.train import TorchBackend, TorchBackendConfig
    from axrl.train.megatron import MegatronBackend, MegatronBackendConfig

    cfg = preset_config("tiny-moe")
    reqs = requests(2, 4, 12, cfg.vocab_size)
    eng = EmbeddedEngine(set_exact(build_model(cfg, seed=0).eval(), True), max_batch_size=8, max_seq_len=128, seed=3)
    try:
        outs = eng.generate_batch(reqs, timeout=600)
    finally:
        eng.shutdown()
    batch = packed(reqs, outs)
    gen = batch.loss_mask > 0
    # a sample's last token never went through the model: its routing row is padding
    routed = gen.clone()
    routed[batch.offsets[1:] - 1] = False
    exact = TorchBackend(build_model(cfg, seed=0), TorchBackendConfig(lr=1e-5, num_threads=1, exact=True))
    ref = exact.forward(batch)
    normal = TorchBackend(build_model(cfg, seed=0), TorchBackendConfig(lr=1e-5, num_threads=1)).forward(batch)
    out: dict[str, Any] = {"exact_trainer_vs_rollout_max_abs_delta":
                           float((ref.logprobs[gen] - batch.rollout_logprobs[gen]).abs().max()),
                           "normal_torch_trainer": deltas(normal.logprobs[gen].numpy(), ref.logprobs[gen].numpy())}
    meg = MegatronBackend(build_model(cfg, seed=0), MegatronBackendConfig(lr=1e-5, num_threads=1))
    try:
        for name, r3 in (("plain", False), ("r3", True)):
            fwd = meg.forward(batch, r3=r3)
            d = deltas(fwd.logprobs[gen].numpy(), ref.logprobs[gen].numpy())
            d["routing_agreement"] = float((fwd.routed_experts[routed] == ref.routed_experts[routed]).all(-1).all(-1)
                                           .float().mean())
            # is Megatron's residual the normal torch trainer's (torch's standard ops), or its own?
            d["vs_normal_torch_trainer"] = deltas(fwd.logprobs[gen].numpy(), normal.logprobs[gen].numpy())
            out[name] = d
        one = packed(reqs[:1], outs[:1])  # one sample: its tokens as both sides see them
        out["bisect"] = megatron_first_op(meg, exact, one)
    finally:
        meg.close()
    return out


def fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.3g}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--skip", default="", help="comma list of: sglang, vllm, megatron, bisect")
    ap.add_argument("--keep", default=None, help="work directory to keep (default: a temporary one)")
    args = ap.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    torch.set_num_threads(1)
    work = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="exact_beyond_"))
    run = work / "run"
    result: dict[str, Any] = {"model": "tiny-moe", "dtype": "float32", "threads": 1}
    if not (skip >= {"sglang", "vllm"}):
        if not (run / "trace").is_dir():
            record_run(run)
        for label, engine, flags, env in SERVER_CASES:
            if engine not in skip:
                print(f"[{label}] re-scoring step 0 …", flush=True)
                result[label] = server_case(run, label, engine, flags, env, work)
                print(f"[{label}] {result[label]}", flush=True)
        for engine in ("sglang", "vllm"):
            if engine not in skip and "bisect" not in skip:
                print(f"[bisect {engine}] …", flush=True)
                result[f"bisect_{engine}"] = bisect_case(run, engine, work)
                print(f"[bisect {engine}] {result[f'bisect_{engine}']}", flush=True)
    if "megatron" not in skip:
        try:
            result["megatron"] = megatron_case()
        except Exception:  # noqa: BLE001
            result["megatron"] = {"error": traceback.format_exc()[-600:]}
        print(f"[megatron] {result['megatron']}", flush=True)
    print(f"{'against the exact trainer':26} {'accepted':>8} {'tokens':>6} {'max |Δ|':>10} {'mean |Δ|':>10} "
          f"{'bitwise':>7}")
    for label, v in result.items():
        rows = [(label, v)] if isinstance(v, dict) and "max_abs_delta" in v else \
            [(f"{label}_{k}", w) for k, w in v.items() if isinstance(w, dict) and "max_abs_delta" in w] \
            if isinstance(v, dict) else []
        for name, w in rows:
            if "accepted" in w and not w["accepted"]:
                print(f"{name:26} {'False':>8}  refused: {w['error'][:100]}")
                continue
            print(f"{name:26} {str(w.get('accepted', True)):>8} {w['tokens']:>6} {fmt(w['max_abs_delta']):>10} "
                  f"{fmt(w['mean_abs_delta']):>10} {w['bitwise_equal_tokens']:>7}")
    print(json.dumps(result, default=str))


if __name__ == "__main__":
    main()
