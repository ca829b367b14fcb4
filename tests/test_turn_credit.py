"""Turn-level credit (`algo.credit: turn`, axrl.algo.turn_credit): per-turn advantages against a
reference written from the formula, `credit: outcome` unchanged, black-box per-turn rewards through
the proxy, and a short calculator run whose steps replay bitwise."""

from __future__ import annotations

import json

import h5py
import httpx
import numpy as np
import pytest
import torch

from agent_util import ScriptedEngine, calculator_policy
from train_util import debug, train
from axrl.agents.proxy import ProxyServer, SessionPolicy, engine_submit
from axrl.agents.tasks.calculator import CalculatorConfig, CalculatorEnv
from axrl.algo.advantages import token_advantages
from axrl.algo.processor import AdvantageSettings, AlgorithmProcessor
from axrl.config import ConfigError, load_config
from axrl.core.trajectory import Trajectory
from axrl.inference.protocol import SamplingParams
from axrl.tokenizer import Tokenizer

torch.set_num_threads(1)
EPS = 1e-6


def episode(sample_id: int, group_id: int, turn_rewards: list[float], reward: float | None = None,
            tokens_per_turn: int = 2, status: str = "ok") -> Trajectory:
    """A prompt, then per turn `tokens_per_turn` generated tokens and one env token."""
    t = Trajectory(sample_id=sample_id, group_id=group_id, prompt_id=f"p{group_id}", status=status)
    t.append([1, 2], generated=False, turn=0)
    for k in range(1, len(turn_rewards) + 1):
        t.append([10 + k] * tokens_per_turn, generated=True, turn=k, version=0, logprobs=[-0.5] * tokens_per_turn)
        t.append([7], generated=False, turn=k)
    t.num_turns = len(turn_rewards)
    t.turn_rewards = list(turn_rewards)
    t.reward = float(sum(turn_rewards)) if reward is None else reward
    return t


def reference(trajs: list[Trajectory], gamma: float, normalize_std: bool) -> np.ndarray:
    """Token advantages by hand, from the docstring's formula (float64, no shared code)."""
    returns = {}
    for i, t in enumerate(trajs):
        r = list(t.turn_rewards) + [0.0] * (t.num_turns - len(t.turn_rewards))
        r[-1] += t.reward - sum(t.turn_rewards)                     # remainder on the last turn
        for k in range(1, t.num_turns + 1):
            returns[i, k] = sum(gamma ** (j - k) * r[j - 1] for j in range(k, t.num_turns + 1))
    adv = {}
    for (i, k), g in returns.items():
        peers = [returns[j, k] for j, u in enumerate(trajs) if u.group_id == trajs[i].group_id
                 and (j, k) in returns and u.status == "ok"]
        mean, std = np.mean(peers), np.std(peers)                    # population std (ddof 0)
        a = (g - mean) / (std + EPS) if normalize_std else g - mean
        adv[i, k] = a if len(peers) > 1 and trajs[i].status == "ok" else 0.0
    return np.concatenate([[adv[i, k] if m else 0.0 for m, k in zip(t.loss_mask, t.turn)]
                           for i, t in enumerate(trajs)])


def batch() -> list[Trajectory]:
    return [episode(0, 0, [0.2, 0.0, 1.0]), episode(1, 0, [0.0, 1.0]), episode(2, 0, [0.5]),
            episode(3, 0, [0.2, 0.0, 0.0], reward=0.7),             # a final reward beyond the turns
            episode(4, 1, [0.0, 0.3]), episode(5, 1, [0.1, 0.0, 0.0, 0.4]),
            episode(6, 1, [1.0, 1.0], status="failed"), episode(7, 2, [0.3, 0.3])]


@pytest.mark.parametrize("gamma,normalize_std", [(0.9, True), (1.0, False), (0.5, True)])
def test_turn_advantages_match_the_formula(gamma, normalize_std):
    trajs = batch()
    estimator = "grpo" if normalize_std else "dr_grpo"
    p = AlgorithmProcessor(settings=AdvantageSettings(estimator, credit="turn", gamma=gamma))(trajs)
    want = reference(trajs, gamma, normalize_std)
    np.testing.assert_allclose(p.batch.advantages.numpy(), want, rtol=1e-5, atol=1e-6)
    # turns of one sample really differ, and the sample advantage is its first turn's
    adv0 = p.batch.advantages.numpy()[p.batch.offsets[0]:p.batch.offsets[1]]
    assert len(set(adv0[trajs[0].loss_mask == 1].round(5))) == 3
    first = [want[int(p.batch.offsets[i]) + 2] for i in range(len(trajs))]  # token 2: turn 1's first
    np.testing.assert_allclose(p.sample_advantages.numpy(), first, rtol=1e-5, atol=1e-6)
    # the per-turn rewards are recorded per token
    assert p.turn_rewards is not None and p.turn_rewards[2:4].tolist() == [0.2, 0.2]


def test_outcome_credit_is_unchanged():
    trajs = batch()
    p = AlgorithmProcessor(settings=AdvantageSettings("grpo"))(trajs)
    # the pre-turn-credit pipeline, spelled out: one advantage per sample, broadcast to its tokens
    ok = np.array([t.status == "ok" for t in trajs])
    n = np.array([t.num_generated * ok[i] for i, t in enumerate(trajs)], np.float64)
    adv = AdvantageSettings("grpo").sample_advantages(np.array([t.reward for t in trajs]),
                                                     np.array([t.group_id for t in trajs]), ok, n)
    want = token_advantages(adv, p.batch.offsets, p.batch.loss_mask)
    assert p.batch.advantages.numpy().tobytes() == want.numpy().tobytes()
    assert p.sample_advantages.numpy().tobytes() == adv.numpy().tobytes()
    # rewards only on the last turn: no /tokens/turn_reward, so default traces do not change
    last_only = [episode(0, 0, [0.0, 1.0]), episode(1, 0, [0.0, 0.0, 0.0])]
    assert AlgorithmProcessor()(last_only).turn_rewards is None
    assert p.turn_rewards is not None   # this batch is rewarded before last turns


def test_turn_credit_with_final_rewards_only_is_the_outcome_advantage():
    # γ = 1, one turn count, rewards at the end: every turn's return is the total reward
    trajs = [episode(i, 0, [0.0, r]) for i, r in enumerate([1.0, 0.0, 0.5, 0.0])]
    outcome = AlgorithmProcessor()(trajs).batch.advantages
    turn = AlgorithmProcessor(settings=AdvantageSettings("grpo", credit="turn"))(trajs).batch.advantages
    assert turn.numpy().tobytes() == outcome.numpy().tobytes()


def test_config_validates_credit():
    cfg = load_config(None, ["algo.credit=turn", "algo.gamma=0.9"])
    assert (cfg.algo.credit, cfg.algo.gamma) == ("turn", 0.9)
    assert load_config(None, []).algo.credit == "outcome"
    for bad in (["algo.credit=step"], ["algo.gamma=1.5"], ["algo.credit=turn", "algo.advantage=reinforce"]):
        with pytest.raises(ConfigError):
            load_config(None, bad)


def test_calculator_turn_reward_on_the_first_successful_call():
    from axrl.agents.env import Prompt
    env = CalculatorEnv(CalculatorConfig(turn_reward=0.25))
    env.reset(Prompt(prompt_id="q", text="What is 2 + 3?", fields={"expression": "2 + 3", "answer": 5}))
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "%s"}}</tool_call>'
    assert env.step(call % "2 +").reward == 0.0          # does not evaluate: no credit
    assert env.step(call % "2 + 3").reward == 0.25       # first success
    assert env.step(call % "2 + 3").reward == 0.0        # once per episode
    assert env.step("The answer is 5.").reward == 1.0


def test_white_box_step_rewards_reach_the_trajectory_per_turn():
    import asyncio
    from axrl.agents.tasks import TASKS
    from axrl.rollout.agent_loop import run_episode
    tok = Tokenizer.default()
    task = TASKS["calculator"](turn_reward=0.25, show_tool_schema=False)
    traj = asyncio.run(run_episode(ScriptedEngine(calculator_policy(tok)), tok, task.make_env(), task.prompt(0, 1),
                                   sample_id=0, group_id=0, sampling=SamplingParams(max_new_tokens=64),
                                   max_turns=3, max_context_len=1024))
    assert traj.num_turns == 2 and traj.turn_rewards == [0.25, 1.0] and traj.reward == 1.25
    assert set(traj.turn[traj.loss_mask == 1].tolist()) == {1, 2}


# ---------------------------------------------------------------------------- black-box agents
QUESTION = [{"role": "system", "content": "Use the calculator tool, then reply: The answer is N."},
            {"role": "user", "content": "What is 37 + 58?"}]
TOOLS = [{"type": "function", "function": {"name": "calculator", "description": "exact arithmetic",
                                           "parameters": {"type": "object",
                                                          "properties": {"expression": {"type": "string"}}}}}]


def test_proxy_turn_rewards_reach_the_trajectory_and_the_advantage():
    import openai
    tok = Tokenizer.default()
    trajs = []
    with ProxyServer(tok, model_name="policy") as proxy:
        for i, (first, final) in enumerate([(0.5, 1.0), (0.0, 1.0)]):
            sampling = SamplingParams(max_new_tokens=48, stop_token_ids=tok.stop_token_ids)
            session = proxy.open_session(engine_submit(ScriptedEngine(calculator_policy(tok))),
                                         SessionPolicy(sampling, max_tokens=48), max_context_len=512)
            client = openai.OpenAI(base_url=proxy.base_url(session), api_key=session.api_key, max_retries=0)
            messages = list(QUESTION)
            msg = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS).choices[0].message
            messages.append(msg.model_dump(exclude_none=True))
            messages.append({"role": "tool", "tool_call_id": msg.tool_calls[0].id, "content": "95"})
            client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
            auth = {"Authorization": f"Bearer {session.api_key}"}
            for body in ({"reward": first, "turn": 1}, {"reward": final}):
                assert httpx.post(f"{proxy.url}/sessions/{session.id}/reward", json=body,
                                  headers=auth).status_code == 200
            (traj,) = session.trajectories(sample_id=i, group_id=0, prompt_id="q")
            proxy.close_session(session)
            assert traj.turn_rewards == [first, 0.0] and traj.reward == first + final
            trajs.append(traj)
    p = AlgorithmProcessor(settings=AdvantageSettings("grpo", credit="turn"))(trajs)
    adv = p.batch.advantages.numpy()
    np.testing.assert_allclose(adv, reference(trajs, 1.0, True), rtol=1e-5, atol=1e-6)
    # turn 1 (the rewarded call) separates the two samples; turn 2 (same final reward) does not
    turn = np.concatenate([t.turn for t in trajs])
    mask = p.batch.loss_mask.numpy() > 0
    assert adv[mask & (turn == 1)].max() > 0.9 and np.all(adv[mask & (turn == 2)] == 0)
    assert set(np.round(p.turn_rewards[mask & (turn == 1)], 6)) == {0.0, 0.5}


# ---------------------------------------------------------------------------- a run, replayed
RUN = ["steps=2", "model.preset=micro-moe", "warmup.steps=30", "data.prompts_per_step=2", "rollout.group_size=4",
       "rollout.max_new_tokens=24", "eval.every=0", "checkpoint.every=2", "runtime.threads=1",
       "data.task_args={show_tool_schema: false, turn_reward: 0.2}", "algo.credit=turn", "algo.gamma=0.9"]


def test_turn_credit_run_records_turn_rewards_and_replays_bitwise(tmp_path):
    run = tmp_path / "run"
    train(run, RUN)
    with h5py.File(run / "trace" / "step_000001.h5") as f:
        turn_reward, turn, offsets = f["tokens/turn_reward"][:], f["tokens/turn"][:], f["samples/offsets"][:]
        assert turn_reward.shape == turn.shape and np.all(turn_reward[turn == 0] == 0)
    replay = debug("replay", run, "--step", 1, "--json")
    doc = json.loads(replay.stdout)
    assert replay.exit_code == 0 and doc["verdict"] == "bitwise-equal", doc["first_divergence"]
    # summary --json: per step and turn index, the samples that reached it and its mean reward
    summary = debug("summary", run, "--json")
    turns = json.loads(summary.stdout)["turns"]
    assert [r["step"] for r in turns] == [0, 1]
    first = turns[1]["turns"][0]
    assert first["turn"] == 1 and first["samples"] == 8
    per_sample = [turn_reward[a:b][turn[a:b] == 1][0] for a, b in zip(offsets[:-1], offsets[1:])]
    assert first["reward_mean"] == pytest.approx(np.mean(per_sample))
    # what-ifs recompute advantages from the recorded per-turn rewards: the same bits
    from replay import load_recorded_step
    from replay.whatif import recompute_advantages
    cfg = load_config(run / "config.yaml", [])
    for step in (0, 1):
        rec = load_recorded_step(run / "trace" / f"step_{step:06d}.h5", cfg)
        assert recompute_advantages(rec, cfg).numpy().tobytes() == rec.batch.advantages.numpy().tobytes()
