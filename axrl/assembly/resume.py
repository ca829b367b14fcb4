"""What `axrl train --resume` continues with, said out loud.

A resumed run continues with the config recorded in its run directory (`RUN/config.yaml`), plus
the `--set` overrides given on the command line. The CONFIG file given on the command line is
*not* applied (it may have been edited since, or belong to another run): every key where it
(with the same `--set` on top) differs from the recorded config is reported as ignored. Keys that define what the run is — its
seed, model, data, group size, engine and trainer — cannot change mid-run: an override of one,
or a given config that differs in one, is refused before any work starts, naming the keys.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from axrl.config import Config, config_to_dict, load_config
from axrl.core.errors import ConfigError

#: Config keys (and sections) a resumed run cannot change: the recorded steps would no longer
#: be the same run's (prompts, sample identities, weights layout, what the warm-up produced).
FROZEN = ("seed", "model", "data", "rollout.group_size", "rollout.engine", "train.backend", "train.megatron",
          "warmup")


@dataclass
class ResumeConfig:
    cfg: Config
    notes: list[str] = field(default_factory=list)   # what to tell the user before resuming


def flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested config dict → {"dotted.key": value}."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def config_diff(a: Config, b: Config) -> dict[str, tuple[Any, Any]]:
    """{dotted key: (a's value, b's value)} for every key where the two configs differ."""
    fa, fb = flatten(config_to_dict(a)), flatten(config_to_dict(b))
    return {k: (fa.get(k), fb.get(k)) for k in sorted(set(fa) | set(fb)) if fa.get(k) != fb.get(k)}


def frozen(key: str) -> bool:
    return any(key == f or key.startswith(f + ".") for f in FROZEN)


def _listing(diff: dict[str, tuple[Any, Any]]) -> str:
    return ", ".join(f"{k} ({a!r} → {b!r})" for k, (a, b) in diff.items())


def resume_config(run_dir: Path, given: Path | None, overrides: list[str]) -> ResumeConfig:
    """The config `--resume` continues `run_dir` with, and what to say about it. Raises
    ConfigError (naming keys) for changes a resumed run cannot take."""
    recorded_path = Path(run_dir) / "config.yaml"
    if not recorded_path.is_file():
        raise ConfigError(f"--resume: {run_dir} is not a run directory (no config.yaml); start a new run "
                          f"with `axrl train CONFIG --run-dir {run_dir}` instead")
    recorded = load_config(recorded_path)
    cfg = load_config(recorded_path, overrides)
    notes = [f"resuming with the run's recorded config {recorded_path}"]
    applied = config_diff(recorded, cfg)
    refused = {k: v for k, v in applied.items() if frozen(k)}
    if refused:
        raise ConfigError(f"--resume: {_listing(refused)} cannot change mid-run; start a new run (another "
                          "--run-dir) to train with it")
    if cfg.train.lr_schedule != "constant" and recorded.steps != cfg.steps:
        raise ConfigError(f"--resume: changing steps ({recorded.steps} → {cfg.steps}) would change the "
                          f"'{cfg.train.lr_schedule}' learning-rate schedule of steps already trained")
    if applied:
        notes.append(f"applied from --set: {_listing(applied)}")
    if given is not None and given.is_file() and given.resolve() != recorded_path.resolve():
        # What the command line asked for as a whole (the file with the same --set on top) against
        # what the run is: re-issuing the original command is no change at all.
        ignored = {k: v for k, v in config_diff(recorded, load_config(given, overrides)).items() if k not in applied}
        refused = {k: v for k, v in ignored.items() if frozen(k)}
        if refused:
            raise ConfigError(f"--resume: {given} differs from the run's recorded config in keys that cannot change "
                              f"mid-run: {_listing(refused)} (recorded → given). Resume without it "
                              f"(`axrl train {recorded_path} --run-dir {run_dir} --resume`), or start a new run in "
                              "another --run-dir")
        if ignored:
            notes.append(f"ignored from {given} (the run keeps its recorded values; --set KEY=VALUE changes "
                         f"one): {_listing(ignored)}")
    return ResumeConfig(cfg, notes)
