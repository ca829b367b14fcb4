"""Black-box episodes: the unmodified example agent (official openai SDK) run as a process per
episode, crashing and hanging agents, and `axrl train` end to end on a config with `agent`."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest

from agent_util import ScriptedEngine, calculator_policy
from axrl.agents.proxy import ProxyServer
from axrl.agents.tasks import TASKS
from axrl.inference.protocol import SamplingParams
from axrl.rollout.blackbox import AgentSettings, BlackBoxPlayer, load_callable
from axrl.rollout.pool import TrajectoryPool

pytestmark = pytest.mark.timeout(300)
ROOT = Path(__file__).resolve().parents[1]
AGENT = ["python", str(ROOT / "examples/agents/calculator_agent.py")]
VERIFIER = f"{ROOT / 'examples/agents/calculator_reward.py'}:score"


def play(tok, agent: AgentSettings, engine, prompt, sample_id=3):
    sampling = SamplingParams(max_new_tokens=48, stop_token_ids=tok.stop_token_ids, seed=11)
    with ProxyServer(tok) as proxy:
        player = BlackBoxPlayer(agent, proxy, max_context_len=512)
        traj = asyncio.run(player.play(engine, sample_id=sample_id, group_id=1, prompt=prompt, sampling=sampling,
                                       return_routing=False))
        assert len(proxy.registry) == 0  # the finished session is collected
    return traj


def test_the_example_agent_runs_unmodified_and_is_scored(tok):
    source = (ROOT / "examples/agents/calculator_agent.py").read_text()
    assert "axrl" not in source.replace("AxRL", "") .split('"""', 2)[2]  # no AxRL import, only the SDK
    prompt = TASKS["calculator"]().prompt(0, 4)
    engine = ScriptedEngine(calculator_policy(tok))
    traj = play(tok, AgentSettings(command=AGENT, verifier=load_callable(VERIFIER, "agent.verifier")), engine, prompt)
    assert traj.status == "ok", traj.error
    assert traj.reward == 1.0 and traj.num_turns == 2 and traj.finish_reason == "stop"
    assert traj.session_id and traj.fork_of == -1 and not traj.forks and traj.drift_tokens == 0
    assert traj.info["agent_exit_code"] == 0
    # the agent's two calls became one token stream: the second request extends the first
    first, second = engine.requests
    assert second.input_ids[: len(first.input_ids)] == first.input_ids
    assert traj.token_ids.tolist() == second.input_ids + calculator_policy(tok)(second.input_ids)
    assert first.sampling_params.seed is not None  # seeded from the sample, as white-box episodes


def test_an_agents_sdk_agent_runs_unchanged(tok):
    """examples/agents/calculator_agents_sdk.py: the OpenAI Agents SDK's own loop, unmodified."""
    import agents  # noqa: F401  (openai-agents: the test extra installs it)
    prompt = TASKS["calculator"]().prompt(0, 4)
    engine = ScriptedEngine(calculator_policy(tok))
    command = ["python", str(ROOT / "examples/agents/calculator_agents_sdk.py")]
    traj = play(tok, AgentSettings(command=command, verifier=load_callable(VERIFIER, "agent.verifier")), engine, prompt)
    assert traj.status == "ok", traj.error
    assert traj.reward == 1.0 and traj.num_turns == 2 and not traj.forks and traj.drift_tokens == 0
    first, second = engine.requests
    assert second.input_ids[: len(first.input_ids)] == first.input_ids  # stitched: one sample


def test_a_crashing_agent_fails_its_trajectory(tok):
    prompt = TASKS["calculator"]().prompt(0, 1)
    crash = [sys.executable, "-c", "import sys; print('boom: bad tool', file=sys.stderr); sys.exit(3)"]
    traj = play(tok, AgentSettings(command=crash), ScriptedEngine(calculator_policy(tok)), prompt)
    assert traj.status == "failed" and traj.finish_reason == "failed" and traj.reward == 0.0
    assert "exited with code 3" in traj.error and "boom: bad tool" in traj.error
    assert traj.info["agent_exit_code"] == 3
    assert traj.num_tokens > 0 and traj.num_generated == 0  # the prompt, nothing to train
    # a failed episode still completes its group (the step goes on without it)
    pool = TrajectoryPool(1)
    assert pool.add(traj)


def test_a_hanging_agent_is_killed_at_the_timeout(tok):
    prompt = TASKS["calculator"]().prompt(0, 2)
    hang = [sys.executable, "-c", "import time; time.sleep(60)"]
    traj = play(tok, AgentSettings(command=hang, timeout_s=1.0), ScriptedEngine(calculator_policy(tok)), prompt)
    assert traj.status == "failed" and traj.error.startswith("timeout") and "agent.timeout_s=1" in traj.error


def test_a_function_agent_and_a_forked_session_pool_together(tok):
    """`agent.function`: the same SDK agent in a thread; a session with a retry yields two paths."""
    import openai

    def agent(base_url: str, api_key: str, prompt: str) -> None:
        client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
        msgs = [{"role": "user", "content": prompt}]
        client.chat.completions.create(model="m", messages=msgs)
        client.chat.completions.create(model="m", messages=msgs)  # a retry: the same history again

    prompt = TASKS["calculator"]().prompt(0, 3)
    engine = ScriptedEngine(lambda p: tok.encode("The answer is 5.") + [tok.eos_token_id])
    traj = play(tok, AgentSettings(function=agent), engine, prompt, sample_id=8)
    assert traj.status == "ok" and len(traj.forks) == 1 and traj.forks[0].fork_of == 8
    pool = TrajectoryPool(1)
    assert pool.add(traj)  # the group of size 1 is complete with its episode; the fork comes along
    batch, _ = pool.seal(0, 1, lambda g: True)
    assert sorted(t.sample_id for t in batch.trajectories) == [8, traj.forks[0].sample_id]


@pytest.mark.timeout(900)
def test_axrl_train_with_an_agent_end_to_end(tmp_path):
    """`axrl train` on examples/blackbox.yaml (shortened, asynchronous): the agent process per
    episode, the trace's session columns, the staleness bound, `axrl-debug summary`."""
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "axrl.cli", "train", str(ROOT / "examples/blackbox.yaml"), "--run-dir", str(run),
           "--set", "steps=2", "--set", "warmup.steps=4", "--set", "eval.every=0", "--set", "data.prompts_per_step=2",
           "--set", "rollout.group_size=2", "--set", "model.preset=micro-moe", "--set", "runtime.mode=async",
           "--set", "rollout.max_staleness=1"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=800,
                         env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]
    assert all(r["sessions"] == 4 and r["failed"] == 0 for r in rows), rows
    assert all(r["version_lag_max"] <= 1 for r in rows)
    import h5py

    with h5py.File(run / "trace/step_000001.h5") as f:
        sessions = [s.decode() for s in f["/samples/session_id"][:]]
        assert len(set(sessions)) == 4 and all(sessions)
        assert (f["/samples/fork_of"][:] == -1).all()
        assert f["/samples/drift_tokens"].dtype.kind == "i"
        assert [c.decode() for c in f["/samples/fork_cause"][:]] == [""] * len(sessions)  # no fork, no cause
        assert f["/tokens/drift"].shape == f["/tokens/ids"].shape and not f["/tokens/drift"][:].any()
        lag = 1 - f["/tokens/policy_version"][:][f["/tokens/loss_mask"][:] == 1]
        assert lag.max() <= 1
    summary = subprocess.run([sys.executable, "-m", "axrl_debug.cli", "summary", str(run)], capture_output=True,
                             text=True, timeout=120)
    assert summary.returncode == 0 and "sessions" in summary.stdout, summary.stdout + summary.stderr
    assert "sessions: 8 over 2 steps, 0 fork path(s), 0 sample(s) with drift" in summary.stdout
    # the TUI's token view names the sample's session
    from axrl_debug.tui.app import DebugApp
    from axrl_debug.tui.screens import TokensScreen

    app = DebugApp(run, scan=False)

    async def drive() -> str:
        async with app.run_test(size=(120, 30)) as pilot:
            await pilot.pause(0.5)
            await pilot.press("enter", "enter")
            await pilot.pause(0.5)
            assert isinstance(app.screen, TokensScreen)
            return str(app.screen.query_one("#status").render())

    status = asyncio.run(drive())
    assert "session s" in status, status


def test_agent_slots_bound_agents_over_every_event_loop():
    """The rollout worker's loop and the evaluator's run agents at once: the limit is shared."""
    import threading

    from axrl.rollout.blackbox import AgentSlots

    slots, lock, seen = AgentSlots(3), threading.Lock(), []
    running = [0]

    async def episode():
        async with slots:
            with lock:
                running[0] += 1
                seen.append(running[0])
            await asyncio.sleep(0.01)
            with lock:
                running[0] -= 1

    async def loop_main():
        await asyncio.gather(*(episode() for _ in range(10)))

    threads = [threading.Thread(target=asyncio.run, args=(loop_main(),)) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert len(seen) == 30 and max(seen) == 3 and slots.running == 0


def test_agent_slots_pass_a_cancelled_waiters_slot_on():
    from axrl.rollout.blackbox import AgentSlots

    async def main():
        slots = AgentSlots(1)
        await slots.__aenter__()
        waiting = asyncio.ensure_future(slots.__aenter__())
        await asyncio.sleep(0)
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)
        await slots.__aexit__(None, None, None)
        async with slots:  # the slot is free again, not lost to the cancelled waiter
            assert slots.running == 1
        return slots.running

    assert asyncio.run(main()) == 0


def test_fork_server_runs_the_script_as_its_own_process(tmp_path):
    """A forked agent has its own pid, environment, argv, stdin, stderr and exit code; a hung one is killed."""
    import os
    import subprocess as sp

    from axrl.agents.forkserver import ForkServer, forkable, top_level_imports

    script = tmp_path / "agent.py"
    script.write_text("import json, os, sys\nfrom fractions import Fraction\n"
                      "if sys.argv[1:] == ['hang']:\n    import time; time.sleep(60)\n"
                      "print(json.dumps({'pid': os.getpid(), 'env': os.environ.get('X'), 'argv': sys.argv[1:],\n"
                      "                  'stdin': sys.stdin.read(), 'name': __name__}), file=sys.stderr)\n"
                      "sys.exit(3)\n")
    assert top_level_imports(script) == ["json", "os", "sys", "fractions"]
    assert forkable([sys.executable, str(script)]) == str(script)
    assert forkable([sys.executable, "-X", "importtime", str(script)]) is None and forkable(["node", "a.js"]) is None
    server = ForkServer(script)
    try:
        procs = [server.spawn([str(script), f"a{i}"], {"X": str(i)}, str(tmp_path)) for i in range(3)]
        outs = [json.loads(p.communicate(f"q{i}".encode(), timeout=60)[1]) for i, p in enumerate(procs)]
        assert [p.returncode for p in procs] == [3, 3, 3]
        assert [o["env"] for o in outs] == ["0", "1", "2"] and [o["argv"] for o in outs] == [["a0"], ["a1"], ["a2"]]
        assert [o["stdin"] for o in outs] == ["q0", "q1", "q2"] and {o["name"] for o in outs} == {"__main__"}
        assert len({o["pid"] for o in outs} | {os.getpid()}) == 4
        hung = server.spawn([str(script), "hang"], {}, str(tmp_path))
        with pytest.raises(sp.TimeoutExpired):
            hung.communicate(b"", timeout=0.5)
        hung.kill()
        hung.communicate()
        assert hung.returncode == -9
    finally:
        server.close()


def test_agent_config_keys_reach_the_player_and_the_proxy(tok):
    """`agent.fork_server: false` starts each episode as a fresh process (no fork server is
    made); `agent.coalesce_ms` sets the proxy's coalescing window."""
    from axrl.config import Config
    from axrl.runtime.components import make_agent

    cfg = Config.model_validate({"runtime": {"deterministic": False},
                                 "agent": {"command": AGENT, "fork_server": False, "coalesce_ms": 4,
                                           "verifier": VERIFIER}})
    proxy, player = make_agent(cfg.agent, tok, cfg.rollout.max_context_len)  # the section is the settings
    try:
        assert proxy.coalescer.window_s == pytest.approx(0.004)
        assert player.agent.fork_server is False
        prompt = TASKS["calculator"]().prompt(0, 4)
        engine = ScriptedEngine(calculator_policy(tok))
        sampling = SamplingParams(max_new_tokens=48, stop_token_ids=tok.stop_token_ids, seed=11)
        traj = asyncio.run(player.play(engine, sample_id=0, group_id=0, prompt=prompt, sampling=sampling,
                                       return_routing=False))
        assert traj.status == "ok" and traj.reward == 1.0
        assert not player._fork_servers  # the episode's agent was a plain subprocess
    finally:
        player.close()
        proxy.stop()


def test_fork_server_preloads_what_its_children_imported(tmp_path):
    """A module an agent imports while it runs is loaded in the server for the next agents;
    one from the agent's own directory is not (the server's path is not the script's)."""
    from axrl.agents.forkserver import ForkServer

    (tmp_path / "agent_helper.py").write_text("VALUE = 1\n")
    script = tmp_path / "agent.py"
    script.write_text("import sys\n"
                      "print(int('colorsys' in sys.modules), int('agent_helper' in sys.modules), file=sys.stderr)\n"
                      "if True:  # not a top-level import: learnt from the first child\n    import colorsys, agent_helper\n")
    server = ForkServer(script)
    try:
        seen = []
        for _ in range(3):
            proc = server.spawn([str(script)], {}, str(tmp_path))
            seen.append(proc.communicate(b"", timeout=60)[1].decode().split())
            assert proc.returncode == 0
        assert seen == [["0", "0"], ["1", "0"], ["1", "0"]]
    finally:
        server.close()
