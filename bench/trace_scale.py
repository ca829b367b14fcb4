"""The trace at production scale: recording and analysing one MoE step of a million tokens.

A synthetic step of production shape — at ``--scale 1``: 64 samples × 16 384 tokens (1 M), 48 MoE
layers, top-8 of 128 experts; logprobs drawn like the quickstart's (−Exp(0.6) on generated tokens),
the trainer's within N(0, 0.03) of them, the trainer's routing equal to the engine's on 90 % of
(token, layer) rows — is recorded and analysed, for each routing encoding (``raw``, ``packed``),
side by side in one run, at each of ``--scales``; and, as ``packed_r3``, the same step with the
trainer's routing the engine's (R3: only the rows never fed to the model differ, as stored), packed:

* ``record_critical_path_fraction``: what recording costs the training step — everything the step
  does for it (``in_step_s``: the real ``step_record`` building the record from the trainer's
  tensors, ``build_s``, and the hand-over to the background ``StepWriter``, ``handover_s``: what
  `axrl train`'s ``time_record`` covers) over a modelled 30 s GPU step; beside it, each
  ``--routing-runs`` run's own ``time_record`` over its measured step time — and
  ``writer_keeps_up``: the background write (validate, encode, compress, write, fsync, rename)
  took less than those 30 s;
* ``routing_bytes_per_token_layer``: bytes the routing datasets take on disk / (T · L), rollout
  and trainer together;
* ``routing_bytes_over_entropy`` (``bench/routing_size.py``): for the routing each
  ``--routing-runs`` run recorded from a trained MoE, the engine's routing as ``packed`` stores it
  (bytes per (token, layer)) over its ordered entropy (per layer, the plug-in entropy of the
  ordered top-k tuples, averaged over layers), the worst run's; under ``routing_size`` every run's
  figures (the trainer's routing, bit-packed before compression, a rank + lzma prototype) and the
  synthetic uniform routing beside its own entropy (k · log₂ E, by construction);
* ``analysis_bytes_per_s``, ``analysis_tokens_per_s``: ``axrl-debug mismatch RUN --step N --json``
  step after step in one fresh process (``--steps`` copies of the step), the steady state — the
  median step after the first — in stored bytes and tokens per second; ``analysis_startup_s``,
  the process's one-time start (numba's import and first kernel load, and what the first step
  took beyond the steady ones) apart; ``analysis_over_step``: a steady step's analysis time over
  the modelled 30 s GPU step; ``analysis_peak_rss_gb`` its peak resident memory;
* ``tui_open_s``: the TUI's model of the run showing the step list and opening the step's samples
  screen (``RunModel`` + ``step``), in a fresh process; beside it what follows the first screen:
  ``tui_routing_s`` (the routing column of the 50 rows of a screen, ``fill_routing(rows=…)``),
  ``tui_routing_all_s`` (every other row: the user scrolled through them all),
  ``tui_scan_s`` (the background scan of the step-file metrics, a helper process in the app) and
  the process's peak RSS ``tui_peak_rss_gb``.

    OMP_NUM_THREADS=1 python bench/trace_scale.py --scales 0.25,1 --routing-runs RUN[,RUN…]

Last stdout line: one JSON object with those keys for the largest scale and the packed encoding
(the production preset), plus ``analysis_tokens_per_s_r3`` (``packed_r3``'s), ``side_by_side``
(each key per encoding and scale), ``by_scale`` (every figure, per encoding and scale) and
``scaling`` (each figure at the largest scale over the smallest, with the ratio of token counts
beside it).
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
from dataclasses import replace
from types import SimpleNamespace
from pathlib import Path

import h5py
import numpy as np
import torch

from axrl.runtime.recording.builders import step_record
from axrl.runtime.recording.step_writer import StepWriter
from axrl.runtime.learner import rng_digest
from axrl.trace import RunDir, StepRecord, write_step

sys.path.insert(0, str(Path(__file__).resolve().parent))
import routing_size  # noqa: E402  (bench/routing_size.py)

GPU_STEP_S = 30.0
SAMPLES, SAMPLE_LEN, LAYERS, TOPK, EXPERTS = 64, 16384, 48, 8, 128
PROMPT = 512


def synthetic_step(scale: float, seed: int = 0) -> StepRecord:
    """One step of production shape at ``scale`` (samples × scale, each SAMPLE_LEN tokens)."""
    rng = np.random.default_rng(seed)
    n = max(1, round(SAMPLES * scale))
    length = SAMPLE_LEN if scale >= 1 / SAMPLES else max(PROMPT + 8, round(SAMPLE_LEN * scale * SAMPLES))
    t = n * length
    mask = np.ones(t, np.uint8)
    position = np.arange(t) % length
    mask[position < PROMPT] = 0
    rollout = np.where(mask == 1, -rng.exponential(0.6, t), np.nan).astype(np.float32)
    trainer = np.where(mask == 1, rollout + rng.normal(0, 0.03, t), np.nan).astype(np.float32)
    routing = rng.integers(0, EXPERTS, (t, LAYERS, TOPK), dtype=np.uint8)
    train = routing.copy()
    differs = rng.random((t, LAYERS)) < 0.1
    train[differs] = rng.integers(0, EXPERTS, (int(differs.sum()), TOPK), dtype=np.uint8)
    return StepRecord(
        step=0, policy_version=0, sample_offsets=np.arange(n + 1) * length, sample_id=np.arange(n),
        group_id=np.arange(n) // 8, prompt_id=[f"p{i // 8}" for i in range(n)], prompt_len=np.full(n, PROMPT),
        num_turns=np.ones(n, np.int32), reward=rng.random(n), finish_reason=["stop"] * n, status=["ok"] * n,
        token_ids=rng.integers(0, 150_000, t), loss_mask=mask, turn=(mask == 1).astype(np.int16),
        token_policy_version=np.where(mask == 1, 0, -1), rollout_logprob=rollout, old_logprob=trainer,
        advantage=np.where(mask == 1, rng.normal(0, 1, t), 0).astype(np.float32),
        entropy=np.where(mask == 1, rng.random(t), np.nan).astype(np.float32),
        update_sample_offsets=[0, n], update_samples=np.arange(n), update_metrics={"loss": [0.1], "grad_norm": [1.0], "lr": [1e-6]},
        weights_fingerprint_before="0" * 64, weights_fingerprint_after="1" * 64,
        num_experts=EXPERTS, routing_rollout=routing, routing_train=train,
        routing_rollout_valid=(position != length - 1).astype(np.uint8))


def trained_step(rec: StepRecord, updates: int = 2) -> SimpleNamespace:
    """What the learner holds after training the step ``rec`` records — torch tensors for the
    batch and the trainer's forward (routing as int64, as the batch processor concatenates it),
    per-trajectory arrays, ``updates`` updates with per-token loss columns — duck-typed as a
    ``TrainedStep`` so that the real ``step_record`` builds the record from it."""
    off = np.asarray(rec.sample_offsets)
    n = off.size - 1
    per = [slice(int(off[i]), int(off[i + 1])) for i in range(n)]
    turn, version = np.asarray(rec.turn), np.asarray(rec.token_policy_version)
    trajs = [SimpleNamespace(sample_id=i, group_id=i // 8, prompt_id=rec.prompt_id[i], prompt_len=int(rec.prompt_len[i]),
                             num_turns=1, reward=float(rec.reward[i]), finish_reason="stop", status="ok", error="",
                             turn=turn[s], policy_version=version[s], continuations=0, num_tokens=s.stop - s.start,
                             session_id="", drift_tokens=0, info={}) for i, s in enumerate(per)]
    t = torch.from_numpy
    batch = SimpleNamespace(offsets=t(off.astype(np.int64)), input_ids=t(np.asarray(rec.token_ids, np.int64)),
                            loss_mask=t(np.asarray(rec.loss_mask, np.float32)), num_tokens=int(off[-1]),
                            rollout_logprobs=t(rec.rollout_logprob), advantages=t(rec.advantage), ref_logprobs=None,
                            routed_experts=t(rec.routing_rollout))
    # (the learner's routing tensors are int64; ``step_record`` hands them over as views either way,
    # and the writer thread casts them: uint8 here keeps the 1 M-token step in memory)
    old = SimpleNamespace(logprobs=t(rec.old_logprob), entropy=t(rec.entropy), routed_experts=t(rec.routing_train))
    share = np.array_split(np.arange(n), updates)
    ups = []
    for rows in share:
        m = int(sum(off[i + 1] - off[i] for i in rows))
        tokens = {"is_weight": torch.ones(m), "loss_rule": torch.zeros(m, dtype=torch.int64)}
        ups.append(SimpleNamespace(samples=[int(i) for i in rows], fingerprint="2" * 64,
                                   metrics=SimpleNamespace(loss=0.1, metrics={"clipfrac": 0.0}, tokens=tokens,
                                                           micro_batches=[{"loss": 0.1, "num_tokens": m}]),
                                   stats=SimpleNamespace(grad_norm=1.0, lr=1e-6, param_grad_norm={})))
    processed = SimpleNamespace(trajectories=trajs, batch=batch, sample_advantages=torch.zeros(n), penalties=None,
                                dropped=[], turn_rewards=None, values=None, returns=None, teacher_logprobs=None)
    return SimpleNamespace(step=0, policy_version=0, batch=SimpleNamespace(dropped=[], reruns=[]), processed=processed,
                           old=old, updates=ups, fingerprint_before="0" * 64, fingerprint_after="1" * 64,
                           behaviour=None, wall_times={}, num_experts=EXPERTS, marks={}, critic=None)


def record(rec: StepRecord, run: Path, encoding: str, steps: int = 1) -> dict[str, float]:
    """Record the step as the learner does and time what the training step pays for it: building
    the record from the trainer's tensors (``step_record``: tensor hand-over, the per-trajectory
    columns concatenated, the per-token loss columns filled, the RNG digest) and handing it to the
    background ``StepWriter`` — the learner's ``time_record`` — then the background write; the
    same record is written as ``steps`` steps (the analysis's steady state is timed over them)."""
    rd = RunDir(run)
    rd.write_manifest(seed=0, backend="synthetic", engine="synthetic", threads=1, command=["bench"])
    rd.write_config({"algo": {"loss_agg": "token-mean"}})
    o = trained_step(rec)
    writer = StepWriter(lambda r: rd.write_step(r, routing_encoding=encoding), max_pending=2)
    t0 = time.perf_counter()
    built = step_record(o, rng_digest())
    t1 = time.perf_counter()
    writer.submit(built)
    t2 = time.perf_counter()
    writer.close()
    written = time.perf_counter() - t1
    later = StepWriter(lambda r: rd.write_step(r, routing_encoding=encoding), max_pending=2)
    for i in range(1, steps):
        later.submit(replace(built, step=i))
    later.close()
    rd.append_metrics({"step": 0, "reward": 0.5})
    with h5py.File(run / "trace" / "step_000000.h5", "r") as f:
        routing = sum(ds.id.get_storage_size() for ds in f["/routing"].values() if ds.name != "/routing/rollout_valid")
    return {"build_s": t1 - t0, "handover_s": t2 - t1, "in_step_s": t2 - t0, "write_s": written,
            "record_critical_path_fraction": (t2 - t0) / GPU_STEP_S, "writer_keeps_up": written < GPU_STEP_S,
            "routing_bytes_per_token_layer": routing / (rec.num_tokens * LAYERS)}


_CHILD = r"""
import json, resource, sys, time
from pathlib import Path
from typer.testing import CliRunner
run, what = sys.argv[1], sys.argv[2]
from axrl_debug.cli import app
from axrl_debug.tui.data import RunModel
out = {"startup_s": 0.0}
if what == "mismatch":
    from axrl_debug.analysis.mismatch import MismatchConfig, resolve_compiled
    if resolve_compiled(MismatchConfig(), sorted(Path(run, "trace").glob("step_*.h5"))).compiled:
        # the process's one-time start of the compiled path — importing numba and its first kernel
        # load — timed apart (and added back below): the analysis would pay it inside the call
        t1 = time.perf_counter()
        import numpy as np
        from axrl.trace import checksum
        checksum.fletcher32(np.zeros(8, np.uint8))
        out["startup_s"] = time.perf_counter() - t1
t0 = time.perf_counter()                       # imports excluded: the analysis itself
if what == "mismatch":
    # step after step in one process, as `axrl-debug mismatch` goes through a run: the first call
    # pays the process's start (numba's kernels), the later ones are the steady state
    out["per_step_s"] = []
    for path in sorted(Path(run, "trace").glob("step_*.h5")):
        t1 = time.perf_counter()
        r = CliRunner().invoke(app, ["mismatch", run, "--step", str(int(path.stem.split("_")[1])), "--json"])
        assert r.exit_code == 0, r.output
        out["per_step_s"].append(time.perf_counter() - t1)
        out["tokens"] = json.loads(r.stdout)["tokens"]
else:
    m = RunModel(run)                          # the step list: metrics.jsonl and the file listing
    out["list_s"] = time.perf_counter() - t0
    step = m.step(m.steps[0])                  # the samples screen of the step
    out["open_s"] = time.perf_counter() - t0 - out["list_s"]
    t1 = time.perf_counter()
    step.fill_routing(rows=range(50))          # after the first screen: the routing column of its rows
    out["routing_s"] = time.perf_counter() - t1
    t1 = time.perf_counter()
    step.fill_routing()                        # every other row (the user scrolled through them all)
    out["routing_all_s"] = time.perf_counter() - t1
    t1 = time.perf_counter()
    m.scan(m.steps[:1])                        # the background scan (a helper process in the app)
    out["scan_s"] = time.perf_counter() - t1
    out["tokens"] = int(step.generated.sum())
out["s"] = time.perf_counter() - t0 + out["startup_s"]
# the peak RSS of this process's own memory (VmHWM): ru_maxrss would carry the parent's peak over
# the fork + exec that started it, and the parent holds the synthetic step
hwm = [line for line in open("/proc/self/status") if line.startswith("VmHWM:")]
out["rss_gb"] = (int(hwm[0].split()[1]) if hwm else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) / 2 ** 20
print(json.dumps(out))
"""


def child(run: Path, what: str) -> dict[str, float]:
    """``what`` (mismatch | tui) on ``run`` in a fresh process: its seconds and peak RSS."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", _CHILD, str(run), what], check=True, capture_output=True,
                         text=True, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


def measure(scale: float, encoding: str, rec: StepRecord, root: Path, steps: int) -> dict[str, float]:
    """Record ``rec`` as ``steps`` steps of a run with ``encoding``; analyse it and open it in the TUI."""
    run = root / f"{encoding}_{scale}"
    shutil.rmtree(run, ignore_errors=True)
    if encoding == "packed_r3":                # R3: the trainer routes as the engine did
        rec = replace(rec, routing_train=rec.routing_rollout)
    row = {"scale": scale, "encoding": encoding, "tokens": rec.num_tokens,
           **record(rec, run, encoding.removesuffix("_r3"), steps)}
    file_bytes = (run / "trace" / "step_000000.h5").stat().st_size
    mismatch, tui = child(run, "mismatch"), child(run, "tui")
    per_step = mismatch["per_step_s"]
    steady = float(np.median(per_step[1:])) if len(per_step) > 1 else per_step[0]
    startup = mismatch["startup_s"] + max(0.0, per_step[0] - steady)     # the process's one-time start
    ids = rec.num_tokens * LAYERS * TOPK * 2
    row.update(analysis_s=steady, analysis_first_step_s=mismatch["startup_s"] + per_step[0],
               analysis_per_step_s=per_step, analysis_startup_s=startup,
               analysis_tokens_per_s=rec.num_tokens / steady, analysis_bytes_per_s=file_bytes / steady,
               analysis_over_step=steady / GPU_STEP_S, step_file_bytes=file_bytes,
               analysis_routing_ids_per_s=ids / steady, analysis_peak_rss_gb=mismatch["rss_gb"],
               tui_open_s=tui["list_s"] + tui["open_s"], tui_list_s=tui["list_s"], tui_step_s=tui["open_s"],
               tui_routing_s=tui["routing_s"], tui_routing_all_s=tui["routing_all_s"], tui_scan_s=tui["scan_s"],
               tui_peak_rss_gb=tui["rss_gb"])
    shutil.rmtree(run, ignore_errors=True)
    return row


def routing_sizes(runs: list[str], uniform: StepRecord) -> dict[str, dict]:
    """Stored routing bytes per (token, layer) over the routing's ordered entropy
    (``bench/routing_size.py``): each trained run's recorded routing, and the synthetic uniform
    routing beside its entropy by construction (k · log₂ E: ids drawn independently, repeats
    allowed)."""
    out = {}
    for run in runs:
        got = routing_size.from_run(run)
        stored = routing_size.stored_bytes(run, "packed")
        row = routing_size.measure(got["rollout"], got["train"], got["valid"], got["num_experts"], sizes=stored)
        unpacked = routing_size.packed_bytes(got["rollout"], got["train"], got["num_experts"])
        cells = row["tokens"] * row["layers"]
        row.update(steps=got["steps"], bitpacked_bytes_per_token_layer=unpacked["rollout"] / cells,
                   bitpacked_over_entropy=unpacked["rollout"] / cells / row["entropy_bytes_per_token_layer"],
                   raw_stored_bytes_per_token_layer=routing_size.stored_bytes(run, "raw")["rollout"] / cells,
                   prototype_bytes=routing_size.rank_coded_bytes(got["rollout"]))
        row["prototype_lzma_over_entropy"] = (row["prototype_bytes"]["lzma"] + row["prototype_bytes"]["dictionary"]) \
            / cells / row["entropy_bytes_per_token_layer"]
        row["record_critical_path_fraction"] = recorded_fraction(run)
        out[Path(run).name] = row
        print(f"routing {Path(run).name}: T={row['tokens']} L={row['layers']} top-{row['k']} of {row['num_experts']}  "
              f"entropy {row['ordered_entropy_bits']:.3f} bit ({row['distinct_tuples']} distinct tuples, "
              f"{row['rows_per_layer']} rows/layer)  stored packed {row['rollout_bytes_per_token_layer']:.3f} B → "
              f"{row['routing_bytes_over_entropy']:.3f}× entropy (bit-packed before gzip "
              f"{row['bitpacked_over_entropy']:.2f}×, raw {row['raw_stored_bytes_per_token_layer']:.1f} B)  with the "
              f"trainer's {row['pair_bytes_over_entropy']:.3f}×  rank+lzma prototype "
              f"{row['prototype_lzma_over_entropy']:.3f}×", flush=True)
    bits = TOPK * math.log2(EXPERTS)
    with tempfile.TemporaryDirectory() as tmp:
        with h5py.File(write_step(tmp, uniform, routing_encoding="packed"), "r") as f:
            stored = {"rollout": f["/routing/rollout_packed"].id.get_storage_size(),
                      "train": sum(f[n].id.get_storage_size() for n in ("/routing/train_differs", "/routing/train_rows"))}
    row = routing_size.measure(uniform.routing_rollout, uniform.routing_train, None, EXPERTS, entropy_bits=bits,
                               sizes=stored)
    out["uniform"] = {k: v for k, v in row.items() if k not in ("train_given_rollout_bits", "pair_bytes_over_entropy")}
    print(f"routing uniform (synthetic, T={row['tokens']}): entropy {bits:.1f} bit by construction  stored packed "
          f"{row['rollout_bytes_per_token_layer']:.3f} B → {row['routing_bytes_over_entropy']:.3f}× entropy", flush=True)
    return out


def recorded_fraction(run: str) -> dict[str, float]:
    """What recording cost a real run's steps, as the learner measured it (metrics.jsonl's
    ``time_record``: building the record + the hand-over) over the step's wall time, per step."""
    rows = [json.loads(line) for line in Path(run, "metrics.jsonl").read_text().splitlines() if line.strip()]
    rows = [r for r in rows if "time_record" in r and r.get("step_time")]
    return {f"step_{r['step']}": r["time_record"] / r["step_time"] for r in rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scales", default="0.25,1", help="comma-separated fractions of the 1 M-token step")
    ap.add_argument("--encodings", default="raw,packed,packed_r3")
    ap.add_argument("--dir", default=None, help="where the runs are written (default: a temp dir)")
    ap.add_argument("--steps", type=int, default=3, help="steps of each run (the analysis's steady state is over "
                    "the steps after the first)")
    ap.add_argument("--routing-runs", default="", help="comma-separated `axrl train` run dirs of trained MoE "
                    "models: their recorded routing is measured against its entropy (routing_bytes_over_entropy)")
    args = ap.parse_args()
    scales = sorted(float(s) for s in args.scales.split(","))
    encodings = args.encodings.split(",")
    root = Path(args.dir or tempfile.mkdtemp(prefix="trace_scale_"))
    # the uniform routing's size per (token, layer) does not depend on the step's length: a 1/16 step
    sizes = routing_sizes([r for r in args.routing_runs.split(",") if r], synthetic_step(min(min(scales), 1 / 16)))
    rows = []
    for scale in scales:
        rec = synthetic_step(scale)
        for encoding in encodings:
            row = measure(scale, encoding, rec, root, args.steps)
            rows.append(row)
            print(f"scale {scale:<5} {encoding:<9} T={row['tokens']:>8}  in step {row['in_step_s'] * 1e3:7.1f} ms "
                  f"(build {row['build_s'] * 1e3:6.1f}, hand-over {row['handover_s'] * 1e3:5.2f})  write "
                  f"{row['write_s']:6.2f} s  routing {row['routing_bytes_per_token_layer']:5.2f} B/(token·layer)  "
                  f"mismatch {row['analysis_s']:5.2f} s/step steady = {row['analysis_tokens_per_s'] / 1e6:5.2f} M tok/s, "
                  f"{row['analysis_bytes_per_s'] / 1e6:6.0f} MB/s (first step {row['analysis_first_step_s']:4.2f} s, "
                  f"start {row['analysis_startup_s']:4.2f} s), {row['analysis_peak_rss_gb']:4.2f} GB  tui "
                  f"{row['tui_open_s']:5.2f} s (then routing on screen {row['tui_routing_s']:5.2f} s, all "
                  f"{row['tui_routing_all_s']:5.2f} s, scan {row['tui_scan_s']:5.2f} s, {row['tui_peak_rss_gb']:4.2f} GB)",
                  flush=True)
        del rec
    keys = ("record_critical_path_fraction", "in_step_s", "build_s", "handover_s", "writer_keeps_up",
            "routing_bytes_per_token_layer", "analysis_bytes_per_s", "analysis_tokens_per_s", "analysis_over_step",
            "analysis_s", "analysis_startup_s", "analysis_first_step_s", "analysis_routing_ids_per_s",
            "analysis_peak_rss_gb", "tui_open_s", "tui_routing_s", "tui_routing_all_s")
    main_enc = "packed" if "packed" in encodings else encodings[0]
    top = next(r for r in rows if r["scale"] == scales[-1] and r["encoding"] == main_enc)
    low = next(r for r in rows if r["scale"] == scales[0] and r["encoding"] == main_enc)
    scaling = {k: (top[k] / low[k] if isinstance(top[k], float) and low[k] else None)
               for k in ("write_s", "analysis_s", "analysis_peak_rss_gb", "tui_open_s", "tui_peak_rss_gb")}
    scaling["tokens"] = top["tokens"] / low["tokens"]
    # every key at each scale, side by side, per encoding: {key: {encoding: {scale: value}}}
    side = {k: {e: {str(r["scale"]): r[k] for r in rows if r["encoding"] == e} for e in encodings}
            for k in (*keys, "tui_scan_s", "tui_peak_rss_gb")}
    trained = [v["routing_bytes_over_entropy"] for k, v in sizes.items() if k != "uniform"]
    trained_ratio = max(trained) if trained else None    # the worst of the trained models
    r3 = next((r for r in rows if r["scale"] == scales[-1] and r["encoding"] == "packed_r3"), None)
    summary = {"encoding": main_enc, "scale": scales[-1], "tokens": top["tokens"], "gpu_step_s": GPU_STEP_S,
               **{k: top[k] for k in keys}, "analysis_tokens_per_s_r3": r3 and r3["analysis_tokens_per_s"],
               "routing_bytes_over_entropy": trained_ratio, "routing_size": sizes,
               "scaling": scaling, "side_by_side": side, "by_scale": rows}
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
