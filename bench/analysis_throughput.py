"""How fast does `axrl-debug mismatch` answer over a large trace, versus per-step pickled dumps?

Builds, in one temporary directory and from one random seed:

* an AxRL run (the real writer: `RunDir.write_step` with its default layout — the columns the
  analysis reads stored raw, the rest gzip-1 + shuffle, everything fletcher32-checksummed) with at
  least `--tokens` generated tokens (default 10 M) over `--steps` steps: multi-turn samples with a tool
  segment, NaN rollout logprobs outside generated tokens, partial-rollout policy versions, and MoE
  routing [T, 4, 2] uint8 for rollout and trainer;
* the same data the way slime/miles dump debug rollouts: per step, `torch.save` of a list of
  per-sample dicts whose token ids, masks and logprobs are Python lists (routing as a uint8
  tensor per sample, which favours the pickle side).

Then it times the same headline answer from each (best of `--repeat`):

* HDF5: exactly what `axrl-debug mismatch RUN` computes — |Δ| stats and percentiles, k1/k2/k3,
  χ², ratio stats, clip/TIS fractions, ESS, Pearson, every breakdown, per-layer routing agreement
  and the top-10 tokens with decoded context — starting from a fresh `TraceReader` (which also
  validates every step file), with `--workers` processes (default auto, as `mismatch` does) and
  with one. Each answer runs in a new Python process, as a CLI call does; its imports and the
  one-time load of the compiled kernels are timed apart and reported as the per-process start cost;
* pickle: `torch.load` every step file, rebuild the flat arrays from the per-sample lists, and run
  the *same* vectorised analysis (so the difference is storage and loading, not the math).

The two answers are checked to agree. Prints a table, then one line of JSON:
{"mismatch_tokens_per_s", "hdf5_vs_pickle_time_ratio" (= t_hdf5 / t_pickle), "hdf5_speedup_vs_pickle"
(= t_pickle / t_hdf5), "hdf5_vs_pickle_bytes_ratio" (= HDF5 bytes / pickle bytes), ...}.
Targets: >= 20 M generated tokens/s for mismatch; HDF5 >= 3x faster than the pickled dumps.

    python bench/analysis_throughput.py                  # 10 M generated tokens, a few minutes
    python bench/analysis_throughput.py --tokens 1e6     # quick
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

LAYERS, TOPK, EXPERTS = 4, 2, 8
PROMPT_LEN = 64
TOOL_LEN = 16


def make_step(step: int, n: int, mean_resp: int, rng: np.random.Generator) -> dict:
    """One synthetic step as flat CSR arrays (vectorised; no per-token Python)."""
    resp = rng.integers(mean_resp // 2, mean_resp * 3 // 2, n)
    tool = (rng.random(n) < 0.5) & (resp > 2 * TOOL_LEN)              # half the samples call a tool
    lengths = PROMPT_LEN + resp
    off = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    t = int(off[-1])
    sample_of = np.repeat(np.arange(n), lengths)
    pos = np.arange(t) - off[:-1][sample_of]                            # position in the sample
    in_resp = pos >= PROMPT_LEN
    mid = PROMPT_LEN + resp // 2
    in_tool = tool[sample_of] & (pos >= mid[sample_of]) & (pos < mid[sample_of] + TOOL_LEN)
    loss_mask = (in_resp & ~in_tool).astype(np.uint8)
    turn = np.where(in_resp, 1, 0) + (tool[sample_of] & (pos >= mid[sample_of] + TOOL_LEN))
    gen = loss_mask == 1
    stale = rng.random(n) < 0.1                                          # partial rollouts: one version older
    pver = np.where(gen, step - stale[sample_of].astype(np.int64), -1).astype(np.int32)
    rollout_lp = np.where(gen, -rng.exponential(0.8, t), np.nan).astype(np.float32)
    noise = rng.normal(0.0, 1e-3, t) * (1 + 20 * (rng.random(t) < 0.01))
    first = gen & ~np.r_[False, gen[:-1]]                               # first token of each response segment
    noise[first] *= 5
    old_lp = np.where(gen, rollout_lp + noise, rng.normal(-3, 1, t)).astype(np.float32)
    entropy = rng.gamma(2.0, 0.5, t).astype(np.float16)
    ids = rng.integers(0, 1000, t).astype(np.int32)
    e0 = rng.integers(0, EXPERTS, (t, LAYERS))
    e1 = (e0 + 1 + rng.integers(0, EXPERTS - 1, (t, LAYERS))) % EXPERTS
    r_roll = np.stack([e0, e1], axis=2).astype(np.uint8)
    r_train = r_roll.copy()
    flip = rng.random((t, LAYERS)) < 0.02                               # 2% of rows route differently
    r_train[flip, 1] = (r_train[flip, 0] + 1 + rng.integers(0, EXPERTS - 1, int(flip.sum()))) % EXPERTS
    r_train[flip & (r_train[:, :, 1] == r_train[:, :, 0]), 1] ^= 1  # keep the two experts distinct
    valid = np.ones(t, np.uint8)
    valid[off[1:] - 1] = 0
    r_roll[valid == 0] = 0
    reward = rng.random(n)
    adv = np.repeat((reward - reward.mean()).astype(np.float32), lengths)
    return dict(off=off, ids=ids, loss_mask=loss_mask, turn=turn.astype(np.int16), pver=pver,
                rollout_lp=rollout_lp, old_lp=old_lp, adv=adv, entropy=entropy, r_roll=r_roll,
                r_train=r_train, valid=valid, reward=reward, n=n)


def hdf5_record(step: int, d: dict):
    """The StepRecord of one synthetic step (2 updates, routing for rollout and trainer)."""
    from axrl.trace import StepRecord

    n = d["n"]
    return StepRecord(
        step=step, policy_version=step, sample_offsets=d["off"], sample_id=np.arange(n) + step * n,
        group_id=np.arange(n) // 8, prompt_id=[f"bench/{i}" for i in range(n)],
        prompt_len=np.full(n, PROMPT_LEN), num_turns=np.ones(n, np.int32), reward=d["reward"],
        finish_reason=["stop"] * n, status=["ok"] * n, token_ids=d["ids"], loss_mask=d["loss_mask"],
        turn=d["turn"], token_policy_version=d["pver"], rollout_logprob=d["rollout_lp"],
        old_logprob=d["old_lp"], advantage=d["adv"], entropy=d["entropy"],
        update_sample_offsets=[0, n // 2, n], update_samples=np.arange(n),
        update_metrics={"loss": [0.1, 0.2], "grad_norm": [1.0, 1.1], "lr": [1e-5, 1e-5]},
        weights_fingerprint_before="a", weights_fingerprint_after="b", num_experts=EXPERTS,
        routing_rollout=d["r_roll"], routing_rollout_valid=d["valid"], routing_train=d["r_train"])


def write_hdf5(run_dir: Path, step: int, d: dict) -> None:
    from axrl.trace import RunDir

    RunDir(run_dir).write_step(hdf5_record(step, d))


def write_pickle(path: Path, step: int, d: dict) -> None:
    """slime-style debug dump: {"rollout_id", "samples": [per-sample dict with Python lists]}."""
    import torch

    off = d["off"]
    samples = []
    for i in range(d["n"]):
        a, b = int(off[i]), int(off[i + 1])
        samples.append({
            "index": i, "tokens": d["ids"][a:b].tolist(), "response_length": b - a - PROMPT_LEN,
            "reward": float(d["reward"][i]), "status": "completed",
            "loss_mask": d["loss_mask"][a + PROMPT_LEN:b].tolist(),
            "rollout_log_probs": d["rollout_lp"][a + PROMPT_LEN:b].tolist(),
            "log_probs": d["old_lp"][a + PROMPT_LEN:b].tolist(),
            "turn": d["turn"][a:b].tolist(), "policy_version": d["pver"][a:b].tolist(),
            "entropy": d["entropy"][a + PROMPT_LEN:b].astype(np.float32).tolist(),
            "rollout_routed_experts": torch.from_numpy(d["r_roll"][a:b].copy()),
            "train_routed_experts": torch.from_numpy(d["r_train"][a:b].copy()),
            "policy_version_step": step,
        })
    torch.save({"rollout_id": step, "samples": samples}, path)


def answer_from_pickles(paths: list[Path], cfg) -> dict:
    """Load every dump and run the same vectorised analysis on arrays rebuilt from the lists."""
    import torch

    from axrl_debug.analysis.mismatch import MismatchAccumulator

    acc = MismatchAccumulator(cfg)
    for p in paths:
        dump = torch.load(p, weights_only=False)
        samples = dump["samples"]
        lens = np.array([len(s["tokens"]) for s in samples])
        off = np.concatenate([[0], np.cumsum(lens)])
        t = int(off[-1])
        lm = np.zeros(t, np.uint8)
        lr = np.full(t, np.nan, np.float32)
        lo = np.full(t, np.nan, np.float32)
        ent = np.zeros(t, np.float16)
        for s, a in zip(samples, off[:-1]):
            r = a + len(s["tokens"]) - s["response_length"]
            b = a + len(s["tokens"])
            lm[r:b] = s["loss_mask"]
            lr[r:b] = s["rollout_log_probs"]
            lo[r:b] = s["log_probs"]
            ent[r:b] = s["entropy"]
        cols = {
            "/samples/offsets": off, "/tokens/loss_mask": lm, "/tokens/rollout_logprob": lr,
            "/tokens/old_logprob": lo, "/tokens/entropy": ent,
            "/tokens/turn": np.concatenate([np.asarray(s["turn"], np.int16) for s in samples]),
            "/tokens/policy_version": np.concatenate([np.asarray(s["policy_version"], np.int32) for s in samples]),
            "/routing/rollout": torch.cat([s["rollout_routed_experts"] for s in samples]).numpy(),
            "/routing/train": torch.cat([s["train_routed_experts"] for s in samples]).numpy(),
        }
        valid = np.ones(t, np.uint8)
        valid[off[1:] - 1] = 0
        cols["/routing/rollout_valid"] = valid
        acc.add_columns(int(dump["rollout_id"]), int(samples[0]["policy_version_step"]), cols)
    return acc.result()


def dir_bytes(paths) -> int:
    return sum(p.stat().st_size for p in paths)


def time_fresh(run_dir: Path, workers: int, compiled: bool = True) -> dict:
    """Time one `mismatch` answer in a new Python process, as `axrl-debug mismatch` runs: imports
    and the compiled kernels' one-time load are done first and timed apart; then a fresh
    `TraceReader` (scan and validation included) and the full report with decoded context.
    (Timing repeated answers inside one long-lived process would charge the workers for
    copy-on-write faults on the heap earlier answers left behind, which a CLI call never has.)"""
    code = (
        "import json, sys, time\n"
        f"sys.path.insert(0, {str(Path(__file__).resolve().parents[1])!r})\n"
        "t0 = time.perf_counter()\n"
        "from axrl.trace import TraceReader\n"
        "from axrl_debug.analysis.mismatch import MismatchConfig, _load_kernels, mismatch_report\n"
        f"cfg = MismatchConfig(clip_low=0.2, clip_high=0.28, tis_cap=2.0, top_k=10, compiled={compiled})\n"
        f"run = {str(run_dir)!r}\n"
        "t1 = time.perf_counter()\n"
        f"r = TraceReader(run); {compiled} and _load_kernels(r, r.steps[0], cfg)\n"
        "t2 = time.perf_counter()\n"
        "r = TraceReader(run)\n"
        f"res, _ = mismatch_report(r, r.steps, cfg, workers={workers})\n"
        "t3 = time.perf_counter()\n"
        "assert not r.problems, r.problems\n"
        "print(json.dumps({'imports': t1 - t0, 'kernels': t2 - t1, 'answer': t3 - t2, 'metrics': res['metrics'],\n"
        "                  'agreement': res['routing']['agreement']}))\n")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=float, default=10e6, help="generated tokens in the trace (default 1e7)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--mean-response", type=int, default=1000, help="mean response tokens per sample")
    ap.add_argument("--repeat", type=int, default=3, help="timed repetitions per side (best is reported)")
    ap.add_argument("--keep", type=Path, default=None, help="build in this directory and keep it")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workers", type=int, default=0,
                    help="processes for the HDF5 side (0 = auto: one per usable CPU, as `mismatch` does)")
    args = ap.parse_args(argv)

    import torch  # noqa: F401  (import cost outside the timings)

    from axrl.trace import RunDir
    from axrl_debug.analysis.mismatch import MismatchConfig

    root = args.keep or Path(tempfile.mkdtemp(prefix="axrl-bench-analysis-"))
    run_dir, pkl_dir = root / "run", root / "pickle"
    pkl_dir.mkdir(parents=True, exist_ok=True)
    rd = RunDir(run_dir)
    rd.write_manifest(seed=args.seed, backend="bench", engine="bench", command=sys.argv)
    rd.write_config({"algo": {"clip_low": 0.2, "clip_high": 0.28, "tis": True, "tis_cap": 2.0}})
    # generated tokens per sample ≈ mean_response − (tool segments: 0.5·16)
    per_step = args.tokens / args.steps
    n = max(1, int(math.ceil(per_step / (args.mean_response - 0.5 * TOOL_LEN))))
    rng = np.random.default_rng(args.seed)
    gen_total = tok_total = 0
    t_build = time.perf_counter()
    pkl_paths = []
    for s in range(args.steps):
        d = make_step(s, n, args.mean_response, rng)
        gen_total += int(d["loss_mask"].sum())
        tok_total += int(d["off"][-1])
        write_hdf5(run_dir, s, d)
        p = pkl_dir / f"rollout_{s}.pt"
        write_pickle(p, s, d)
        pkl_paths.append(p)
        print(f"  built step {s}: {int(d['off'][-1])} tokens", file=sys.stderr, flush=True)
    t_build = time.perf_counter() - t_build

    cfg = MismatchConfig(clip_low=0.2, clip_high=0.28, tis_cap=2.0, top_k=10)
    workers = args.workers
    runs_h = [time_fresh(run_dir, workers) for _ in range(max(1, args.repeat))]
    runs_1 = [time_fresh(run_dir, 1) for _ in range(max(1, args.repeat))]   # the per-core rate
    runs_np = [time_fresh(run_dir, workers, compiled=False) for _ in range(max(1, args.repeat))]
    times_h, t1 = [r["answer"] for r in runs_h], [r["answer"] for r in runs_1]
    # The numpy path (chosen for small traces) skips the kernels' load; from how many tokens on do
    # the compiled kernels answer sooner, start-up included?
    t_np = min(r["answer"] for r in runs_np)
    start_c = min(r["imports"] + r["kernels"] for r in runs_h)
    start_np = min(r["imports"] + r["kernels"] for r in runs_np)
    per_token_gain = t_np / gen_total - min(times_h) / gen_total
    break_even = (start_c - start_np) / per_token_gain if per_token_gain > 0 else math.inf
    res_h = {"metrics": runs_h[0]["metrics"], "routing": {"agreement": runs_h[0]["agreement"]}}
    times_p = []
    res_p = None
    for _ in range(max(1, min(args.repeat, 2))):      # the slow side: at most twice
        t0 = time.perf_counter()
        res_p = answer_from_pickles(pkl_paths, cfg)
        times_p.append(time.perf_counter() - t0)

    # same answer from both storages (the math is shared; this checks the data round trip)
    for key in ("mean_abs", "max_abs", "p99_abs", "k3", "chi2", "ess", "pearson_prob"):
        a, b = res_h["metrics"][key], res_p["metrics"][key]
        assert math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-15), (key, a, b)
    assert math.isclose(res_h["routing"]["agreement"], res_p["routing"]["agreement"], rel_tol=1e-12)

    th, tp = min(times_h), min(times_p)
    bh = dir_bytes(sorted((run_dir / "trace").glob("step_*.h5")))
    bp = dir_bytes(pkl_paths)
    rows = [
        ("steps", f"{args.steps}", ""),
        ("tokens (all / generated)", f"{tok_total:,} / {gen_total:,}", ""),
        ("build time", f"{t_build:.1f} s", "both formats"),
        ("HDF5 mismatch time", f"{th:.2f} s", f"best of {len(times_h)}: {', '.join(f'{x:.2f}' for x in times_h)}"
                                               f" (workers: {workers or 'auto'})"),
        ("HDF5 generated tokens/s", f"{gen_total / th / 1e6:.1f} M", "target >= 20 M"),
        ("  same, 1 process", f"{gen_total / min(t1) / 1e6:.1f} M", f"best of {len(t1)}: {min(t1):.2f} s"),
        ("HDF5 all tokens/s", f"{tok_total / th / 1e6:.1f} M", ""),
        ("  one-time cost per process", f"{min(r['imports'] for r in runs_h):.2f} s + "
                                        f"{min(r['kernels'] for r in runs_h):.2f} s", "imports + compiled kernels' load"),
        ("numpy path generated tokens/s", f"{gen_total / t_np / 1e6:.1f} M",
         f"best of {len(runs_np)}: {t_np:.2f} s; start-up {start_np:.2f} s (no numba)"),
        ("compiled path pays off from", f"{break_even / 1e6:.1f} M tokens", "generated tokens per call, start-up included"),
        ("pickle time to same answer", f"{tp:.2f} s", f"best of {len(times_p)}: {', '.join(f'{x:.2f}' for x in times_p)}"),
        ("HDF5 speed-up vs pickle", f"{tp / th:.1f}x", "target >= 3x"),
        ("bytes on disk HDF5 / pickle", f"{bh / 1e6:.0f} MB / {bp / 1e6:.0f} MB", f"ratio {bh / bp:.2f}"),
        ("mean |Δ|, k3, routing agreement", f"{res_h['metrics']['mean_abs']:.4g}, {res_h['metrics']['k3']:.3g}, "
                                           f"{res_h['routing']['agreement']:.4f}", "identical from both"),
    ]
    w = max(len(r[0]) for r in rows)
    print(f"analysis throughput ({os.cpu_count()} CPUs, files in page cache)")
    for name, val, note in rows:
        print(f"  {name:<{w}}  {val:>22}  {note}")
    if args.keep is None:
        shutil.rmtree(root, ignore_errors=True)
    print(json.dumps({
        "mismatch_tokens_per_s": round(gen_total / th),
        "mismatch_all_tokens_per_s": round(tok_total / th),
        "mismatch_tokens_per_s_1_process": round(gen_total / min(t1)),
        "hdf5_vs_pickle_time_ratio": round(th / tp, 4),
        "hdf5_speedup_vs_pickle": round(tp / th, 2),
        "hdf5_vs_pickle_bytes_ratio": round(bh / bp, 4),
        "generated_tokens": gen_total,
        "process_start_s": round(start_c, 3),
        "numpy_path_tokens_per_s": round(gen_total / t_np),
        "numpy_path_process_start_s": round(start_np, 3),
        "compiled_break_even_generated_tokens": round(break_even),
    }))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
