"""The trace at production scale: recording and analysing one MoE step of a million tokens.

A synthetic step of production shape — at ``--scale 1``: 64 samples × 16 384 tokens (1 M), 48 MoE
layers, top-8 of 128 experts; logprobs drawn like the quickstart's (−Exp(0.6) on generated tokens),
the trainer's within N(0, 0.03) of them, the trainer's routing equal to the engine's on 90 % of
(token, layer) rows — is recorded and analysed, for each routing encoding (``raw``, ``packed``),
side by side in one run, at each of ``--scales``; and, as ``packed_r3``, the same step with the
trainer's routing the engine's (R3: only the rows never fed to the model differ, as stored), packed:

* ``record_critical_path_fraction``: what recording costs the training step — the time to hand the
  record to the background writer (``StepWriter.submit``, what `axrl train` does in the step) over
  a modelled 30 s GPU step — and ``writer_keeps_up``: the background write (validate, encode,
  write, fsync, rename) took less than those 30 s;
* ``routing_bytes_per_token_layer``: bytes the routing datasets take on disk / (T · L), rollout
  and trainer together;
* ``analysis_tokens_per_s``, ``analysis_peak_rss_gb``: ``axrl-debug mismatch RUN --json`` on the
  step in a fresh process (its own wall time over tokens — numba's load included, the CLI's
  imports not — and its peak resident memory); beside it, figures that do not depend on the
  step's shape: ``analysis_routing_ids_per_s`` (expert ids compared, T · L · k for each of rollout
  and trainer, per second) and ``analysis_file_bytes_per_s`` (the step file's bytes per second);
  and ``analysis_startup_s``, the process's one-time start of the compiled path (importing numba
  and its first kernel load, timed apart in the child before the call and counted in the wall
  time), with ``analysis_tokens_per_s_after_startup``, the rate once it is paid;
* ``tui_open_s``: the TUI's model of the run showing the step list and opening the step's samples
  screen (``RunModel`` + ``step``), in a fresh process; beside it what follows the first screen:
  ``tui_routing_s`` (the per-sample routing column of a large MoE step, ``fill_routing``: the
  routing streamed as stored and compared as ``mismatch`` does),
  ``tui_scan_s`` (the background scan of the step-file metrics, a helper process in the app) and
  the process's peak RSS ``tui_peak_rss_gb``.

    OMP_NUM_THREADS=1 python bench/trace_scale.py --scales 0.25,1

Last stdout line: one JSON object with those keys for the largest scale and the packed encoding
(the production preset), plus ``analysis_tokens_per_s_r3`` (``packed_r3``'s), ``side_by_side``
(each key per encoding and scale), ``by_scale`` (every figure, per encoding and scale) and
``scaling`` (each figure at the largest scale over the smallest, with the ratio of token counts
beside it).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import h5py
import numpy as np

from axrl.runtime.recording.step_writer import StepWriter
from axrl.trace import RunDir, StepRecord

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


def record(rec: StepRecord, run: Path, encoding: str) -> dict[str, float]:
    """Hand ``rec`` to a background StepWriter as the learner does; time the hand-over and the write."""
    rd = RunDir(run)
    rd.write_manifest(seed=0, backend="synthetic", engine="synthetic", threads=1, command=["bench"])
    rd.write_config({"algo": {"loss_agg": "token-mean"}})
    writer = StepWriter(lambda r: rd.write_step(r, routing_encoding=encoding), max_pending=2)
    t0 = time.perf_counter()
    writer.submit(rec)
    handover = time.perf_counter() - t0
    writer.close()
    written = time.perf_counter() - t0
    rd.append_metrics({"step": 0, "reward": 0.5})
    with h5py.File(run / "trace" / "step_000000.h5", "r") as f:
        routing = sum(ds.id.get_storage_size() for ds in f["/routing"].values() if ds.name != "/routing/rollout_valid")
    return {"handover_s": handover, "write_s": written, "record_critical_path_fraction": handover / GPU_STEP_S,
            "writer_keeps_up": written < GPU_STEP_S,
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
    r = CliRunner().invoke(app, ["mismatch", run, "--json"])
    assert r.exit_code == 0, r.output
    out["tokens"] = json.loads(r.stdout)["tokens"]
else:
    m = RunModel(run)                          # the step list: metrics.jsonl and the file listing
    out["list_s"] = time.perf_counter() - t0
    step = m.step(m.steps[0])                  # the samples screen of the step
    out["open_s"] = time.perf_counter() - t0 - out["list_s"]
    t1 = time.perf_counter()
    step.fill_routing()                        # after the first screen: the routing column
    out["routing_s"] = time.perf_counter() - t1
    t1 = time.perf_counter()
    m.scan(m.steps)                            # the background scan (a helper process in the app)
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


def measure(scale: float, encoding: str, rec: StepRecord, root: Path) -> dict[str, float]:
    run = root / f"{encoding}_{scale}"
    shutil.rmtree(run, ignore_errors=True)
    if encoding == "packed_r3":                # R3: the trainer routes as the engine did
        rec = replace(rec, routing_train=rec.routing_rollout)
    row = {"scale": scale, "encoding": encoding, "tokens": rec.num_tokens,
           **record(rec, run, encoding.removesuffix("_r3"))}
    file_bytes = (run / "trace" / "step_000000.h5").stat().st_size
    mismatch, tui = child(run, "mismatch"), child(run, "tui")
    ids = rec.num_tokens * LAYERS * TOPK * 2
    work = mismatch["s"] - mismatch["startup_s"]
    row.update(analysis_s=mismatch["s"], analysis_tokens_per_s=rec.num_tokens / mismatch["s"],
               analysis_startup_s=mismatch["startup_s"], analysis_tokens_per_s_after_startup=rec.num_tokens / work,
               analysis_routing_ids_per_s=ids / mismatch["s"], analysis_file_bytes_per_s=file_bytes / mismatch["s"],
               analysis_peak_rss_gb=mismatch["rss_gb"], tui_open_s=tui["list_s"] + tui["open_s"],
               tui_list_s=tui["list_s"], tui_step_s=tui["open_s"], tui_routing_s=tui["routing_s"],
               tui_scan_s=tui["scan_s"], tui_peak_rss_gb=tui["rss_gb"])
    shutil.rmtree(run, ignore_errors=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scales", default="0.25,1", help="comma-separated fractions of the 1 M-token step")
    ap.add_argument("--encodings", default="raw,packed,packed_r3")
    ap.add_argument("--dir", default=None, help="where the runs are written (default: a temp dir)")
    args = ap.parse_args()
    scales = sorted(float(s) for s in args.scales.split(","))
    encodings = args.encodings.split(",")
    root = Path(args.dir or tempfile.mkdtemp(prefix="trace_scale_"))
    rows = []
    for scale in scales:
        rec = synthetic_step(scale)
        for encoding in encodings:
            row = measure(scale, encoding, rec, root)
            rows.append(row)
            print(f"scale {scale:<5} {encoding:<6} T={row['tokens']:>8}  hand-over {row['handover_s'] * 1e3:7.2f} ms  "
                  f"write {row['write_s']:6.2f} s  routing {row['routing_bytes_per_token_layer']:5.2f} B/(token·layer)  "
                  f"mismatch {row['analysis_tokens_per_s'] / 1e6:5.2f} M tok/s ({row['analysis_s']:4.2f} s: start "
                  f"{row['analysis_startup_s']:4.2f} s, then {row['analysis_tokens_per_s_after_startup'] / 1e6:5.2f} M tok/s; "
                  f"{row['analysis_routing_ids_per_s'] / 1e9:4.2f} G ids/s), {row['analysis_peak_rss_gb']:4.2f} GB  "
                  f"tui {row['tui_open_s']:5.2f} s (then routing {row['tui_routing_s']:5.2f} s, scan "
                  f"{row['tui_scan_s']:5.2f} s, {row['tui_peak_rss_gb']:4.2f} GB)", flush=True)
        del rec
    keys = ("record_critical_path_fraction", "writer_keeps_up", "routing_bytes_per_token_layer",
            "analysis_tokens_per_s", "analysis_routing_ids_per_s", "analysis_file_bytes_per_s",
            "analysis_peak_rss_gb", "tui_open_s")
    main_enc = "packed" if "packed" in encodings else encodings[0]
    top = next(r for r in rows if r["scale"] == scales[-1] and r["encoding"] == main_enc)
    low = next(r for r in rows if r["scale"] == scales[0] and r["encoding"] == main_enc)
    scaling = {k: (top[k] / low[k] if isinstance(top[k], float) and low[k] else None)
               for k in ("write_s", "analysis_s", "analysis_peak_rss_gb", "tui_open_s", "tui_peak_rss_gb")}
    scaling["tokens"] = top["tokens"] / low["tokens"]
    # every key at each scale, side by side, per encoding: {key: {encoding: {scale: value}}}
    side = {k: {e: {str(r["scale"]): r[k] for r in rows if r["encoding"] == e} for e in encodings}
            for k in (*keys, "analysis_startup_s", "analysis_tokens_per_s_after_startup", "tui_routing_s", "tui_scan_s",
                      "tui_peak_rss_gb")}
    r3 = next((r for r in rows if r["scale"] == scales[-1] and r["encoding"] == "packed_r3"), None)
    summary = {"encoding": main_enc, "scale": scales[-1], "tokens": top["tokens"], "gpu_step_s": GPU_STEP_S,
               **{k: top[k] for k in keys}, "analysis_startup_s": top["analysis_startup_s"],
               "analysis_tokens_per_s_after_startup": top["analysis_tokens_per_s_after_startup"],
               "analysis_tokens_per_s_r3": r3 and r3["analysis_tokens_per_s"],
               "scaling": scaling, "side_by_side": side, "by_scale": rows}
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
