"""reasoning-gym tasks (`data.task: reasoning_gym`): the library's prompts, its answer extraction and
its datasets' own score_answer, eval questions disjoint from training, bad task_args named, and two
real training steps recorded, analysed by `axrl-debug mismatch` and replayed bitwise.

Uses the real package (reasoning-gym==0.1.25, in the `test` extra; it leaves torch alone)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import reasoning_gym as rg  # noqa: E402  (the test extra installs it: a broken install must fail, not skip)

from reasoning_gym.utils import SYSTEM_PROMPTS, extract_answer  # noqa: E402

from axrl.agents.env import env_action  # noqa: E402
from axrl.agents.tasks import TASKS  # noqa: E402
from axrl.agents.tasks.resolve import resolve_task  # noqa: E402
from axrl.config import load_config  # noqa: E402
from axrl.tokenizer import Tokenizer  # noqa: E402
from axrl.trace import StepFile  # noqa: E402
from train_util import debug, train  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
ARITH = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1, "operators": ["+"],
         "allow_parentheses": False, "allow_negation": False}
MIX = [{"name": "letter_counting", "weight": 1, "config": {"min_words": 1, "max_words": 2}},
       {"name": "basic_arithmetic", "weight": 1, "config": ARITH}]


def make(**options):
    return TASKS["reasoning_gym"](**options)


def questions(task, seed, n=150):
    return {task.prompt(seed, i).messages[-1]["content"] for i in range(n)}


def test_prompts_are_the_librarys_format_and_deterministic():
    task = make(name="basic_arithmetic", config=ARITH, system_prompt="direct")
    p = task.prompt(0, 7)
    entry = rg.create_dataset("basic_arithmetic", seed=0, size=2**31, **ARITH)[p.fields["rg_index"]]
    assert p.messages == [{"role": "system", "content": SYSTEM_PROMPTS["direct"]},
                          {"role": "user", "content": entry["question"]}]
    assert p.fields["answer"] == str(entry["answer"]) and task.prompt(0, 7) == p
    assert make(name="basic_arithmetic", config=ARITH, system_prompt=None).prompt(0, 7).messages[0]["role"] == "user"


@pytest.mark.parametrize("options", [dict(name="basic_arithmetic", config=ARITH), dict(datasets=MIX)])
def test_eval_and_warmup_questions_never_equal_training_questions(options):
    """Streams seed (train), seed+1 (warm-up), seed+2 (eval) draw from disjoint question buckets,
    even for a config with ~150 distinct questions, where plain reseeding would collide."""
    task = make(**options)
    train_q, warm_q, eval_q = (questions(task, s) for s in (0, 1, 2))
    assert len(eval_q) > 20 and not (train_q & eval_q) and not (warm_q & eval_q) and not (train_q & warm_q)


@pytest.mark.parametrize("options", [dict(name="basic_arithmetic", config=ARITH), dict(datasets=MIX)])
def test_reward_is_the_datasets_own_score_of_the_extracted_answer(options):
    task = make(**options)
    sources = set()
    for i in range(30):
        p = task.prompt(0, i)
        env = task.make_env()
        env.reset(p)
        entry = env._dataset[p.fields["rg_index"]]
        sources.add(entry["metadata"]["source_dataset"])
        for reply in (f"<answer>{p.fields['answer']}</answer>", "<answer>12</answer>", p.fields["answer"],
                      f"<answer>x{p.fields['answer']}</answer>", "<answer>1</answer> <answer>2</answer>"):
            env = task.make_env()
            env.reset(p)
            out = env.step(reply)
            assert out.done and out.reward == env._dataset.score_answer(extract_answer(reply), entry)
        demo = task.demonstration(p)
        env = task.make_env()
        env.reset(p)
        assert env.step(demo[-1]["content"]).reward == 1.0
    assert sources == {s.get("name", "basic_arithmetic") for s in options.get("datasets", [{}])}


@pytest.mark.parametrize("options, needle", [
    (dict(name="no_such_dataset"), "no_such_dataset"),
    (dict(name="basic_arithmetic", config={"min_termz": 2}), "min_termz"),
    (dict(name="basic_arithmetic", datasets=MIX), "exactly one of 'name'"),
    (dict(datasets=[]), "'datasets' is empty"),
    (dict(datasets=[{"weight": 1}]), "needs 'name'"),
    (dict(name="basic_arithmetic", system_prompt="chatty"), "system_prompt"),
    (dict(name="basic_arithmetic", seed=3), "unknown option"),
])
def test_bad_task_args_are_named(options, needle):
    with pytest.raises(ValueError, match=None) as err:
        make(**options)
    assert needle in str(err.value)


def test_resolved_from_config_with_warmup_and_eval():
    cfg = load_config(ROOT / "examples" / "reasoning_gym_mix.yaml", [])
    task = resolve_task(cfg.data, warmup=True, evaluate=True)
    assert task.name == "reasoning_gym:letter_counting+basic_arithmetic"


FAST = ["steps=2", "warmup.steps=4", "data.prompts_per_step=4", "rollout.group_size=2", "rollout.max_new_tokens=8",
        "eval.every=0", "runtime.threads=1", "checkpoint.every=1"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    path = tmp_path_factory.mktemp("rg") / "run"
    train(path, FAST, config=ROOT / "examples" / "reasoning_gym_arithmetic.yaml")
    return path


def test_two_steps_train_and_the_trace_rewards_are_the_librarys_scores(run):
    tok = Tokenizer.default()
    task = make(name="basic_arithmetic", config=ARITH, system_prompt="direct")
    ds = task.make_env()._dataset
    scored = 0
    for step in (0, 1):
        with StepFile(run / "trace" / f"step_{step:06d}.h5") as sf:
            ids, off = sf["/tokens/ids"][:], sf["/samples/offsets"][:]
            plen, rewards = sf["/samples/prompt_len"][:], sf["/samples/reward"][:]
            pids = [x.decode() if isinstance(x, bytes) else str(x) for x in sf["/samples/prompt_id"][:]]
        for i, pid in enumerate(pids):
            seed, index = (int(x) for x in pid.rsplit("-", 2)[1:])
            prompt = task.prompt(seed, index)
            assert pid == prompt.prompt_id
            reply = env_action(tok, tok.decode(ids[off[i] + plen[i]:off[i + 1]].tolist()))
            assert rewards[i] == ds.score_answer(extract_answer(reply), ds[prompt.fields["rg_index"]])
            scored += 1
    assert scored == 2 * 4 * 2


def test_the_run_is_analysed_and_replayed_like_any_run(run):
    out = debug("mismatch", run, "--step", 1, "--json")
    assert out.exit_code == 0, out.output
    replay = debug("replay", run, "--step", 1, "--json")
    assert replay.exit_code == 0, replay.output
    assert json.loads(replay.stdout)["verdict"] == "bitwise-equal"
