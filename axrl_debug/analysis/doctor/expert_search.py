"""Localise a stale expert by re-execution when the trace cannot.

The trace localises a stale expert by the |Δ| of the tokens routed through it. That works when the
expert's error stays on those tokens (an expert of the last layer: later positions attend to keys
and values computed before it), but an expert of an earlier layer writes its error into the keys
and values every later position attends to, so the error spreads and another (correlated) expert
can look guiltier, or none stands out and the reading is `weights_out_of_sync`. An expert used by
nearly every token cannot be compared with the tokens that avoid it at all.

So when the step's clean re-run diverges and neither the named expert nor the whole previous
version reproduces the recording, each (layer, expert) is held at an earlier version in turn —
the trace's ranked experts first, then the rest from the last layer down — until one reproduces
the recorded rollout bit for bit (at most MAX_REPLAYS re-runs and MAX_SECONDS: a large run's step
is bisected instead). A hit is a proof and names the expert; the trace's reading is kept in the
evidence (`trace_localisation`).
"""

from __future__ import annotations

import re
import time
from typing import Any, Callable

from axrl_debug.analysis.doctor.context import Context
from axrl_debug.analysis.doctor.finding import Finding

MAX_REPLAYS = 48
MAX_SECONDS = 180.0   # the search's time budget (measured: 19 re-runs of a tiny-moe step, ~17 s of CPU)
EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.")


def candidates(ctx: Context, names: list[str]) -> list[tuple[int, int]]:
    """Every (layer, expert) of the model, the profile's most concentrated first."""
    every = sorted({(int(m.group(1)), int(m.group(2))) for n in names if (m := EXPERT.match(n))},
                   key=lambda le: (-le[0], le[1]))
    first = [(r["layer"], r["expert"]) for r in (ctx.profile.experts if ctx.profile else [])]
    return [le for le in first if le in every] + [le for le in every if le not in first]


def search(ctx: Context, findings: list[Finding], step: int, clean: dict[str, Any],
           replay: Callable[..., dict[str, Any]], weights_at: Callable[[Any, int], dict], say: Callable[[str], None]
           ) -> list[Finding]:
    """Run the search if it applies (see the module doc); return the findings, a proven
    `stale_tensor` among them when an expert reproduces the recording."""
    suspects = [f for f in findings if f.cause in ("stale_tensor", "weights_out_of_sync")]
    if not suspects or clean.get("reproduced") or any(f.proven for f in findings):
        return findings
    version = ctx.views[step].policy_version
    earlier = sorted({v for v in (version - 1, 0) if 0 <= v < version}, reverse=True)
    if not earlier:
        return findings
    olds = {v: weights_at(ctx.run, v) for v in earlier}
    from replay import ReplayInputError

    tried, hit, t0 = 0, None, time.perf_counter()
    pairs = [(le, v) for le in candidates(ctx, list(olds[earlier[0]])) for v in olds]
    for (layer, expert), v in pairs:
        if tried >= MAX_REPLAYS or time.perf_counter() - t0 > MAX_SECONDS:
            break
        prefix = f"model.layers.{layer}.mlp.experts.{expert}."
        tried += 1
        say(f"search: {prefix}* held at version {v}")
        try:
            out = replay(ctx, step, hook=lambda w, old=olds[v], p=prefix: {k: (old[k] if k.startswith(p) else t)
                                                                           for k, t in w.items()})
        except (ReplayInputError, FileNotFoundError, ValueError) as e:
            say(f"search stopped: {e}")
            break
        if out["reproduced"]:
            hit = (layer, expert, v, out)
            break
    if hit is None:
        for f in suspects:   # said in the proof: no single expert held at an earlier version explains it
            if f.proof is not None:
                f.proof["expert_search"] = {"replays": tried, "found": False}
        return findings
    return _proven(ctx, findings, step, clean, tried, hit)


def _proven(ctx: Context, findings: list[Finding], step: int, clean: dict[str, Any], tried: int,
            hit: tuple[int, int, int, dict[str, Any]]) -> list[Finding]:
    layer, expert, v, out = hit
    what = f"the engine held model.layers.{layer}.mlp.experts.{expert}.* at version {v}"
    old = next((f for f in findings if f.cause == "stale_tensor"), None)
    trace = ({"layer": old.evidence.get("layer"), "expert": old.evidence.get("expert")} if old else None)
    f = Finding("stale_tensor", 1.0,
                {"layer": layer, "expert": expert, "op": "expert_out", "version_held": v,
                 "trace_localisation": trace, "search_replays": tried},
                f"layer {layer}, expert {expert}: the engine's copy of that expert is version {v}'s. PROVEN by "
                f"re-execution: {what} reproduces the recorded rollout bit for bit (found by holding each expert "
                f"at an earlier version in turn, {tried} re-runs; the trace alone "
                + (f"pointed at layer {trace['layer']}, expert {trace['expert']})" if trace else "did not localise it)"),
                f"axrl-debug bisect {ctx.run} --step {step}", old.steps if old else [step],
                proof={"tested": True, "step": step, "clean_replay": clean, "reproduced": True, "hypothesis": what,
                       "hypotheses": [{"hypothesis": what, **out}], "search_replays": tried})
    return [f, *(g for g in findings if g is not old)]   # test_hypotheses weakens the unproven ones
