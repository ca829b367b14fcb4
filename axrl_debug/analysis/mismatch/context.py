"""The decoded context of the worst tokens: a few ids around each, read from its own sample."""

from __future__ import annotations

from typing import Any

import numpy as np


def attach_context(reader: Any, top: list[dict[str, Any]], tokenizer: Any = None, *,
                   before: int = 12, after: int = 4) -> None:
    """Fill ``token_id``, ``text``, ``sample_id`` and ``context`` of the top tokens in place.

    Reads only the few ids around each token (``StepFile.read_slice``); the context is the decoded
    ``before`` tokens, the token itself marked as ⟦…⟧, then ``after`` tokens, all from its own sample.
    ``tokenizer`` defaults to ``Tokenizer.default()`` (traces store ids, not text)."""
    if not top:
        return
    if tokenizer is None:
        from axrl.tokenizer import Tokenizer
        tokenizer = Tokenizer.default()
    from axrl.trace import StepFile

    def dec(ids: np.ndarray) -> str:
        try:
            return tokenizer.decode([int(i) for i in ids])
        except Exception:  # ids outside this tokenizer's vocabulary: show them raw
            return " ".join(f"<{int(i)}>" for i in ids)

    by_step: dict[int, list[dict[str, Any]]] = {}
    for t in top:
        by_step.setdefault(int(t["step"]), []).append(t)
    for step, items in by_step.items():
        try:
            with StepFile(reader.step_path(step)) as sf:
                off = sf["/samples/offsets"]
                sid = sf["/samples/sample_id"]
                for t in items:
                    s0, s1 = int(off[t["sample"]]), int(off[t["sample"] + 1])
                    a, b = max(s0, t["token"] - before), min(s1, t["token"] + 1 + after)
                    ids = sf.read_slice("/tokens/ids", a, b)
                    j = t["token"] - a
                    t["token_id"] = int(ids[j])
                    t["sample_id"] = int(sid[t["sample"]])
                    t["text"] = dec(ids[j:j + 1])
                    ctx = ("…" if a > s0 else "") + dec(ids[:j]) + "⟦" + t["text"] + "⟧" + dec(ids[j + 1:]) \
                        + ("…" if b < s1 else "")
                    t["context"] = ctx.replace("\n", "⏎")
        except Exception as e:  # context is a nicety: never fail the analysis over it
            reader.report_problem(reader.step_path(step) if step in reader.steps else reader.path,
                                  f"cannot read token context of step {step}: {e}")
