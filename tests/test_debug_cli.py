"""`axrl-debug` commands through typer's CliRunner: exit codes 0/1/2, one JSON document with
--json, bad-input messages, damaged step files reported once and skipped, --help everywhere."""

from __future__ import annotations

import json
import re

import h5py
import pytest
from typer.testing import CliRunner

from axrl_debug.cli import app
from axrl_debug.synthetic import TinySample, TinyToken, gen, tiny_record, write_run
from trace_util import make_run

COMMANDS = ["summary", "mismatch", "spikes", "diff", "export", "golden", "check"]


def samples(step: int) -> list[TinySample]:
    d = 0.01 * (step + 1)
    return [TinySample([TinyToken(id=1), gen(0.5, d, version=step, id=2, advantage=1.0),
                        gen(0.4, -d, version=step, id=3, advantage=1.0), TinyToken(id=4, route_valid=0)],
                       reward=1.0),
            TinySample([TinyToken(id=5), gen(0.3, 2 * d, version=step, id=6, advantage=-1.0),
                        TinyToken(id=7, route_valid=0)], reward=0.0)]


def cli_run(path, steps=(0, 1, 2, 3, 4), metrics=True):
    """`make_run` of `samples`, loss 0.1 × (step + 1), with metrics.jsonl when `metrics`."""
    return make_run(path, steps, samples,
                    lambda s: {"loss": [0.1 * (s + 1)], "grad_norm": [1.0], "lr": [1e-4], "clipfrac": [0.0]},
                    (lambda s: {"loss": 0.1 * (s + 1), "reward": 0.5, "grad_norm": 1.0, "clipfrac": 0.0})
                    if metrics else None)


def invoke(*args: str):
    return CliRunner().invoke(app, [str(a) for a in args])


def one_json(result) -> dict:
    """--json prints exactly one JSON document on stdout (human text goes to stderr)."""
    text = result.stdout.strip()
    assert text.count("\n") == 0, text[:500]
    return json.loads(text)


@pytest.mark.parametrize("cmd", COMMANDS)
def test_help(cmd):
    r = invoke(cmd, "--help")
    assert r.exit_code == 0 and "Usage" in r.stdout
    if cmd not in ("diff",):
        assert "--json" in r.stdout


def test_summary_and_json(tmp_path):
    run = cli_run(tmp_path / "run")
    r = invoke("summary", run)
    assert r.exit_code == 0, r.output
    assert "mean|Δ|" in r.stdout and "worst mismatch: step 4" in " ".join(r.stdout.split())
    doc = one_json(invoke("summary", run, "--json"))
    assert [s["step"] for s in doc["steps"]] == [0, 1, 2, 3, 4]
    s0 = doc["steps"][0]
    for key in ("reward", "loss", "grad_norm", "clipfrac", "mismatch", "kl_k3", "routing_agreement",
                "version_lag_mean", "spikes", "weights_fingerprint_after"):
        assert key in s0, key
    assert s0["loss"] == pytest.approx(0.1) and s0["reward"] == 0.5         # from metrics.jsonl
    assert doc["sources"]["loss"] == "metrics.jsonl"
    assert doc["worst"]["mismatch"]["step"] == 4 and doc["problems"] == []


def test_summary_without_metrics_jsonl_uses_step_files(tmp_path):
    run = cli_run(tmp_path / "run", metrics=False)
    doc = one_json(invoke("summary", run, "--json"))
    assert doc["sources"]["loss"] == "step files"
    assert doc["steps"][2]["loss"] == pytest.approx(0.3) and doc["steps"][2]["reward"] == 0.5


def test_mismatch_json_shape_and_steps(tmp_path):
    run = cli_run(tmp_path / "run")
    doc = one_json(invoke("mismatch", run, "--steps", "1:2", "--json", "--top", "2"))
    assert doc["steps"] == [1, 2]
    assert set(doc) >= {"run", "steps", "thresholds", "tokens", "metrics", "breakdowns", "routing", "top",
                        "per_step", "problems"}
    assert set(doc["breakdowns"]) == {"position", "turn", "rollout_prob", "entropy", "version_lag"}
    assert len(doc["top"]) == 2 and doc["top"][0]["step"] == 2
    assert doc["tokens"]["analysed"] == 6
    human = invoke("mismatch", run, "--step", "3")
    assert human.exit_code == 0 and "KL k3" in human.stdout and "top 3 tokens" in human.stdout


def test_mismatch_plots(tmp_path):
    run = cli_run(tmp_path / "run")
    r = invoke("mismatch", run, "--plot", tmp_path / "plots", "--json")
    doc = one_json(r)
    names = sorted(p.split("/")[-1] for p in doc["plots"])
    assert "mismatch_abs_delta_hist.png" in names and "mismatch_breakdowns.png" in names
    assert all((tmp_path / "plots" / n).read_bytes()[:4] == b"\x89PNG" for n in names)


@pytest.mark.parametrize("args,needle", [
    (["summary", "{tmp}/nope"], "run directory not found"),
    (["mismatch", "{tmp}/empty"], "not an AxRL run directory"),
    (["mismatch", "{run}", "--step", "7"], "step 7 is not in the trace"),
    (["mismatch", "{run}", "--steps", "9:12"], "no steps in 9:12"),
    (["mismatch", "{run}", "--steps", "x"], "--steps expects A:B"),
    (["mismatch", "{run}", "--steps", "3:1"], "start 3 is after end 1"),
    (["mismatch", "{run}", "--step", "1", "--steps", "1:2"], "either --step or --steps"),
    (["export", "{run}", "--format", "xlsx", "--out", "{tmp}/x"], "--format must be one of"),
    (["spikes", "{run}", "--metrics", "loss,bogus"], "unknown metric(s) ['bogus']"),
    (["check", "{run}", "--golden", "{tmp}/missing.json"], "golden file not found"),
    (["diff", "{run}", "{tmp}/nope"], "run directory not found"),
])
def test_bad_input_exits_2(tmp_path, args, needle):
    run = cli_run(tmp_path / "run", steps=(0, 1, 5))
    (tmp_path / "empty").mkdir()
    argv = [a.format(tmp=tmp_path, run=run) for a in args]
    r = invoke(*argv)
    assert r.exit_code == 2, r.output
    assert needle in " ".join(r.stderr.split()), r.stderr
    assert r.stdout.strip() == ""


def test_missing_step_names_nearest(tmp_path):
    run = cli_run(tmp_path / "run", steps=(0, 1, 5, 9))
    r = invoke("mismatch", run, "--step", "3")
    msg = " ".join(r.stderr.split())
    assert r.exit_code == 2 and "nearest available: 1, 5" in msg and "available: 0-1, 5, 9" in msg


def test_unknown_schema_version_exits_2(tmp_path):
    run = cli_run(tmp_path / "run")
    m = json.loads((run / "manifest.json").read_text())
    m["schema_version"] = 99
    (run / "manifest.json").write_text(json.dumps(m))
    r = invoke("summary", run)
    assert r.exit_code == 2 and "unknown schema_version 99" in " ".join(r.stderr.split())


def test_truncated_step_reported_once_and_skipped(tmp_path):
    run = cli_run(tmp_path / "run")
    bad = run / "trace" / "step_000002.h5"
    bad.write_bytes(bad.read_bytes()[:300])
    for cmd in ("summary", "mismatch", "spikes", "golden"):
        extra = ["-o", str(tmp_path / "g.json")] if cmd == "golden" else []
        r = invoke(cmd, run, *extra)
        assert r.exit_code == 0, (cmd, r.output)
        assert r.stderr.count("step_000002.h5") == 1, (cmd, r.stderr)     # once, with its path
    doc = one_json(invoke("summary", run, "--json"))
    assert [s["step"] for s in doc["steps"]] == [0, 1, 3, 4]
    assert len(doc["problems"]) == 1 and str(bad) in doc["problems"][0]
    r = invoke("mismatch", run, "--step", "2")
    flat = r.stderr.replace("\n", "")   # rich folds the long path at the console width
    assert r.exit_code == 2 and "damaged" in flat and str(bad) in flat


@pytest.mark.parametrize("compiled", [False, True])
def test_corrupt_chunk_found_while_reading_is_skipped(tmp_path, monkeypatch, compiled):
    """A chunk whose checksum fails passes the reader's structural scan; the analysis reports it
    when it reads the data and carries on with the other steps — whether HDF5's filter (numpy path)
    or the compiled reader (large traces) verifies the checksum."""
    from axrl_debug.analysis import mismatch

    monkeypatch.setattr(mismatch, "COMPILED_MIN_BYTES", 0 if compiled else 1 << 62)
    run = cli_run(tmp_path / "run")
    bad = run / "trace" / "step_000003.h5"
    with h5py.File(bad, "r") as f:
        info = f["/tokens/old_logprob"].id.get_chunk_info(0)
    with open(bad, "r+b") as fh:
        fh.seek(info.byte_offset + info.size // 2)
        fh.write(b"\xde\xad\xbe\xef" * 2)
    doc = one_json(invoke("mismatch", run, "--json"))
    assert doc["steps"] == [0, 1, 2, 4]
    assert len(doc["problems"]) == 1 and "step_000003.h5" in doc["problems"][0]
    assert "/tokens/old_logprob" in doc["problems"][0]


def test_every_step_damaged_is_bad_input(tmp_path):
    run = cli_run(tmp_path / "run", steps=(0,))
    p = run / "trace" / "step_000000.h5"
    p.write_bytes(b"not hdf5")
    r = invoke("summary", run)
    assert r.exit_code == 2 and "no readable step files" in " ".join(r.stderr.split())


def test_spikes_cli(tmp_path):
    recs, rows = [], []
    for s in range(10):
        loss = 5.0 if s == 7 else 1.0 + 0.01 * (s % 3)
        recs.append(tiny_record(s, s, samples(s), update_metrics={"loss": [loss], "grad_norm": [1.0], "lr": [1e-4]}))
        rows.append({"step": s, "loss": loss, "grad_norm": 1.0, "reward": 0.5})
    write_run(tmp_path / "run", recs, metrics=rows)
    doc = one_json(invoke("spikes", tmp_path / "run", "--json", "--metrics", "loss"))
    assert [(s["step"], s["metric"], s["direction"]) for s in doc["spikes"]] == [(7, "loss", "up")]
    att = doc["attributions"][0]
    assert att["step"] == 7 and att["source"] == "proxy" and att["samples_by_loss"]
    human = invoke("spikes", tmp_path / "run", "--metrics", "loss")
    assert human.exit_code == 0 and re.search(r"step 7 \(loss up\)", human.stdout)
    quiet = invoke("spikes", tmp_path / "run", "--metrics", "grad_norm")
    assert quiet.exit_code == 0 and "no spikes" in quiet.stdout


def test_console_entry_imports_only_the_invoked_command_and_still_works():
    """`axrl-debug CMD` loads just CMD's module (fast start) yet parses like the full app."""
    import subprocess
    import sys

    code = ("import sys; sys.argv = ['axrl-debug', 'summary', '/nonexistent/run']; import axrl_debug.cli as c; "
            "print(sorted(m for m in sys.modules if m.startswith('axrl_debug.commands.') and m[20:] != '_common')); "
            "c.app()")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 2, done.stderr
    assert "axrl_debug.commands.summary" in done.stdout and "axrl_debug.commands.tui" not in done.stdout
    assert "run directory not found" in " ".join(done.stderr.split())
    full = subprocess.run([sys.executable, "-m", "axrl_debug.cli", "--help"], capture_output=True, text=True)
    assert full.returncode == 0
    for name in ("summary", "mismatch", "spikes", "diff", "export", "golden", "check", "replay", "tui"):
        assert name in full.stdout
