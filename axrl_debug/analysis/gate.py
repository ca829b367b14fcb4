"""The CI regression gate: golden files of per-step metrics, the check against them, JUnit XML.

Golden file (JSON, strict — NaN is written as null)::

    {"format": "axrl-debug-golden", "version": 1, "created": "...", "run": "...",
     "source": {git_sha, axrl_version, torch, numpy, platform, threads, seed, ...},
     "metrics": ["reward", "loss", ...],
     "tolerance": {"rtol": 1e-5, "atol": 1e-12},         # default for every metric
     "tolerances": {"mismatch": {"rtol": ..., "atol": ...}},   # optional per-metric defaults
     "cross_machine_tolerances": {"loss": {"rtol": 1e-3, "atol": 1e-9}, ...},   # optional, below
     "steps": [{"step": 0, "reward": 0.2, "loss": 0.0012, ...}, ...]}

Tolerance of a metric, first match wins: ``--tol METRIC=…`` on the command line, then ``--rtol`` /
``--atol`` given on the command line, then the golden file's ``tolerances[METRIC]``, then its
``tolerance``, then ``DEFAULT_RTOL`` / ``DEFAULT_ATOL``. The rule is ``|actual − golden| ≤ atol +
rtol · |golden|`` (``analysis.diff.is_close``).

Bits belong to the machine: the tight tolerances hold for a run on the machine that made the
golden — the same ``MACHINE_KEYS`` (CPU dispatch level, instruction-set flags digest, platform
string, torch build) in the checked run's manifest as in the golden's ``source``. A run made
elsewhere is checked with the golden file's ``cross_machine_tolerances[METRIC]`` where it has one
(between the command line and ``tolerances`` in the precedence above), and the check says so.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import platform
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping

import pandas as pd

from .diff import is_close, rel_diff

GOLDEN_FORMAT = "axrl-debug-golden"
GOLDEN_VERSION = 1
DEFAULT_RTOL = 1e-5
DEFAULT_ATOL = 1e-12
DEFAULT_GOLDEN_METRICS = ("reward", "loss", "grad_norm", "clipfrac", "mismatch", "mismatch_max", "kl_k3",
                          "routing_agreement", "generated_tokens")


class GoldenError(ValueError):
    """A golden file that cannot be used (unreadable, wrong format, unknown version)."""


def _clean(v: Any) -> Any:
    if hasattr(v, "item"):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return None if math.isnan(v) else v
    return v


def make_golden(df: pd.DataFrame, *, run: str, manifest: Mapping[str, Any] | None,
                metrics: Iterable[str] = DEFAULT_GOLDEN_METRICS, rtol: float = DEFAULT_RTOL,
                atol: float = DEFAULT_ATOL, tolerances: Mapping[str, Mapping[str, float]] | None = None,
                cross_machine: Mapping[str, Mapping[str, float]] | None = None) -> dict[str, Any]:
    """A golden document from a step table (``frames.step_table``); ``cross_machine``: the
    tolerances for a run made on another machine (module docstring)."""
    metrics = [m for m in metrics if m in df.columns]
    man = dict(manifest or {})
    versions = man.get("versions") or {}
    source = {"git_sha": man.get("git_sha"), "git_dirty": man.get("git_dirty"),
              "axrl_version": man.get("axrl_version"), "torch": versions.get("torch"),
              "numpy": versions.get("numpy"), "platform": man.get("platform") or platform.platform(),
              "machine": platform.machine(), "cpu_model": man.get("cpu_model"),
              "cpu_capability": man.get("cpu_capability"), "cpu_flags": man.get("cpu_flags"),
              "threads": man.get("threads"), "seed": man.get("seed"),
              "backend": man.get("backend"), "engine": man.get("engine")}
    return {
        "format": GOLDEN_FORMAT, "version": GOLDEN_VERSION,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "run": run, "source": source, "metrics": metrics,
        "tolerance": {"rtol": rtol, "atol": atol},
        "tolerances": {k: dict(v) for k, v in (tolerances or {}).items()},
        **({"cross_machine_tolerances": {k: dict(v) for k, v in cross_machine.items()}} if cross_machine else {}),
        "steps": [{"step": int(r["step"]), **{m: _clean(r[m]) for m in metrics}}
                  for r in df.to_dict(orient="records")],
    }


def write_golden(doc: Mapping[str, Any], path: Path | str) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1, allow_nan=False) + "\n", encoding="utf-8")
    return path


def read_golden(path: Path | str) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"golden file not found: {path}")
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise GoldenError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(doc, dict) or doc.get("format") != GOLDEN_FORMAT:
        raise GoldenError(f"{path}: not an axrl-debug golden file (format != {GOLDEN_FORMAT!r})")
    if doc.get("version") != GOLDEN_VERSION:
        raise GoldenError(f"{path}: golden version {doc.get('version')!r} unknown (this axrl-debug reads "
                          f"{GOLDEN_VERSION})")
    if not isinstance(doc.get("steps"), list) or not isinstance(doc.get("metrics"), list):
        raise GoldenError(f"{path}: missing 'steps' or 'metrics'")
    return doc


def parse_tol(specs: Iterable[str]) -> dict[str, dict[str, float]]:
    """``["loss=1e-6", "mismatch=1e-4,1e-12"]`` → ``{"loss": {"rtol": 1e-6}, "mismatch": {"rtol":
    1e-4, "atol": 1e-12}}`` (METRIC=RTOL[,ATOL]). Raises ValueError with the offending spec."""
    out: dict[str, dict[str, float]] = {}
    for spec in specs:
        name, sep, value = spec.partition("=")
        parts = [p.strip() for p in value.split(",")] if sep else []
        if not name.strip() or not parts or len(parts) > 2 or not all(parts):
            raise ValueError(f"--tol expects METRIC=RTOL or METRIC=RTOL,ATOL, got {spec!r}")
        try:
            vals = [float(p) for p in parts]
        except ValueError:
            raise ValueError(f"--tol {spec!r}: tolerances must be numbers") from None
        if any(v < 0 or math.isnan(v) for v in vals):
            raise ValueError(f"--tol {spec!r}: tolerances must be >= 0")
        out[name.strip()] = {"rtol": vals[0], **({"atol": vals[1]} if len(vals) == 2 else {})}
    return out


@dataclass(frozen=True)
class Tolerance:
    rtol: float
    atol: float


#: what decides the bits besides the config: a run whose manifest differs from the golden's
#: source in any of these ran other kernels (a VM's CPU model says only "Xeon": the flags decide)
MACHINE_KEYS = ("cpu_capability", "cpu_flags", "platform", "torch")


def machine_differences(golden: Mapping[str, Any], manifest: Mapping[str, Any]) -> list[str]:
    """``MACHINE_KEYS`` on which the checked run's manifest differs from the golden's source, as
    "key: here vs golden" ([] = the golden's machine, where the tight tolerances hold)."""
    src = golden.get("source") or {}
    here = {**manifest, "torch": (manifest.get("versions") or {}).get("torch")}
    return [f"{k}: {here.get(k)} here, {src.get(k)} in the golden" for k in MACHINE_KEYS
            if src.get(k) != here.get(k)]


def resolve_tolerance(metric: str, golden: Mapping[str, Any], rtol: float | None, atol: float | None,
                      overrides: Mapping[str, Mapping[str, float]], same_machine: bool = True) -> Tolerance:
    """The tolerance of one metric by the precedence in the module docstring."""
    base = golden.get("tolerance") or {}
    per = (golden.get("tolerances") or {}).get(metric) or {}
    if not same_machine:
        per = {**per, **((golden.get("cross_machine_tolerances") or {}).get(metric) or {})}
    r = per.get("rtol", base.get("rtol", DEFAULT_RTOL))
    a = per.get("atol", base.get("atol", DEFAULT_ATOL))
    if rtol is not None:
        r = rtol
    if atol is not None:
        a = atol
    o = overrides.get(metric) or {}
    return Tolerance(float(o.get("rtol", r)), float(o.get("atol", a)))


def check(df: pd.DataFrame, golden: Mapping[str, Any], *, rtol: float | None = None,
          atol: float | None = None, overrides: Mapping[str, Mapping[str, float]] | None = None,
          same_machine: bool = True) -> dict[str, Any]:
    """Compare a fresh run's step table with a golden document. Every (golden step, metric) pair
    becomes one result: ``ok``, ``moved`` (beyond tolerance), ``missing step`` (the run lacks the
    step) or ``missing metric`` (the run cannot compute it). ``same_machine`` false: the golden's
    ``cross_machine_tolerances`` apply (``machine_differences``)."""
    overrides = overrides or {}
    metrics = list(golden["metrics"])
    actual = df.set_index("step") if len(df) else pd.DataFrame()
    tols = {m: resolve_tolerance(m, golden, rtol, atol, overrides, same_machine) for m in metrics}
    unknown = sorted(set(overrides) - set(metrics))
    results: list[dict[str, Any]] = []
    for g in golden["steps"]:
        s = int(g["step"])
        for m in metrics:
            want = g.get(m)
            want_f = math.nan if want is None else want
            tol = tols[m]
            res: dict[str, Any] = {"step": s, "metric": m, "golden": want, "actual": None,
                                   "abs_diff": None, "rel_diff": None, "rtol": tol.rtol, "atol": tol.atol}
            if s not in actual.index:
                res["status"] = "missing step"
            elif m not in actual.columns:
                res["status"] = "missing metric"
            else:
                got = _clean(actual.at[s, m])
                res["actual"] = got
                got_f = math.nan if got is None else got
                try:
                    res["abs_diff"] = abs(float(got_f) - float(want_f))
                except (TypeError, ValueError):
                    pass
                res["rel_diff"] = rel_diff(got_f, want_f)
                res["status"] = "ok" if is_close(got_f, want_f, tol.rtol, tol.atol) else "moved"
            results.append(res)
    failed = [r for r in results if r["status"] != "ok"]
    golden_steps = {int(g["step"]) for g in golden["steps"]}
    extra = sorted(set(actual.index) - golden_steps) if len(df) else []
    per_metric = []
    for m in metrics:
        rs = [r for r in results if r["metric"] == m]
        diffs = [r["abs_diff"] for r in rs if r["abs_diff"] is not None and not math.isnan(r["abs_diff"])]
        rels = [r["rel_diff"] for r in rs if r["rel_diff"] is not None and not math.isnan(r["rel_diff"])]
        per_metric.append({"metric": m, "values": len(rs), "failed": sum(r["status"] != "ok" for r in rs),
                           "max_abs_diff": max(diffs) if diffs else None,
                           "max_rel_diff": max(rels) if rels else None,
                           "rtol": tols[m].rtol, "atol": tols[m].atol})
    return {"passed": not failed, "checked": len(results), "failed": len(failed), "results": results,
            "failures": failed, "per_metric": per_metric, "extra_steps": extra,
            "unknown_tol_metrics": unknown}


def junit_xml(report: Mapping[str, Any], path: Path | str, *, suite: str = "axrl-debug check") -> Path:
    """JUnit XML with one test case per (step, metric): CI systems render the failures by name."""
    results = report["results"]
    ts = ET.Element("testsuite", name=suite, tests=str(len(results)), failures=str(report["failed"]),
                    errors="0", skipped="0")
    for r in results:
        tc = ET.SubElement(ts, "testcase", classname=f"golden.{r['metric']}",
                           name=f"step {r['step']}: {r['metric']}")
        if r["status"] != "ok":
            msg = (f"{r['metric']} at step {r['step']}: {r['status']}; golden {r['golden']!r}, actual "
                   f"{r['actual']!r}, |diff| {r['abs_diff']!r}, rel {r['rel_diff']!r} "
                   f"(allowed atol {r['atol']:g} + rtol {r['rtol']:g}·|golden|)")
            f = ET.SubElement(tc, "failure", message=msg, type=r["status"].replace(" ", "_"))
            f.text = msg
    root = ET.Element("testsuites", tests=str(len(results)), failures=str(report["failed"]))
    root.append(ts)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    ET.ElementTree(root).write(path, encoding="utf-8", xml_declaration=True)
    return path
