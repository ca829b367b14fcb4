"""The live sync sentinel's findings, when the run has them (`sync_mismatch` events in
RUN/events.jsonl, written by axrl/sync when `sync.verify` is on; never required).

A checksum failure is a direct observation of the engine's weights: it names the tensors that differ
from the trainer's after a sync. One expert (or a few tensors of one layer) → `stale_tensor` with that
layer/expert; most of the model → `weights_out_of_sync` (the evidence says when every differing
tensor is an expert weight: the experts were loaded differently, not the whole model late). A
probe failure alone (a server without
checksums) says the engine scores the probe sequences differently from the trainer beyond the
calibrated floor: `weights_out_of_sync` unless it names routing layers. A failure the sentinel
repaired by a resync (`sync_resync` with `repaired: true`) is said, at a lower confidence: the steps
after it ran the right weights.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from axrl_debug.analysis.doctor.context import Context
from axrl_debug.analysis.doctor.finding import Finding


def read_events(run: Path) -> list[dict[str, Any]]:
    """The sentinel's `sync_mismatch` and `sync_resync` events of `run` (none when it has no events file)."""
    path = run / "events.jsonl"
    if not path.is_file():
        return []
    out = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            ev = json.loads(line)
        except ValueError:
            continue
        if isinstance(ev, dict) and ev.get("event") in ("sync_mismatch", "sync_resync"):
            out.append(ev)
    return out


def detect(ctx: Context) -> list[Finding]:
    events = read_events(ctx.run)
    bad = [e for e in events if e["event"] == "sync_mismatch" and (not ctx.steps or e.get("step") in ctx.steps
                                                                     or e.get("step") is None)]
    if not bad:
        return []
    repaired = {e.get("version") for e in events if e["event"] == "sync_resync" and e.get("repaired")}
    checks = [e for e in bad if e.get("check") == "checksum"]
    steps = sorted({int(e["step"]) for e in bad if e.get("step") is not None})
    fixed = all(e.get("version") in repaired for e in bad)
    scale = 0.6 if fixed else 1.0
    note = " (repaired by the sentinel's resync: later rollouts ran the right weights)" if fixed else ""
    if checks:
        experts = sorted({tuple(x) for e in checks for x in e.get("experts") or []})
        layers = sorted({int(x) for e in checks for x in e.get("layers") or []})
        count = max(int(e.get("count") or 0) for e in checks)
        names = [t.get("tensor") for e in checks for t in e.get("tensors") or []][:8]
        evidence = {"source": "sync sentinel checksums", "tensors": names, "count": count, "layers": layers,
                    "experts": [list(x) for x in experts], "events": len(bad)}
        if len(experts) == 1:
            (layer, expert), = experts
            evidence.update(layer=layer, expert=expert, op="expert_out")
            what = f"layer {layer}, expert {expert}"
        elif 0 < len(layers) <= 1:
            evidence.update(layer=layers[0], op="in")
            what = f"layer {layers[0]}"
        else:
            only_experts = all(e.get("expert_tensors") == e.get("count") for e in checks)
            evidence["only_expert_tensors"] = only_experts
            # every expert and nothing else: how the experts are loaded, not which version (vLLM's
            # CPU in-place reload leaves them unpacked: docs/vllm.md)
            kind = (f"{count} engine tensors, all of them expert weights ({len(experts)} experts in layers {layers}: "
                    "the engine loads its experts differently from the rest),") if only_experts else \
                f"{count} engine tensors"
            return [Finding("weights_out_of_sync", 0.95 * scale, evidence,
                            f"the sync sentinel's checksums found {kind} differing from the trainer's "
                            f"after the sync of steps {steps}{note}", f"axrl-debug bisect {ctx.run} --step {steps[0]}",
                            steps)]
        return [Finding("stale_tensor", 0.97 * scale, evidence,
                        f"{what}: the sync sentinel's checksums found the engine's copy ({count} tensors, e.g. "
                        f"{names[0]}) differing from the trainer's after the sync of steps {steps}{note}",
                        f"axrl-debug bisect {ctx.run} --step {steps[0]}", steps)]
    routing = sorted({int(x) for e in bad for x in e.get("routing_layers") or []})
    worst = max(float(e.get("logprob_max_abs") or 0.0) for e in bad)
    return [Finding("weights_out_of_sync", 0.6 * scale,
                    {"source": "sync sentinel probe", "logprob_max_abs": worst, "routing_layers": routing,
                     "events": len(bad)},
                    f"the sync sentinel's probe re-score differed from the trainer's by up to {worst:.3g} beyond the "
                    f"calibrated floor after the sync of steps {steps}{note}",
                    f"axrl-debug bisect {ctx.run} --step {steps[0]}", steps)]
