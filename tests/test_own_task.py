"""Bring your own task: `data.task` as `module:function`, `file.py:function`, an Env class or an
`axrl.tasks` entry point, and `data.reward` for prompt files — loaded without editing AxRL, checked
before any model is built, and trained for real (the docs' example task included)."""

from __future__ import annotations

import json
import re
import textwrap
from pathlib import Path

import numpy as np
import pytest

from axrl.agents.tasks.resolve import resolve_task
from axrl.config import ConfigError, load_config
from axrl.tokenizer import Tokenizer
from axrl.trace import StepFile
from train_util import train

ROOT = Path(__file__).resolve().parents[1]
FAST = ["steps=1", "warmup.steps=2", "data.prompts_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=8",
        "eval.every=0", "runtime.threads=1"]

MODULE = '''
from axrl.agents.env import Prompt, StepOutcome
from axrl.agents.tasks.common import Task

class Countdown:
    """Multi-turn: the user says a number, the assistant must say the next lower one, N turns."""
    tools = []
    def __init__(self, turns):
        self.turns = turns
    def reset(self, prompt):
        self.n, self.left, self.score = prompt.fields["start"], self.turns, 0.0
        return [{"role": "user", "content": str(self.n)}]
    def step(self, action):
        self.n, self.left = self.n - 1, self.left - 1
        self.score += action.strip() == str(self.n)
        if self.left == 0:
            return StepOutcome([], self.score / self.turns, True)
        return StepOutcome([{"role": "user", "content": str(self.n)}])

def prompt(seed, index):
    return Prompt(prompt_id=f"cd-{seed}-{index}", text="ignored", fields={"start": 50 + index})

def demonstration(p):
    n, out = p.fields["start"], [{"role": "user", "content": str(p.fields["start"])}]
    for i in range(TURNS):
        out.append({"role": "assistant", "content": str(n - 1 - i)})
        if i + 1 < TURNS:
            out.append({"role": "user", "content": str(n - 1 - i)})
    return out

TURNS = 2

def make_task(turns=2):
    global TURNS
    TURNS = turns
    return Task(name="countdown", make_env=lambda: Countdown(turns), prompt=prompt, demonstration=demonstration)

def score(prompt, response):
    return min(len(response), 10) / 10.0
'''


@pytest.fixture
def user_module(tmp_path, monkeypatch) -> str:
    name = f"user_tasks_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(MODULE))
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


def _data(**data):
    return load_config(None, [f"data.{k}={json.dumps(v) if not isinstance(v, str) else v}"
                              for k, v in data.items()]).data


def test_task_from_a_temporary_module_trains(user_module, tmp_path):
    task = resolve_task(_data(task=f"{user_module}:make_task", task_args={"turns": 3}), warmup=True, evaluate=True)
    assert task.name == "countdown" and task.make_env().turns == 3
    train(tmp_path / "run", [*FAST, f"data.task={user_module}:make_task", "data.task_args={turns: 2}"])
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert manifest["extra"]["task"] == "countdown"
    with StepFile(tmp_path / "run" / "trace" / "step_000000.h5") as sf:
        assert set(sf["/samples/num_turns"].tolist()) <= {1, 2} and sf["/samples/num_turns"].max() == 2


def test_task_from_a_file_path_and_an_env_class(user_module, tmp_path):
    path = tmp_path / f"{user_module}.py"
    task = resolve_task(_data(task=f"{path}:make_task"), warmup=True, evaluate=True)
    assert task.name == "countdown"
    env_task = resolve_task(_data(task=f"{user_module}:Countdown", task_args={"turns": 4}, path="p.jsonl"),
                            warmup=False, evaluate=False)
    assert env_task.make_env().turns == 4 and env_task.prompt is None


def test_entry_point_group(user_module, tmp_path, monkeypatch):
    dist = tmp_path / "plugins" / "my_tasks-1.0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: my-tasks\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(f"[axrl.tasks]\ncountdown = {user_module}:make_task\n")
    monkeypatch.syspath_prepend(str(tmp_path / "plugins"))
    assert resolve_task(_data(task="countdown"), warmup=True, evaluate=True).name == "countdown"
    with pytest.raises(ValueError, match=r"installed \(axrl.tasks\): \['countdown'\]"):
        resolve_task(_data(task="nope"), warmup=False, evaluate=False)


@pytest.mark.parametrize("data,kw,needle", [
    ({"task": "no_such_module_xyz:make"}, {}, "cannot import 'no_such_module_xyz'"),
    ({"task": "MOD:nothing"}, {}, "has no attribute 'nothing'"),
    ({"task": "MOD:TURNS"}, {}, "is a int: expected a Task"),
    ({"task": "MOD:make_task", "task_args": {"laps": 1}}, {}, "does not take them (got an unexpected keyword argument 'laps')"),
    ({"task": "MOD:Countdown", "task_args": {"turns": 1}}, {"evaluate": True, "warmup": False},
     "no prompt generator, which the prompts needs; set data.path"),
    ({"task": "MOD:Countdown", "task_args": {"turns": 1}, "path": "p.jsonl"}, {"evaluate": False, "warmup": True},
     "no prompt generator, which the supervised warm-up needs; set warmup.steps: 0"),
    ({"reward": "MOD:score", "path": "p.jsonl"}, {"evaluate": True, "warmup": False},
     "held-out evaluation needs; set eval.every: 0"),
])
def test_bad_task_specs_are_explained(user_module, data, kw, needle):
    data = {k: v.replace("MOD", user_module) if isinstance(v, str) else v for k, v in data.items()}
    with pytest.raises(ValueError, match=re.escape(needle)):
        resolve_task(_data(**data), **{"warmup": False, "evaluate": False, **kw})


def test_reward_needs_a_prompt_file():
    with pytest.raises(ConfigError, match="set data.path"):
        load_config(None, ["data.reward=m:f"])


def test_reward_function_scores_a_prompt_file(user_module, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"Say something about {w}."}) + "\n"
                               for w in ("cats", "rain", "maps")))
    train(tmp_path / "run", [*FAST, f"data.reward={user_module}:score", f"data.path={prompts}", "warmup.steps=0"],
          config=ROOT / "examples" / "arithmetic.yaml")
    tok = Tokenizer.default()
    with StepFile(tmp_path / "run" / "trace" / "step_000000.h5") as sf:
        off, ids, plen, reward = sf["/samples/offsets"], sf["/tokens/ids"], sf["/samples/prompt_len"], sf["/samples/reward"]
        for i in range(len(reward)):
            reply = ids[int(off[i]) + int(plen[i]):int(off[i + 1])].tolist()
            text = tok.decode(reply[:-1] if reply and reply[-1] == tok.eos_token_id else reply)
            assert reward[i] == np.float32(min(len(text), 10) / 10.0)


def _doc_block(doc: Path, heading: str, lang: str) -> str:
    text = doc.read_text()
    section = text[text.index(heading):]
    return section[section.index(f"```{lang}\n") + len(lang) + 4:].split("\n```", 1)[0] + "\n"


def test_docs_custom_task_is_the_example_file_and_its_command_runs(tmp_path, monkeypatch):
    doc = ROOT / "docs" / "agents.md"
    assert _doc_block(doc, "## Your own task", "python") == (ROOT / "examples" / "custom_task.py").read_text()
    command = _doc_block(doc, "## Your own task", "bash").strip()
    assert command == "axrl train examples/custom_task.yaml"
    monkeypatch.chdir(ROOT)          # the config names the file relative to the repository
    train(tmp_path / "run", [*FAST, "warmup.steps=4"], config=Path("examples/custom_task.yaml"))
    with StepFile(tmp_path / "run" / "trace" / "step_000000.h5") as sf:
        assert "stock" in Tokenizer.default().decode(sf["/tokens/ids"][: int(sf["/samples/offsets"][1])].tolist())
