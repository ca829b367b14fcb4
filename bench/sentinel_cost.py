"""What the sync sentinel costs: the default run (`axrl train` with no config: tiny-moe, calculator,
8 prompts × 8 samples, 48 new tokens) for a few steps under each `sync.verify`, in one process, one
torch thread, the modes interleaved round by round so machine load hits them alike.

Reports, per mode:
- the sentinel's own time per verification (measured inside the run: `SyncSentinel.seconds`),
- the run's mean step time (the loop's wall time / steps; verify=off beside it),
- `fraction` = the sentinel's time / the loop's time — immune to noise between runs.

Ends with one JSON line: `sentinel_step_fraction` (the default mode's fraction), `probe_rescore_s`
(median seconds of one probe re-score: engine + trainer forward of `sync.probe` samples, compared),
and each mode's numbers.

    python bench/sentinel_cost.py [--steps 4] [--rounds 2] [--set key=value ...]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from axrl.assembly import settings as S
from axrl.assembly.build import build_components
from axrl.config import load_config
from axrl.runtime.loop import train as run_loop
from axrl.sync.settings import SyncSettings

MODES = ("off", "checksum", "probe", "both")


def one_run(mode: str, steps: int, extra: list[str], out: Path) -> dict[str, float]:
    """One run under `sync.verify: mode`: loop seconds, sentinel seconds and probe re-score times."""
    cfg = load_config(None, [f"steps={steps}", "eval.every=0", "checkpoint.every=1000", "runtime.threads=1",
                             f"sync.verify={mode}", *extra])
    c = build_components(cfg)
    start = time.perf_counter()
    run_loop(S.loop_settings(cfg), c, out)
    loop_s = time.perf_counter() - start
    sentinel = c.rollout.sentinel
    return {"loop_s": loop_s, "step_s": loop_s / steps,
            "sentinel_s": 0.0 if sentinel is None else sentinel.seconds,
            "verifications": 0 if sentinel is None else sentinel.verifications,
            "probe_s": [] if sentinel is None else list(sentinel.probe_seconds)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--set", dest="extra", action="append", default=[])
    args = ap.parse_args()
    torch.set_num_threads(1)
    runs: dict[str, list[dict]] = {m: [] for m in MODES}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for mode in MODES:
                runs[mode].append(one_run(mode, args.steps, args.extra, Path(tmp) / f"{mode}_{r}"))
    default = SyncSettings().verify
    summary = {}
    print(f"{'verify':>9} {'step s':>8} {'sentinel s/verif.':>18} {'fraction':>9}")
    for mode, rs in runs.items():
        step_s = statistics.median(x["step_s"] for x in rs)
        per = statistics.median(x["sentinel_s"] / max(x["verifications"], 1) for x in rs)
        frac = statistics.median(x["sentinel_s"] / x["loop_s"] for x in rs)
        summary[mode] = {"step_s": round(step_s, 4), "sentinel_s_per_verification": round(per, 5),
                         "fraction": round(frac, 5)}
        print(f"{mode:>9} {step_s:8.3f} {per:18.5f} {frac:9.4f}")
    probes = [p for x in runs["probe"] + runs["both"] for p in x["probe_s"]]
    off = summary["off"]["step_s"]
    print(f"step time vs verify=off (side by side, noisy): "
          + ", ".join(f"{m} {summary[m]['step_s'] / off:.3f}" for m in MODES[1:]))
    print(json.dumps({"sentinel_step_fraction": summary[default]["fraction"], "default_verify": default,
                      "probe_rescore_s": round(statistics.median(probes), 5) if probes else None,
                      "steps": args.steps, "rounds": args.rounds, "modes": summary}))


if __name__ == "__main__":
    main()
