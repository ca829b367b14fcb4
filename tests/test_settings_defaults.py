"""One type per component's settings (issue #37): the YAML section of a component IS the type its
constructor takes, so a run configured from YAML and one built from Python start from the same
defaults and the same validation. These tests fail when a section drifts back into a copy."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import BaseModel

from axrl.algo.distill import DistillSettings
from axrl.algo.loss_config import PolicyLossConfig
from axrl.assembly.settings import backend_settings, engine_settings, learner_settings, loop_settings, run_settings
from axrl.config import Config, load_config
from axrl.core.errors import ConfigError
from axrl.inference.sglang.settings import SGLangSettings
from axrl.inference.vllm.settings import VLLMSettings
from axrl.ray_executor.settings import RaySettings
from axrl.runtime.recording.tiers import TierSettings
from axrl.rollout.blackbox import AgentSettings
from axrl.inference.embedded.settings import EngineSettings
from axrl.runtime.evaluator import EvalSettings
from axrl.runtime.warmup import WarmupSettings
from axrl.train import TorchBackendConfig
from axrl.train.torch.lora import LoRAConfig
from axrl.train.megatron import MegatronBackendConfig
from axrl.train.megatron.settings import MegatronLayout
from axrl.train.protocol import R3Scope
from axrl.train.settings import BackendConfig, TrainSettings

# (YAML key path, the component's own type, the smallest YAML that turns an optional section on,
#  the same from Python). Required fields only where the type has no default for them.
COMPONENT_SECTIONS: list[tuple[str, type[BaseModel], dict[str, Any], dict[str, Any]]] = [
    ("rollout.sglang", SGLangSettings, {}, {}),
    ("rollout.vllm", VLLMSettings, {}, {}),
    ("runtime.ray", RaySettings, {}, {}),
    ("train.megatron", MegatronLayout, {}, {}),
    ("warmup", WarmupSettings, {}, {}),
    ("eval", EvalSettings, {}, {}),
    ("train.lora", LoRAConfig, {"train": {"lora": {}}}, {}),
    ("r3_scope", R3Scope, {"r3": True, "r3_scope": {}}, {}),
    ("distill", DistillSettings, {"distill": {"teacher": "t"}}, {"teacher": "t"}),
    ("agent", AgentSettings, {"agent": {"command": ["agent"]}, "runtime": {"deterministic": False}},
     {"command": ["agent"]}),
]


def _at(cfg: Config, path: str) -> Any:
    node: Any = cfg
    for part in path.split("."):
        node = getattr(node, part)
    return node


@pytest.mark.parametrize("path,kind,yaml_on,python_on", COMPONENT_SECTIONS, ids=[c[0] for c in COMPONENT_SECTIONS])
def test_component_defaults_equal_from_yaml_and_python(path: str, kind: type[BaseModel], yaml_on: dict[str, Any],
                                                        python_on: dict[str, Any]) -> None:
    """The section built from an empty YAML section is the component's type itself, equal to that
    type's own Python default (every field, hence every default)."""
    from_yaml = _at(Config.model_validate(yaml_on), path)
    from_python = kind(**python_on)
    assert type(from_yaml) is kind
    assert from_yaml == from_python
    assert from_yaml.model_dump() == from_python.model_dump()


def test_train_defaults_equal_from_yaml_and_python() -> None:
    """`train`'s optimizer keys are the backends' `TrainSettings`: the config's section, both
    backends' configs and what `axrl train` hands the backend start from the same values
    (lr 1e-4, weight_decay 0, micro_batch_tokens 4096 — the YAML's, which the Python API used to
    set otherwise)."""
    cfg = load_config(None)
    assert isinstance(cfg.train, TrainSettings)
    yaml_defaults = cfg.train.train_settings()
    assert yaml_defaults == TrainSettings().train_settings()
    for kind in (BackendConfig, TorchBackendConfig, MegatronBackendConfig):
        assert kind().train_settings() == yaml_defaults, kind.__name__
    built = backend_settings(cfg).config
    assert type(built) is TorchBackendConfig and built.train_settings() == yaml_defaults
    assert {k: v for k, v in MegatronBackendConfig().model_dump().items() if k in MegatronLayout.model_fields} \
        == MegatronLayout().model_dump()
    assert (yaml_defaults["lr"], yaml_defaults["weight_decay"], yaml_defaults["micro_batch_tokens"]) == (1e-4, 0.0, 4096)


def test_engine_defaults_equal_from_yaml_and_python() -> None:
    """`rollout`'s engine keys are the embedded engine's `EngineSettings` (prefix_cache on, as the
    YAML always had it)."""
    cfg = load_config(None)
    assert isinstance(cfg.rollout, EngineSettings)
    built = engine_settings(cfg)
    assert type(built) is EngineSettings and built == EngineSettings() and built.prefix_cache is True


def test_trace_tier_defaults_equal_from_yaml_and_python() -> None:
    """`trace`'s level keys are the recorder's `TierSettings`, with its rules."""
    cfg = load_config(None)
    assert isinstance(cfg.trace, TierSettings)
    built = learner_settings(cfg).record.tiers
    assert type(built) is TierSettings and built == TierSettings()


def test_algo_defaults_equal_from_yaml_and_python() -> None:
    """`algo` is the loss's `PolicyLossConfig` plus the advantage keys: its loss fields equal the
    loss's own defaults."""
    cfg = load_config(None)
    assert isinstance(cfg.algo, PolicyLossConfig)
    assert cfg.algo.loss_fields() == PolicyLossConfig()


def test_the_run_is_handed_the_sections_themselves() -> None:
    """No copy between the config and the components: what the assembly hands the agent, the
    evaluator, the warm-up and distillation is the config's own object."""
    cfg = Config.model_validate({"agent": {"command": ["agent"]}, "runtime": {"deterministic": False},
                                 "distill": {"teacher": "t"}})
    s = run_settings(cfg)
    assert s.rollout.agent is cfg.agent and s.rollout.eval is cfg.eval and s.learner.distill is cfg.distill
    assert loop_settings(cfg).warmup is cfg.warmup


@pytest.mark.parametrize("override,message", [
    ("train.lr=0", "train.lr: Input should be greater than 0"),
    ("train.micro_batch_tokens=-1", "train.micro_batch_tokens: Input should be greater than or equal to 0"),
    ("train.megatron.expert_parallel=3", "train.megatron: Value error, expert_parallel=3 must divide"),
    ("train.lora.targets=[mlp,bogus]", "train.lora.targets: Value error, unknown target(s) ['bogus']"),
    ("agent.timeout_s=0", "agent.timeout_s: Input should be greater than 0"),
    ("eval.prompts=0", "eval.prompts: Input should be greater than or equal to 1"),
    ("warmup.batch_size=0", "warmup.batch_size: Input should be greater than or equal to 1"),
    ("distill.coef=2", "distill: Value error, distill: set exactly one of `teacher`"),
    ("trace.routing_every=2", "trace: Value error, routing_every: applies to level standard only"),
])
def test_bad_values_name_the_yaml_key(override: str, message: str) -> None:
    """A component's own validation still reports the YAML key path (`--set` and files alike)."""
    overrides = [override]
    if override.startswith("train.megatron"):
        overrides += ["train.backend=megatron", "train.megatron.data_parallel=2"]
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert message in str(e.value)


def test_the_same_validation_from_python() -> None:
    """The same rules refuse the same values from Python (one validation)."""
    with pytest.raises(ValueError, match="greater than 0"):
        TorchBackendConfig(lr=0)
    with pytest.raises(ValueError, match="unknown target"):
        LoRAConfig(targets=("bogus",))
    with pytest.raises(ValueError, match="exactly one of"):
        AgentSettings()
    with pytest.raises(ValueError, match="exactly one of"):
        DistillSettings()


def test_trace_spike_defaults_equal_from_yaml_and_python() -> None:
    """`trace.spike_*` are the spike trigger's `SpikeSettings`, with its validation."""
    from axrl.runtime.spike_trigger import SpikeSettings

    cfg = load_config(None)
    assert isinstance(cfg.trace, SpikeSettings)
    built = learner_settings(cfg).record.spike
    assert type(built) is SpikeSettings and built == SpikeSettings()
    with pytest.raises(ValueError, match="spike_ratio"):
        SpikeSettings(spike_ratio=0.5)


def test_faults_are_the_runtime_faults_type() -> None:
    """`faults` is `axrl.runtime.faults.Faults` itself: what the step trainer applies is what the
    YAML validated, with no copy in between."""
    from axrl.assembly.settings import step_settings
    from axrl.runtime.faults import Faults

    cfg = load_config(None, ["faults.lr_scale={step: 2, factor: 10}", "seed=7"])
    assert type(cfg.faults) is Faults and load_config(None).faults == Faults()
    s = step_settings(cfg)
    assert s.faults is cfg.faults and s.seed == 7
    assert (s.lr_scale_at(2), s.lr_scale_at(1)) == (10.0, 1.0)
