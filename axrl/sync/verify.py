"""The sync sentinel: after every weight sync and every resume, before the rollout worker hands
the engine another request under the new version, check that the engine holds what the trainer
sent (`sync.verify`) and act on a failure (`sync.on_failure`).

* checksum — per-tensor checksums (`axrl.sync.checksums`) of the weights as posted, in the form the
  engine should hold them (`EngineSide.checksum_pair`: rounded to `rollout.weight_dtype` for the
  embedded engine; the server's dtype and layout for servers), vs the engine's own; a mismatch
  names the tensor and the (layer, expert) decoded from its name.
* probe — the run's first `sync.probe` samples re-scored by the engine and by the trainer's forward
  on the posted weights (`axrl.sync.probe`); the first verification with probes and clean checksums
  calibrates the floor (stored in manifest.json under `sync_sentinel`), later ones must stay under
  its limit; a failure names the worst probe tokens and the layers whose routing differs.
* both — checksums, and the probe where they cannot settle it: to calibrate, when they fail (to
  name the tokens it affects), and on an engine whose checksums cannot read every tensor (servers:
  opaque kernel handles, or no checksum route). After clean exact checksums of every tensor the
  embedded engine's probe would re-read the parameters just checksummed.

A failure is a `sync_mismatch` event in RUN/events.jsonl: `step` (the first step whose batch is
rolled out under these weights, = `version`), `version`, `reason` (start | resume | sync), `check`
(checksum | probe), what it names, and `action`. `warn` goes on, `stop` raises
`SyncVerificationError`, `resync` loads the weights again and verifies again (a `sync_resync`
event says whether that repaired it; if not, the run goes on as with `warn`).
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch

from axrl.model import ModelConfig
from axrl.sync.checksums import compare_checksums
from axrl.sync.engine_side import EngineSide
from axrl.sync.probe import PROBE_TOKENS, ProbeFloor, TrainerScorer, compare_scores, exceeds
from axrl.sync.settings import SyncSettings
from axrl.trace.run_dir import atomic_write_text

MANIFEST_KEY = "sync_sentinel"
MAX_NAMED = 32          # tensors listed in one event (the count says how many in all)

Record = Callable[..., Any]                 # EventLog.record(event, **fields)
RunPath = Callable[[], "Path | None"]       # the run directory once attached


class SyncVerificationError(RuntimeError):
    """`sync.on_failure: stop` — the engine does not hold the weights the trainer sent."""


class SyncSentinel:
    """Verifies one engine against the weights posted to it (module docstring)."""

    def __init__(self, settings: SyncSettings, side: EngineSide, model_config: ModelConfig, *,
                 record: Record | None = None, run_path: RunPath | None = None) -> None:
        self.settings, self.side, self.record, self.run_path = settings, side, record, run_path
        self.trainer = TrainerScorer(model_config)
        self.probes: list[np.ndarray] = []
        self.floor: ProbeFloor | None = None
        self.seconds = 0.0          # time spent verifying, in all (bench/sentinel_cost.py)
        self.verifications = 0
        self.probe_seconds: list[float] = []   # each probe re-score (both sides, compare)
        self._lock = threading.Lock()
        self._said_unreadable = self._said_unavailable = False
        # The weights the engine was last found to hold (version, HF state dict) while no floor
        # exists yet: the probe set completes during the first rollout, and is calibrated on them.
        self._held: tuple[int, dict[str, torch.Tensor]] | None = None

    @property
    def checks(self) -> tuple[bool, bool]:
        """(checksums on, probe on) under `sync.verify`."""
        v = self.settings.verify
        return v in ("checksum", "both"), v in ("probe", "both")

    def observe(self, token_ids: np.ndarray, ok: bool = True) -> None:
        """Offer a finished sample: the first `sync.probe` usable ones become the fixed probe set."""
        if not self.checks[1] or not ok or len(token_ids) < 2:
            return
        with self._lock:
            if len(self.probes) >= self.settings.probe:
                return
            self.probes.append(np.asarray(token_ids[:PROBE_TOKENS], dtype=np.int64).copy())
            complete = len(self.probes) == self.settings.probe
        if complete and self.floor is None and self._held is not None:
            # Calibrate now, on the weights the engine holds (verified at the start or the last
            # sync), so the first sync after it is already compared with a floor.
            version, weights = self._held
            start = time.perf_counter()
            self._probe(weights, list(self.probes), version, calibrate=True)
            self.probe_seconds.append(time.perf_counter() - start)
            self.seconds += time.perf_counter() - start
            self._held = None

    def verify(self, weights: Any, version: int, *, reason: str, resend: Callable[[], None]) -> list[dict[str, Any]]:
        """Verify the engine against `weights` (version `version`); returns the findings (empty
        when clean). `resend` loads the weights into the engine again (`sync.on_failure: resync`)."""
        if self.settings.verify == "off" or not isinstance(weights, Mapping):
            return []
        start = time.perf_counter()
        try:
            findings = self._check(weights, version)
            if findings:
                self._act(findings, weights, version, reason, resend)
            elif self.floor is None and self.checks[1]:
                # Start and resume hand the trainer's live weights: keep a copy to calibrate on.
                self._held = (version, dict(weights) if reason == "sync"
                              else {k: v.detach().clone() for k, v in weights.items()})
            return findings
        finally:
            self.seconds += time.perf_counter() - start
            self.verifications += 1

    # -- the checks --------------------------------------------------------------------------------
    def _check(self, weights: Mapping[str, torch.Tensor], version: int) -> list[dict[str, Any]]:
        findings = []
        do_checksum, do_probe = self.checks
        pair = self.side.checksum_pair(weights) if do_checksum else None   # None: this engine cannot say
        if do_checksum and pair is None and self.side.unavailable and not self._said_unavailable:
            self._said_unavailable = True
            self._event("sync_checksum_unavailable", step=version, why=self.side.unavailable)
        if pair is not None:
            self._say_unreadable(pair.unreadable, version)
            bad = compare_checksums(pair.expected, pair.held)
            if bad:
                findings.append({"check": "checksum", "count": len(bad),
                                 "expert_tensors": sum(m.expert is not None for m in bad),
                                 "layers": sorted({m.layer for m in bad if m.layer is not None}),
                                 "experts": sorted({(m.layer, m.expert) for m in bad if m.expert is not None}),
                                 "tensors": [m.to_json() for m in bad[:MAX_NAMED]]})
        with self._lock:
            probes = list(self.probes)
        # Under `both`, clean exact checksums of every tensor leave the probe nothing to find (the
        # engine's forward reads the very parameters checksummed): it runs to calibrate, on a
        # failure (to name the tokens it affects) and where checksums cannot read every tensor.
        needed = pair is None or bool(pair.unreadable) or bool(findings) or self.floor is None
        if do_probe and needed and len(probes) == self.settings.probe:
            start = time.perf_counter()
            finding = self._probe(dict(weights), probes, version, calibrate=not findings)
            self.probe_seconds.append(time.perf_counter() - start)
            if finding is not None:
                findings.append(finding)
        return findings

    def _probe(self, weights: dict[str, torch.Tensor], probes: Sequence[np.ndarray], version: int,
               calibrate: bool) -> dict[str, Any] | None:
        c = compare_scores(self.side.score(probes), self.trainer.score(weights, probes), probes)
        if self.floor is None:
            if calibrate:  # the same weights on both sides (checksums clean or off): the numerics floor
                self.floor = ProbeFloor(c.logprob_max_abs, c.routing_disagree, version, c.tokens)
                self._store_floor()
            return None
        if not exceeds(c, self.floor):
            return None
        return {"check": "probe", "logprob_max_abs": c.logprob_max_abs, "routing_disagree": c.routing_disagree,
                "floor": self.floor.to_json(), "tokens": c.worst, "routing_layers": c.routing_layers}

    def _say_unreadable(self, unreadable: Sequence[str], version: int) -> None:
        """Once per run: which tensors the engine holds in a form no checksum reads (the probe
        covers them)."""
        if unreadable and not self._said_unreadable:
            self._said_unreadable = True
            self._event("sync_checksum_partial", step=version, count=len(unreadable),
                        tensors=list(unreadable[:MAX_NAMED]),
                        why="the engine computes these from opaque kernel handles; the probe covers them")

    # -- on failure --------------------------------------------------------------------------------
    def _act(self, findings: list[dict[str, Any]], weights: Mapping[str, torch.Tensor], version: int, reason: str,
             resend: Callable[[], None]) -> None:
        action = self.settings.on_failure
        for f in findings:
            self._event("sync_mismatch", step=version, version=version, reason=reason, action=action, **f)
        if action == "stop":
            raise SyncVerificationError(describe(findings, version, reason))
        if action == "resync":
            resend()
            again = self._check(weights, version)
            self._event("sync_resync", step=version, version=version, reason=reason, repaired=not again,
                        remaining=[describe([f], version, reason) for f in again])

    def _event(self, event: str, **fields: Any) -> None:
        if self.record is not None:
            self.record(event, engine=self.side.name, **fields)

    def _store_floor(self) -> None:
        """Write the floor into RUN/manifest.json (`sync_sentinel`), once the run directory exists."""
        path = None if self.run_path is None else self.run_path()
        if path is None or self.floor is None or not (Path(path) / "manifest.json").is_file():
            return
        manifest_file = Path(path) / "manifest.json"
        manifest = json.loads(manifest_file.read_text(encoding="utf-8"))
        manifest[MANIFEST_KEY] = {"verify": self.settings.verify, "engine": self.side.name,
                                  "weight_dtype": self.side.weight_dtype, "probe": self.settings.probe,
                                  "floor": self.floor.to_json()}
        atomic_write_text(manifest_file, json.dumps(manifest, indent=2) + "\n")


def describe(findings: Sequence[dict[str, Any]], version: int, reason: str) -> str:
    """One readable message for a list of findings (the `stop` error, the resync event)."""
    parts = []
    for f in findings:
        if f["check"] == "checksum":
            named = ", ".join(_where(t) for t in f["tensors"][:8])
            parts.append(f"{f['count']} tensor(s) differ from the trainer's: {named}"
                         + (" …" if f["count"] > 8 else ""))
        else:
            w = f["tokens"][0] if f["tokens"] else {}
            parts.append(f"probe re-score |Δ logprob| {f['logprob_max_abs']:.3g} > limit "
                         f"{f['floor']['limit_logprob']:.3g} (floor {f['floor']['logprob_max_abs']:.3g}), "
                         f"worst at probe {w.get('probe')} position {w.get('position')} token {w.get('token')}"
                         + (f"; routing differs in layers {f['routing_layers']}" if f["routing_layers"] else ""))
    return (f"sync sentinel: after the {reason} to weights version {version} (step {version}) the engine does not "
            f"hold the trainer's weights: " + "; ".join(parts) + ". See RUN/events.jsonl (sync_mismatch) and "
            "docs/debugging.md \"Sync sentinel\"; sync.on_failure: warn|resync to go on")


def _where(t: Mapping[str, Any]) -> str:
    loc = [] if t["layer"] is None else [f"layer {t['layer']}"]
    loc += [] if t["expert"] is None else [f"expert {t['expert']}"]
    return f"{t['tensor']}" + (f" ({', '.join(loc)})" if loc else "")
