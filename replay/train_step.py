"""Deterministic re-execution of a recorded training step (the trainer side; the engine side is
`replay/rollout.py` and `replay/engine_path.py`).

    result = replay_step("runs/demo", 12, dump=True, variants=[["algo.tis=false"]])
    result.verdict            # "bitwise-equal" | "diverged"
    result.first_divergence   # Divergence(step, update, micro_batch, quantity, recorded, replayed, ...)

How: build the trainer exactly as `axrl train` does (`make_train_backend` from config.yaml),
load the newest checkpoint at or before N (older ones if it is damaged), re-run the recorded
updates of the steps in between — batches rebuilt from the trace, updates run by the loop's own
`run_updates` — checking each step against its recording, then step N. For step N the old
logprobs (and trainer routing, entropy) are recomputed too and compared, since the loop computed
them in the same process before the updates. Everything goes through the TrainBackend protocol
(`--dump` additionally hooks the torch model when the backend has one).
"""

from __future__ import annotations

import dataclasses
import json
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from axrl.config import Config, ConfigError, load_config
from axrl.runtime.checkpoint import load_checkpoint
from axrl.tinker_api.training import replay_service_step, service_forward
from axrl.assembly.build import make_tokenizer, make_train_backend, policy_loss
from axrl.assembly.settings import routing_replay, step_settings
from axrl.runtime.results import CriticStep, UpdateResult
from axrl.runtime.updates import CombinedHooks, run_updates, train_critic
from axrl.tokenizer import Tokenizer
from axrl.trace import StepFile, TraceError
from axrl.train.protocol import TrainBackend
from replay.compare import Divergence, compare_tensor, compare_updates, same_bits
from replay.dump import DumpProbe, dump_path
from replay.environment import REQUIREMENTS, current_environment, environment_warnings
from replay.plan import ReplayInputError, ReplayPlan, RunInventory
from replay.recorded import RecordedStep, load_recorded_step
from replay.sweep import Ranked, family_variants, rank_variants
from replay.whatif import UpdateSizes, Variant, VariantResult, parse_variant, run_variant, summarize

Progress = Callable[[str], None]


@dataclass
class StepReplay:
    """One re-executed step: recorded vs replayed numbers and what differed."""

    step: int
    recorded: RecordedStep
    results: list[UpdateResult]
    mismatches: list[Divergence]
    seconds: float                        # re-execution of the updates
    old_forward_seconds: float | None = None  # step N only: the old-logprob forward
    critic: CriticStep | None = None      # the critic's re-executed updates (algo.advantage: gae)

    @property
    def bitwise_equal(self) -> bool:
        return not self.mismatches

    def to_dict(self) -> dict[str, Any]:
        updates = []
        for u, (r, res) in enumerate(zip(self.recorded.updates, self.results)):
            mbs = []
            for j, row in enumerate(res.metrics.micro_batches):
                rec_loss = r.micro_batches[j]["loss"] if j < len(r.micro_batches) else None
                mbs.append({"micro_batch": j, "num_tokens": int(row["num_tokens"]),
                            "loss": _pair(rec_loss, row["loss"])})
            updates.append({
                "update": u, "samples": len(r.samples),
                "loss": _pair(r.values["loss"], res.metrics.loss),
                "grad_norm": _pair(r.values["grad_norm"], res.stats.grad_norm),
                "lr": _pair(r.values["lr"], res.stats.lr),
                "fingerprint_after": {"recorded": r.fingerprint_after, "replayed": res.fingerprint,
                                      "equal": r.fingerprint_after in (None, res.fingerprint)},
                "micro_batches": mbs})
        replayed_fp = self.results[-1].fingerprint if self.results else None
        wt = self.recorded.wall_times
        critic = None
        if self.critic is not None:
            rc = self.recorded.critic
            critic = {name: {"recorded": rc.get(key), "replayed": replayed, "equal": rc.get(key) == replayed}
                      for name, key, replayed in (
                          ("fingerprint_after", "critic_fingerprint_after", self.critic.fingerprint_after),
                          ("value_loss", "critic_value_loss", _value_losses(self.critic)))}
        return {"step": self.step, "critic": critic, "bitwise_equal": self.bitwise_equal, "updates": updates,
                "fingerprint_after": {"recorded": self.recorded.fingerprint_after, "replayed": replayed_fp,
                                      "equal": replayed_fp == self.recorded.fingerprint_after},
                "mismatches": [m.to_dict() for m in self.mismatches],
                "seconds": self.seconds, "old_forward_seconds": self.old_forward_seconds,
                "recorded_train_seconds": wt.get("train"), "recorded_prepare_seconds": wt.get("prepare")}


def _value_losses(c: CriticStep) -> str:
    """The critic updates' value losses as the trace records them (`records.critic_attrs`)."""
    return " ".join(repr(float(u.value_loss)) for u in c.updates)


def _rerun_critic(backend: TrainBackend, rec: RecordedStep, s: int) -> tuple[CriticStep | None, list[Divergence]]:
    """Re-run step `s`'s critic updates (after the policy's, as the loop does) from the recorded
    values and returns, and compare its weights before/after and value losses with the trace."""
    critic = getattr(backend, "critic", None)
    if critic is None:
        return None, []
    if rec.values is None or rec.returns is None:
        raise ReplayInputError(f"{rec.path}: the run trains a critic but the step has no /tokens/value and "
                               "/tokens/return to re-run its updates from")
    out, rc = [], rec.critic
    before = critic.fingerprint()
    if before != rc.get("critic_fingerprint_before"):
        out.append(Divergence(s, None, None, "critic_fingerprint_before", rc.get("critic_fingerprint_before"), before,
                              detail="the critic's weights this step starts from differ from the recording"))
    done = train_critic(critic, rec.batch, rec.group_ids, rec.values, rec.returns)
    for name, recorded, replayed in (("critic_value_loss", rc.get("critic_value_loss"), _value_losses(done)),
                                     ("critic_fingerprint_after", rc.get("critic_fingerprint_after"),
                                      done.fingerprint_after)):
        if recorded != replayed:
            out.append(Divergence(s, None, None, name, recorded, replayed))
    return done, out


def _pair(recorded: Any, replayed: Any) -> dict[str, Any]:
    rec = None if recorded is None else (recorded.item() if hasattr(recorded, "item") else recorded)
    return {"recorded": rec, "replayed": replayed,
            "equal": rec is not None and same_bits(recorded, replayed)}


@dataclass
class ReplayResult:
    run: Path
    step: int
    checkpoint_step: int
    steps: list[StepReplay]
    warnings: list[str]
    environment: dict[str, Any]
    timings: dict[str, float]
    dump_path: Path | None = None
    baseline: list[dict[str, float]] = field(default_factory=list)
    variants: list[VariantResult] = field(default_factory=list)
    sweep: str | None = None                 # the family `--sweep` ran (its variants are `variants`)
    ranking: list[Ranked] = field(default_factory=list)

    @property
    def mismatches(self) -> list[Divergence]:
        return [m for s in self.steps for m in s.mismatches]

    @property
    def first_divergence(self) -> Divergence | None:
        ms = self.mismatches
        return ms[0] if ms else None

    @property
    def verdict(self) -> str:
        return "bitwise-equal" if not self.mismatches else "diverged"

    @property
    def target(self) -> StepReplay:
        return self.steps[-1]

    def to_dict(self) -> dict[str, Any]:
        first = self.first_divergence
        return {
            "run": str(self.run), "step": self.step, "verdict": self.verdict,
            "first_divergence": None if first is None else first.to_dict(),
            "checkpoint_step": self.checkpoint_step,
            "replayed_steps": [s.step for s in self.steps],
            "steps": [s.to_dict() for s in self.steps],
            "warnings": self.warnings, "requirements": REQUIREMENTS, "environment": self.environment,
            "timings": self.timings,
            "dump": None if self.dump_path is None else str(self.dump_path),
            "baseline": self.baseline, "variants": [v.to_dict() for v in self.variants],
            "sweep": None if self.sweep is None else {"family": self.sweep,
                                                      "ranking": [r.to_dict() for r in self.ranking]},
        }


def _checkpoint_meta(path: Path) -> dict[str, Any] | None:
    """The backend's own checkpoint metadata when it has one (torch: trainer_state.json)."""
    p = path / "trainer_state.json"
    try:
        return json.loads(p.read_text()) if p.is_file() else None
    except (OSError, ValueError):
        return None


def replay_step(run_dir: str | Path, step: int, *, dump: bool = False, dump_to: Path | None = None,
                variants: Sequence[Sequence[str]] = (), sweep: str | None = None,
                progress: Progress | None = None) -> ReplayResult:
    """Re-execute `step` of the run bit for bit, optionally dump it, run what-if variants and a
    sweep family (`replay.sweep.FAMILIES`) ranked by how much each variant reduces the spike.

    Raises ReplayInputError (with the nearest usable step) when the input cannot be replayed.
    """
    say = progress or (lambda msg: None)
    inv = RunInventory(run_dir)
    plan = inv.plan(step)
    config_path = inv.run / "config.yaml"
    try:
        cfg = load_config(config_path)
    except ConfigError as e:
        raise ReplayInputError(f"{config_path}: {e}") from None
    parsed: list[Variant] = [parse_variant(config_path, v) for v in variants]  # bad input before any work
    # Building the trainer sets the process-wide thread count from the recorded config; give the
    # caller its own back afterwards.
    threads_before = torch.get_num_threads()
    try:
        return _replay(_Request(inv, cfg, step, plan, parsed, dump, dump_to, say), sweep)
    finally:
        torch.set_num_threads(threads_before)


def load_start(inv: RunInventory, plan: ReplayPlan, backend: TrainBackend, step: int,
                say: Progress) -> tuple[int, Path, list[str]]:
    """Load the newest loadable checkpoint ≤ step (older ones when it is damaged); returns its step,
    path and notes (fall-backs taken, the backend's own warnings such as a config difference)."""
    notes: list[str] = []
    for k, path in [(plan.checkpoint_step, plan.checkpoint_path)] + plan.older_checkpoints:
        if not all(inv.readable(s) for s in range(k, step + 1)):
            continue  # an older checkpoint only helps if every step after it is readable
        say(f"loading checkpoint {path.name}")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                load_checkpoint(path, backend)
            except (ValueError, FileNotFoundError, OSError, KeyError) as e:
                notes.append(f"checkpoint {path} is unusable ({e}); trying an older one")
                continue
        return k, path, notes + [str(w.message) for w in caught]
    raise ReplayInputError.for_step(f"no loadable checkpoint at or before step {step}: " + "; ".join(notes),
                                    inv, step)


def service_ranks(cfg: Config) -> int:
    """The data-parallel ranks a service step's calls were split over (a Ray train group of torch
    ranks; 1 otherwise)."""
    return cfg.runtime.ray.train_ranks if cfg.runtime.executor == "ray" and cfg.train.backend == "torch" else 1


def _check_prepare(rec: RecordedStep, backend: TrainBackend, cfg: Config) -> list[Divergence]:
    """Redo the loop's prepare-phase forward (old logprobs, entropy, trainer routing) and compare.
    No-grad and stateless, so it changes nothing the updates depend on."""
    if rec.service is not None:   # a Tinker-API step: the forward as its calls (and their shares) ran it
        old = service_forward(backend, rec.batch, rec.service[0], service_ranks(cfg))
    else:
        old = backend.forward(dataclasses.replace(rec.batch, old_logprobs=None), r3=routing_replay(cfg))
    out = []
    for name, recorded, replayed in (("old_logprob", rec.batch.old_logprobs.numpy(), old.logprobs),
                                     ("entropy", rec.entropy, old.entropy),
                                     ("routing_train", rec.routing_train, old.routed_experts),
                                     ("value", None if rec.values is None else rec.values.numpy(), _critic_values(backend, rec))):
        if recorded is not None and replayed is not None:
            d = compare_tensor(rec.step, name, recorded, replayed)
            if d is not None:
                out.append(d)
    return out


def _critic_values(backend: TrainBackend, rec: RecordedStep) -> torch.Tensor | None:
    """The critic's values of the step's trained tokens as GAE used them (None without a critic)."""
    critic = getattr(backend, "critic", None)
    if critic is None:
        return None
    m = rec.batch.loss_mask > 0
    return torch.where(m, critic.values(rec.batch), torch.zeros(m.shape))


def _sweep_variants(inv: RunInventory, cfg: Config, step: int, family: str, backend: TrainBackend) -> list[Variant]:
    """The sweep family's variants for this run and step (validated before any work)."""
    try:
        with StepFile(inv.files[step]) as sf:
            routing = "/routing/rollout" in sf
    except (TraceError, OSError) as e:
        raise ReplayInputError.for_step(f"step file {inv.files[step]} is unreadable: {e}", inv, step) from None
    return [parse_variant(inv.run / "config.yaml", v)
            for v in family_variants(family, cfg, backend.model_config, routing)]


@dataclass
class _Request:
    """What `replay_step` was asked, validated: the run, its config, the step and its plan, the
    what-if variants, the dump and where progress goes."""

    inv: RunInventory
    cfg: Config
    step: int
    plan: ReplayPlan
    variants: list[Variant]
    dump: bool
    dump_to: Path | None
    say: Progress


def _replay(req: _Request, sweep: str | None) -> ReplayResult:
    t0 = time.perf_counter()
    tokenizer = make_tokenizer(req.cfg)
    try:
        backend = make_train_backend(req.cfg, tokenizer)  # exactly as `axrl train` builds it
    except (NotImplementedError, ValueError, OSError) as e:
        raise ReplayInputError(f"cannot build the trainer from {req.inv.run / 'config.yaml'}: {e}") from None
    try:
        if sweep is not None:
            req = dataclasses.replace(
                req, variants=req.variants + _sweep_variants(req.inv, req.cfg, req.step, sweep, backend))
        result = _replay_on(backend, tokenizer, req, t0)
    finally:
        backend.close()
    if sweep is not None:
        result.sweep = sweep
        result.ranking = rank_variants(result.baseline, result.variants)
    return result


def _replay_on(backend: TrainBackend, tokenizer: Tokenizer, req: _Request, t0: float) -> ReplayResult:
    """Load the start checkpoint, re-run the steps from it to `req.step` (the last one instrumented),
    then dump and run the what-if variants."""
    inv, cfg, step, say = req.inv, req.cfg, req.step, req.say
    k0, ckpt, notes = load_start(inv, req.plan, backend, step, say)
    timings: dict[str, float] = {"load_seconds": time.perf_counter() - t0}
    env = current_environment(cfg)
    warns = environment_warnings(inv.reader.manifest, env, _checkpoint_meta(ckpt)) + notes
    for w in warns:
        say(f"warning: {w}")

    steps: list[StepReplay] = []
    target: _Instruments | None = None
    t_catch = time.perf_counter()
    for s in range(k0, step + 1):
        rec = _load_recorded(inv, cfg, s, step)
        mismatches = _check_weights_before(backend, rec, s)
        if s == step:
            timings["catch_up_seconds"] = time.perf_counter() - t_catch
            say(f"re-executing step {s} ({len(rec.updates)} update(s)) and comparing bit for bit")
            target = instruments = _instrument(backend, rec, cfg, req.variants, req.dump)
            mismatches += target.mismatches
        else:
            say(f"re-running step {s} ({len(rec.updates)} update(s)) to rebuild the state before step {step}")
            instruments = _Instruments(loss_fn=policy_loss(cfg))
        steps.append(_rerun_step(backend, rec, cfg, s, mismatches, instruments, say))

    assert target is not None  # the loop's last step is the target
    timings.update(_step_timings(steps[-1]))
    sizes = target.sizes.sizes if target.sizes is not None else ()
    result = ReplayResult(run=inv.run, step=step, checkpoint_step=k0, steps=steps, warnings=warns,
                          environment=env, timings=timings, baseline=summarize(steps[-1].results, sizes))
    if target.probe is not None:
        _write_dump(result, target.probe, req.dump_to or dump_path(inv.run, step), say)
    for v in req.variants:
        say(f"what-if: {v.label}")
        assert target.state_before is not None
        result.variants.append(run_variant(v, cfg, steps[-1].recorded, target.state_before, tokenizer, inv.run))
    return result


@dataclass
class _Instruments:
    """How one step's updates run: the loss function and hooks, and for the target step what was
    taken before them (the what-ifs' start state, the dump probe, the update sizes, the prepare check)."""

    loss_fn: Any
    hooks: Any = None
    probe: DumpProbe | None = None
    sizes: UpdateSizes | None = None
    state_before: dict[str, Any] | None = None
    old_seconds: float | None = None
    mismatches: list[Divergence] = field(default_factory=list)


def _load_recorded(inv: RunInventory, cfg: Config, s: int, step: int) -> RecordedStep:
    """Step `s`'s recording, or ReplayInputError (the file damaged; R3 routing missing)."""
    path = inv.files[s]
    try:
        rec = load_recorded_step(path, cfg)
    except (TraceError, ValueError, OSError, KeyError) as e:
        inv.mark_bad(s)
        raise ReplayInputError.for_step(f"step file {path} is damaged or incomplete: {e}", inv, step) from None
    if cfg.r3 and rec.batch.routed_experts is None and not rec.dense(cfg):
        raise ReplayInputError(f"step {s} was trained with r3 but {path} has no /routing/rollout "
                               "(trace.routing was off, or trace.level standard skipped it: trace.routing_every): "
                               "its forced routing cannot be re-applied")
    return rec


def _check_weights_before(backend: TrainBackend, rec: RecordedStep, s: int) -> list[Divergence]:
    fp = backend.fingerprint()
    if fp == rec.fingerprint_before:
        return []
    return [Divergence(s, None, None, "weights_fingerprint_before", rec.fingerprint_before, fp,
                       detail="the weights this step starts from differ from the recording")]


def _instrument(backend: TrainBackend, rec: RecordedStep, cfg: Config, variants: list[Variant],
                dump: bool) -> _Instruments:
    """Before the target step's updates: keep the what-ifs' start state, redo and check the prepare
    forward, hook the dump probe and the update-size recorder."""
    loss_fn: Any = policy_loss(cfg)
    state_before = backend.state_dict() if variants else None  # what-if variants start from here
    t_old = time.perf_counter()
    mismatches = _check_prepare(rec, backend, cfg)
    old_seconds = time.perf_counter() - t_old
    probe = None
    if dump:
        probe = DumpProbe(backend, loss_fn, rec.batch, rec.splits, r3=routing_replay(cfg))
        loss_fn = probe.loss_fn
    sizes = UpdateSizes(backend) if variants else None  # what-ifs compare update sizes too
    return _Instruments(loss_fn=loss_fn, hooks=CombinedHooks(probe, sizes), probe=probe, sizes=sizes,
                        state_before=state_before, old_seconds=old_seconds, mismatches=mismatches)


def _rerun_step(backend: TrainBackend, rec: RecordedStep, cfg: Config, s: int, mismatches: list[Divergence],
                inst: _Instruments, say: Progress) -> StepReplay:
    """Run step `s`'s recorded updates and compare them (and the weights after) with the recording."""
    t_up = time.perf_counter()
    try:
        if rec.service is not None:   # a step a Tinker-API loop drove (axrl/service): its calls, then AdamW
            results = replay_service_step(backend, rec.batch, *rec.service, ranks=service_ranks(cfg))
        else:
            results = run_updates(backend, rec.batch, rec.splits, inst.loss_fn, r3=routing_replay(cfg),
                                  lr_scale=step_settings(cfg).lr_scale_at(s), hooks=inst.hooks)
    finally:
        if inst.probe is not None:
            inst.probe.close()
    up_s = time.perf_counter() - t_up
    mismatches += compare_updates(rec, results)
    if results and results[-1].fingerprint != rec.fingerprint_after:
        mismatches.append(Divergence(s, None, None, "weights_fingerprint_after", rec.fingerprint_after,
                                     results[-1].fingerprint))
    critic, critic_mismatches = _rerun_critic(backend, rec, s)
    mismatches += critic_mismatches
    if mismatches:
        say(f"step {s}: DIVERGED — {mismatches[0].describe()}")
    return StepReplay(s, rec, results, mismatches, up_s, inst.old_seconds, critic)


def _step_timings(target: StepReplay) -> dict[str, float]:
    """The target step's re-execution times, beside the recorded ones."""
    timings = {"updates_seconds": target.seconds, "old_forward_seconds": target.old_forward_seconds or 0.0,
               "step_seconds": target.seconds + (target.old_forward_seconds or 0.0)}
    wt = target.recorded.wall_times
    if "train" in wt:
        timings["recorded_train_seconds"] = wt["train"]
        timings["recorded_step_seconds"] = wt["train"] + wt.get("prepare", 0.0)
    return timings


def _write_dump(result: ReplayResult, probe: DumpProbe, path: Path, say: Progress) -> None:
    first = result.first_divergence
    result.dump_path = probe.write(path, updates=result.baseline, attrs={
        "step": result.step, "run": str(result.run), "verdict": result.verdict,
        "checkpoint_step": result.checkpoint_step, "source": "replay",
        "first_divergence": "" if first is None else first.describe()})
    say(f"wrote {result.dump_path}")
