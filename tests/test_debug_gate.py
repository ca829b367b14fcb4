"""The CI regression gate: golden files, `check` pass/fail, tolerances, JUnit, and the repo's own
gate — a short deterministic `axrl train` checked against the committed golden file."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from typer.testing import CliRunner

from axrl_debug.analysis.gate import parse_tol
from axrl_debug.cli import app
from axrl_debug.synthetic import TinySample, TinyToken, gen
from trace_util import make_run

ROOT = Path(__file__).resolve().parents[1]
GATE_CONFIG = ROOT / "examples" / "golden" / "ci_gate.yaml"
GATE_GOLDEN = ROOT / "examples" / "golden" / "ci_gate.golden.json"


def invoke(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def gate_run(path, losses=(0.5, 0.4, 0.3)):
    """`make_run` with one sample a step, step s's loss `losses[s]`."""
    def samples(s):
        return [TinySample([TinyToken(id=1), gen(0.5, 0.001 * (s + 1), version=s, id=2),
                            gen(0.25, -0.002, version=s, id=3), TinyToken(id=4, route_valid=0)], reward=0.25 * s)]
    return make_run(path, range(len(losses)), samples,
                    lambda s: {"loss": [losses[s]], "grad_norm": [2.0 + s], "lr": [1e-4]},
                    lambda s: {"loss": losses[s], "grad_norm": 2.0 + s, "reward": 0.25 * s, "clipfrac": 0.0})


@pytest.fixture()
def golden(tmp_path):
    run = gate_run(tmp_path / "run")
    path = tmp_path / "golden.json"
    r = invoke("golden", run, "-o", path, "--tol", "mismatch=1e-4")
    assert r.exit_code == 0, r.output
    return run, path


def test_golden_file_contents(golden):
    _, path = golden
    doc = json.loads(path.read_text())
    assert doc["format"] == "axrl-debug-golden" and doc["version"] == 1
    assert doc["metrics"] == ["reward", "loss", "grad_norm", "clipfrac", "mismatch", "mismatch_max", "kl_k3",
                              "routing_agreement", "generated_tokens"]
    assert [s["step"] for s in doc["steps"]] == [0, 1, 2]
    assert doc["steps"][1]["loss"] == 0.4 and doc["steps"][2]["grad_norm"] == 4.0
    assert doc["tolerances"] == {"mismatch": {"rtol": 1e-4}}
    assert doc["source"]["threads"] == 1 and "torch" in doc["source"]


def test_check_passes_on_the_same_run(golden, tmp_path):
    run, path = golden
    r = invoke("check", run, "--golden", path, "--junit", tmp_path / "report.xml")
    assert r.exit_code == 0, r.output
    assert "PASS: 27 values within tolerance" in r.stdout
    root = ET.parse(tmp_path / "report.xml").getroot()
    assert root.get("tests") == "27" and root.get("failures") == "0"


def test_tampered_metric_fails_and_is_named(golden, tmp_path):
    run, path = golden
    doc = json.loads(path.read_text())
    doc["steps"][1]["loss"] = 0.4 * (1 + 1e-3)            # moved by 1e-3 relative > rtol 1e-5
    path.write_text(json.dumps(doc))
    r = invoke("check", run, "--golden", path, "--junit", tmp_path / "report.xml")
    assert r.exit_code == 1
    out = r.stdout
    assert "what moved" in out and "FAIL: 1 of 27 values moved" in out
    moved = [line for line in out.splitlines() if line.startswith("1 ") and "loss" in line]
    assert moved and "moved" in moved[0]
    root = ET.parse(tmp_path / "report.xml").getroot()
    failures = [tc for tc in root.iter("testcase") if tc.find("failure") is not None]
    assert [tc.get("name") for tc in failures] == ["step 1: loss"]
    assert "golden 0.4004" in failures[0].find("failure").get("message")
    doc_json = json.loads(invoke("check", run, "--golden", path, "--json").stdout)
    assert doc_json["passed"] is False and doc_json["failed"] == 1
    assert doc_json["failures"][0]["metric"] == "loss" and doc_json["failures"][0]["step"] == 1
    # a per-metric tolerance lets it through; a global one too
    assert invoke("check", run, "--golden", path, "--tol", "loss=1e-2").exit_code == 0
    assert invoke("check", run, "--golden", path, "--rtol", "1e-2").exit_code == 0
    assert invoke("check", run, "--golden", path, "--tol", "loss=0,1e-3").exit_code == 0


def test_missing_step_and_bad_golden(golden, tmp_path):
    run, path = golden
    doc = json.loads(path.read_text())
    doc["steps"].append(dict(doc["steps"][-1], step=7))
    path.write_text(json.dumps(doc))
    r = invoke("check", run, "--golden", path)
    assert r.exit_code == 1 and "missing step" in r.stdout
    bad = tmp_path / "bad.json"
    bad.write_text('{"format": "something else"}')
    r = invoke("check", run, "--golden", bad)
    assert r.exit_code == 2 and "not an axrl-debug golden file" in " ".join(r.stderr.split())
    r = invoke("check", run, "--golden", path, "--tol", "nonsense")
    assert r.exit_code == 2 and "METRIC=RTOL" in " ".join(r.stderr.split())
    r = invoke("check", run, "--golden", path, "--tol", "bogus=1e-3")
    assert r.exit_code == 2 and "not in the golden file" in " ".join(r.stderr.split())


def test_parse_tol():
    assert parse_tol(["loss=1e-6", "mismatch=1e-4,1e-12"]) == {"loss": {"rtol": 1e-6},
                                                               "mismatch": {"rtol": 1e-4, "atol": 1e-12}}
    for bad in ["loss", "loss=", "=1", "loss=a", "loss=1,2,3", "loss=-1"]:
        with pytest.raises(ValueError):
            parse_tol([bad])


def test_repo_ci_gate(tmp_path):
    """The repo's own gate: re-run the short deterministic run and check it against the committed
    golden file (docs/debugging.md says how to regenerate both)."""
    golden = json.loads(GATE_GOLDEN.read_text())
    import torch

    # The release must match (ops change between releases); the build label (+cpu, +cu128, none on
    # PyPI's CUDA wheel) need not: the gate runs on the CPU whatever the build (runtime.device: cpu),
    # and another build's CPU kernels get the cross-CPU tolerances (cross_cpu_tolerances).
    if public_version(golden["source"].get("torch", "")) != public_version(torch.__version__):
        pytest.skip(f"golden made with torch {golden['source'].get('torch')}, this is {torch.__version__}: "
                    "regenerate it (docs/debugging.md, 'Check it in CI')")
    run = tmp_path / "gate"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", "from axrl.cli import app; app()", "train", str(GATE_CONFIG),
                           "--run-dir", str(run)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    # no tolerance on the command line: the golden file holds the tight one (its own machine) and
    # the cross-machine one, and `check` picks by the run's manifest
    r = invoke("check", run, "--golden", GATE_GOLDEN, "--junit", tmp_path / "gate.xml", "--json")
    assert r.exit_code == 0, r.stdout + r.stderr
    assert ET.parse(tmp_path / "gate.xml").getroot().get("failures") == "0"
    report = json.loads(r.stdout)
    tol = {m["metric"]: (m["rtol"], m["atol"]) for m in report["per_metric"]}
    if report["machine"]["same"]:
        assert tol["loss"] == (1e-5, 1e-12)
    else:
        assert tol["loss"] == (1e-3, 1e-9) and "another machine" in " ".join(report["notes"])


def test_the_golden_machine_keeps_the_tight_tolerance_and_others_get_the_stated_one(tmp_path):
    run = gate_run(tmp_path / "run")
    path = tmp_path / "golden.json"
    assert invoke("golden", run, "-o", path, "--cross-machine-tol", "loss=1e-2,1e-9").exit_code == 0
    doc = json.loads(path.read_text())
    assert doc["cross_machine_tolerances"] == {"loss": {"rtol": 1e-2, "atol": 1e-9}}
    doc["steps"][1]["loss"] = 0.4 * (1 + 1e-3)            # a 1e-3 move: beyond rtol 1e-5, within 1e-2
    path.write_text(json.dumps(doc))
    same = invoke("check", run, "--golden", path)
    assert same.exit_code == 1 and "FAIL" in same.stdout           # the golden's own machine: tight
    for key, value in (("cpu_flags", "0123456789ab"), ("cpu_capability", "AVX512"), ("platform", "Other-1.0")):
        other = {**doc, "source": {**doc["source"], key: value}}
        path.write_text(json.dumps(other))
        r = invoke("check", run, "--golden", path)
        assert r.exit_code == 0, r.output                          # another machine: the stated tolerance
        assert f"made on another machine than the golden's ({key}:" in " ".join(r.output.split())
    del other["cross_machine_tolerances"]
    path.write_text(json.dumps(other))
    r = invoke("check", run, "--golden", path)
    assert r.exit_code == 1 and "states no cross-machine tolerance" in " ".join(r.output.split())


def public_version(version: str) -> str:
    """A version without its local label: "2.13.0+cpu" -> "2.13.0"."""
    return version.split("+", 1)[0]
