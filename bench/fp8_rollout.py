"""Low-precision rollout: the mismatch fp8 weights, W8A8 (fp8 weights and activations) and an
fp8 KV cache add, and what the corrections recover.

Two measurements, both from real CPU runs of the quickstart (calculator, tiny MoE):

1. Training runs, one per variant, side by side (`--parallel` at a time, each in its own
   process): the rollout engine in fp32, bf16, fp8 weights and W8A8 (`rollout.precision:
   fp8_w8a8`; each with the quickstart's TIS), and fp8 / W8A8 with no correction, with MIS instead
   of TIS, fp8 with IcePop and with R3. Per run: the mismatch of its rollout logprobs against the
   fp32 trainer over all steps (`axrl-debug mismatch --json`: mean |Δ|, k3, by position and by
   token), routing agreement, and the eval curve (metrics.jsonl).
2. The same tokens under every precision: the fp32 run's last checkpointed step re-run through the
   embedded engine's decode path (teacher-forced, as `axrl-debug replay --rollout --engine
   embedded` does) with the run's config set to each rollout precision, against a trainer forward
   on the same tokens: mean and max |Δ logprob| and routing agreement (same expert set per
   token-layer). "Rollout-only" rows score with the fp32 trainer; "end-to-end" rows score with a
   trainer in the same precision (bf16 model; W8A8: the same fp8 weights and `fp8_round_act` on
   every quantised linear's input of the model's own forward) — verl's comparison of FP8
   rollout-only, FP8 end-to-end and BF16.

Then `axrl-debug explain` on the fp8 run's same step attributes its gap per layer.

    python bench/fp8_rollout.py [--steps 20] [--parallel 3] [--out runs/bench_fp8] [--reuse]
                                [--variants fp32,fp8,w8a8]

The last line is one JSON object (keys `<precision>_mean_abs_delta`, `_max_abs_delta`,
`_routing_agreement` on the same tokens, `<variant>_final_eval`, and the details).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
MIS = "{lower: 0.5, upper: 2.0}"  # verl's rollout-IS "mask" mode, token level
SMALL = ["data.prompts_per_step=8", "eval.every=5", "eval.prompts=32", "checkpoint.every=5", "runtime.threads=1"]
VARIANTS = {
    "fp32": ["rollout.weight_dtype=fp32"],
    "bf16": ["rollout.weight_dtype=bf16"],
    "fp8": ["rollout.weight_dtype=fp8"],
    "fp8_no_correction": ["rollout.weight_dtype=fp8", "algo.tis=false"],
    "fp8_icepop": ["rollout.weight_dtype=fp8", "algo.tis=false", "algo.correction={icepop: {low: 0.5, high: 5.0}}"],
    "fp8_r3": ["rollout.weight_dtype=fp8", "r3=true"],
    "fp8_mis": ["rollout.weight_dtype=fp8", "algo.tis=false", f"algo.correction={{mis: {MIS}}}"],
    "w8a8": ["rollout.precision=fp8_w8a8"],
    "w8a8_no_correction": ["rollout.precision=fp8_w8a8", "algo.tis=false"],
    "w8a8_mis": ["rollout.precision=fp8_w8a8", "algo.tis=false", f"algo.correction={{mis: {MIS}}}"],
}
# name → (the engine's rollout/model settings, the trainer that scores the same tokens)
SAME_TOKENS: dict[str, tuple[dict, str]] = {
    "fp32": ({}, "fp32"),
    "bf16_weights": ({"weight_dtype": "bf16"}, "fp32"),
    "fp8": ({"weight_dtype": "fp8"}, "fp32"),
    "w8a8": ({"precision": "fp8_w8a8"}, "fp32"),
    "fp8_kv": ({"kv_dtype": "fp8"}, "fp32"),
    "fp8_weights_and_kv": ({"weight_dtype": "fp8", "kv_dtype": "fp8"}, "fp32"),
    "w8a8_end_to_end": ({"precision": "fp8_w8a8"}, "w8a8"),
    "bf16_end_to_end": ({"dtype": "bfloat16"}, "bf16"),
}


def launch(out: Path, steps: int, names: list[str], extra: list[str],
           variants: dict[str, list[str]] | None = None) -> list[tuple[str, subprocess.Popen]]:
    """Start `axrl train` of the quickstart for each variant (`variants`: name → its overrides,
    default this bench's VARIANTS; logs beside the run directories)."""
    variants = VARIANTS if variants is None else variants
    procs = []
    for name in names:
        args = [sys.executable, "-m", "axrl.cli", "train", str(ROOT / "examples" / "quickstart.yaml"),
                "--run-dir", str(out / name)]
        for s in [f"steps={steps}", *SMALL, *extra, *variants[name]]:
            args += ["--set", s]
        log = open(out / f"{name}.log", "w")
        procs.append((name, subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT,
                                             env={**os.environ, "PYTHONPATH": str(ROOT)})))
    return procs


def train_all(out: Path, steps: int, parallel: int, reuse: bool, names: list[str],
              extra: list[str], variants: dict[str, list[str]] | None = None) -> dict[str, float]:
    """The variants' runs (`parallel` at a time); wall seconds per run."""
    todo = [n for n in names if not (reuse and (out / n / "manifest.json").is_file())]
    for n in todo:
        shutil.rmtree(out / n, ignore_errors=True)
    wall: dict[str, float] = {}
    for i in range(0, len(todo), parallel):
        t0 = time.perf_counter()
        for name, p in launch(out, steps, todo[i:i + parallel], extra, variants):
            if p.wait() != 0:
                raise SystemExit(f"run {name} failed: see {out / f'{name}.log'}")
            wall[name] = time.perf_counter() - t0
    return wall


def debug_json(*args: str) -> dict:
    """`axrl-debug ARGS --json` in a child process, parsed."""
    res = subprocess.run([sys.executable, "-m", "axrl_debug.cli", *args, "--json"], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}, check=True)
    return json.loads(res.stdout)


def brief(rows: list[dict]) -> list[dict]:
    """A breakdown's buckets without their shares."""
    return [{k: r[k] for k in ("bucket", "count", "mean_abs")} for r in rows]


def run_metrics(run: Path) -> dict:
    """Mismatch over all steps, routing agreement, reward and the eval curve of one run."""
    mm = debug_json("mismatch", str(run))
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    evals = [(r["step"], r["eval_reward"]) for r in rows if r.get("eval_reward") is not None]
    final = [r["eval_reward_final"] for r in rows if r.get("eval_reward_final") is not None]
    if final:   # the eval after the last step, at the step count
        evals.append((max((r["step"] for r in rows if "step" in r), default=-1) + 1, final[-1]))
    train = [r for r in rows if r.get("reward") is not None]
    m, routing = mm["metrics"], mm.get("routing") or {}
    steps = debug_json("summary", str(run))["steps"]
    rules = {k: sum(r.get(k) or 0.0 for r in steps) / len(steps)
             for k in ("rule_tis_truncated_frac", "rule_icepop_masked_frac", "is_weight_mean", "frac_above_tis_cap")}
    return {"mean_abs": m["mean_abs"], "k3": m["k3"], "max_abs": m["max_abs"], "tokens": mm["tokens"]["analysed"],
            "routing_agreement": routing.get("agreement"), "corrections": rules,
            "by_position": brief(mm["breakdowns"]["position"]),
            "by_token_prob": brief(mm["breakdowns"]["rollout_prob"]),
            "eval_curve": evals, "final_eval": evals[-1][1] if evals else None,
            "mean_train_reward": sum(r["reward"] for r in train) / max(len(train), 1)}


def _variant_cfg(cfg, update: dict):
    """The run's config with the rollout precision (and model dtype) of one same-tokens row."""
    rollout = {"weight_dtype": "fp32", "kv_dtype": "auto", "precision": "auto",
               **{k: v for k, v in update.items() if k != "dtype"}}
    model = cfg.model.model_copy(update={"dtype": update.get("dtype", cfg.model.dtype)})
    return cfg.model_copy(update={"rollout": cfg.rollout.model_copy(update=rollout), "model": model})


def _trainer_model(cfg, state, kind: str):
    """The trainer's forward on the same weights: fp32 as trained, a bf16 model, or W8A8 — the
    engine's fp8 weights and `fp8_round_act` on the input of each quantised linear (pre-hooks)."""
    from axrl.assembly.build import make_engine_model
    from axrl.inference.quant import fp8_round_act, is_quantised

    update = {"bf16": {"dtype": "bfloat16"}, "w8a8": {"precision": "fp8_w8a8"}}.get(kind, {})
    model = make_engine_model(_variant_cfg(cfg, update), state.backend.model_config,
                              dict(state.backend.named_weights()))
    if kind == "w8a8":
        for name, mod in model.named_modules():
            if isinstance(mod, torch.nn.Linear) and is_quantised(f"{name}.weight"):
                mod.register_forward_pre_hook(lambda _m, args: (fp8_round_act(args[0]), *args[1:]))
    return model


@torch.inference_mode()
def _trainer_side(model, ro, samples: set[int], temperature: float) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """Per sample: the trainer's logprob of token p (from row p-1; NaN at 0) and its routing rows."""
    out = {}
    for s in sorted(samples):
        ids = torch.as_tensor(ro.ids[int(ro.off[s]):int(ro.off[s + 1])].astype(np.int64))[None]
        res = model(ids, return_routing=True)
        lp = torch.log_softmax(res.logits[0].float() / temperature, -1)[:-1].gather(-1, ids[0, 1:, None])[:, 0]
        route = res.routed_experts[0].numpy() if res.routed_experts is not None else None
        out[s] = (np.concatenate([[np.nan], lp.numpy()]), route)
    return out


def same_tokens_parallel(run: Path, step: int, workers: int) -> dict[str, dict]:
    """`same_tokens` with its rows split over `workers` processes (each rebuilds the trainer)."""
    import concurrent.futures
    import multiprocessing

    names = list(SAME_TOKENS)
    if workers <= 1:
        return same_tokens(run, step)
    chunks = [names[i::workers] for i in range(workers)]
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        parts = list(pool.map(same_tokens, [run] * workers, [step] * workers, chunks))
    merged = {k: v for part in parts for k, v in part.items()}
    return {k: merged[k] for k in names}


def same_tokens(run: Path, step: int, names: list[str] | None = None) -> dict[str, dict]:
    """The gap each rollout precision adds on exactly the tokens of `run`'s step `step`: the engine's
    decode path under that precision vs a trainer forward (see SAME_TOKENS; `names`: some rows)."""
    torch.set_num_threads(1)
    from axrl.assembly.build import make_engine_model
    from axrl.trace import StepFile
    from replay.engine_path import contexts_of, run_engine_path
    from replay.policy import policy_before
    from replay.rollout import clock_schedule, engine_prefix_cache, rolled_out

    state = policy_before(run, step)
    out: dict[str, dict] = {}
    try:
        cfg = state.cfg
        with StepFile(state.inventory.files[step]) as sf:
            ro = rolled_out(sf)
        generated = np.isfinite(ro.rollout_logprob) & (ro.policy_version == step)
        contexts = contexts_of(ro.off, ro.ids, ro.turn, generated)
        trainers: dict[str, dict] = {}
        for name in names or list(SAME_TOKENS):
            update, trainer = SAME_TOKENS[name]
            vcfg = _variant_cfg(cfg, update)
            if trainer not in trainers:
                trainers[trainer] = _trainer_side(_trainer_model(cfg, state, trainer), ro,
                                                  {c.sample for c in contexts}, cfg.rollout.temperature)
            model = make_engine_model(vcfg, state.backend.model_config, dict(state.backend.named_weights()))
            path = run_engine_path(model, contexts, temperature=cfg.rollout.temperature,
                                   max_seq_len=cfg.rollout.max_context_len, max_batch_size=cfg.rollout.max_batch_size,
                                   schedule=clock_schedule(cfg, ro.sids, ro.gids),
                                   prefix_cache=engine_prefix_cache(cfg),
                                   kv_dtype=vcfg.rollout.kv_dtype)
            out[name] = _compare(path, trainers[trainer])
            out[name]["trainer"] = trainer
            print(f"  same tokens {name:>20} (trainer {trainer}): mean|Δ| {out[name]['mean_abs']:.3g}  "
                  f"max|Δ| {out[name]['max_abs']:.3g}  routing {out[name]['routing_agreement']}", flush=True)
    finally:
        state.close()
    return out


def _compare(path, trainer: dict[int, tuple[np.ndarray, np.ndarray]]) -> dict:
    """Mean/max |engine − trainer| logprob over the contexts' generated tokens, and the share of
    (token, layer) rows predicting them whose expert sets agree."""
    diffs, agree, rows = [], 0, 0
    for c, lp, route in zip(path.contexts, path.logprob, path.routing):  # route: rows from position 0
        t_lp, t_route = trainer[c.sample]
        diffs.append(np.abs(lp[c.start:c.end].astype(np.float64) - t_lp[c.start:c.end]))
        if route is None or t_route is None:
            continue
        for p in range(c.start - 1, min(c.end - 1, len(route))):  # row p predicts token p + 1
            same = np.sort(route[p], -1) == np.sort(t_route[p].astype(route.dtype), -1)
            agree += int(same.all(-1).sum())
            rows += route.shape[1]
    d = np.concatenate(diffs)
    return {"tokens": int(d.size), "mean_abs": float(d.mean()), "max_abs": float(d.max()),
            "routing_agreement": agree / rows if rows else None}


def explain_layers(res: dict) -> list[dict]:
    """Per explained token: its gap, explain's verdict and each component's share of the gap."""
    return [{"sample_id": t["sample_id"], "token": t["token"], "gap": t["gap"], "named": t["named"],
             "r3_gap": t.get("r3_gap"), "shares": {r["name"]: round(r["share"], 3) for r in t["rows"]}}
            for t in res["tokens"]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--parallel", type=int, default=3)
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "bench_fp8")
    ap.add_argument("--reuse", action="store_true", help="keep finished runs in --out")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated training runs (fp32 is needed "
                                                                    "for the same-tokens part, fp8 for explain)")
    ap.add_argument("--set", dest="extra", action="append", default=[], help="an extra override for every run")
    ap.add_argument("--same-step", type=int, default=None, help="the fp32 run's step for the same-tokens part "
                                                                "(default: the last multiple of 5 below --steps; "
                                                                "it must be checkpointed)")
    ap.add_argument("--no-explain", action="store_true", help="skip `axrl-debug explain` on the fp8 run")
    ap.add_argument("--same-workers", type=int, default=1, help="processes for the same-tokens rows")
    ap.add_argument("--same-tokens-only", action="store_true", help="only the same-tokens part, on the fp32 run "
                                                                     "already in --out (printed as JSON)")
    args = ap.parse_args()
    names = args.variants.split(",")
    unknown = sorted(set(names) - set(VARIANTS))
    if unknown or "fp32" not in names:
        raise SystemExit(f"--variants: unknown {unknown} or no fp32 (known: {', '.join(VARIANTS)})")
    if args.same_tokens_only:
        print(json.dumps(same_tokens_parallel(args.out / "fp32", args.same_step, args.same_workers)))
        return
    args.out.mkdir(parents=True, exist_ok=True)
    wall = train_all(args.out, args.steps, args.parallel, args.reuse, names, args.extra)
    runs = {n: run_metrics(args.out / n) for n in names}
    for n, r in runs.items():
        print(f"{n:>18}: mean|Δ| {r['mean_abs']:.3g}  k3 {r['k3']:.3g}  routing {r['routing_agreement']}  "
              f"eval {[round(v, 3) for _, v in r['eval_curve']]}  "
              f"train reward {r['mean_train_reward']:.3f}", flush=True)
    # a checkpointed step (checkpoint.every=5 unless --set): no steps to re-run first
    last = (args.steps - 1) // 5 * 5 if args.same_step is None else args.same_step
    print(f"same tokens (fp32 run, step {last}):", flush=True)
    tokens = same_tokens_parallel(args.out / "fp32", last, args.same_workers)
    explain = (explain_layers(debug_json("explain", str(args.out / "fp8"), "--step", str(last)))
               if "fp8" in names and not args.no_explain else None)
    print(f"explain fp8 step {last}: {explain}", flush=True)
    flat = {f"{k}_{m}_abs_delta": v[f"{m}_abs"] for k, v in tokens.items() for m in ("mean", "max")}
    flat.update({f"{k}_routing_agreement": v["routing_agreement"] for k, v in tokens.items()})
    flat.update({f"{n}_final_eval": r["final_eval"] for n, r in runs.items()})
    order = [tokens[k]["mean_abs"] for k in ("w8a8", "w8a8_end_to_end", "bf16_end_to_end")]
    flat["verl_ordering_holds"] = order[0] > order[1] > order[2]  # FP8 rollout-only > FP8 end-to-end > BF16
    print(f"verl's ordering (mean |Δ|: W8A8 rollout-only {order[0]:.3g} > W8A8 end-to-end {order[1]:.3g} > "
          f"BF16 end-to-end {order[2]:.3g}) holds: {flat['verl_ordering_holds']}", flush=True)
    print(json.dumps({**flat, "steps": args.steps, "variants": names, "extra": args.extra, "wall_s": wall,
                      "runs": runs, "same_tokens_step": last, "same_tokens": tokens, "explain_fp8": explain},
                     default=str))


if __name__ == "__main__":
    main()
