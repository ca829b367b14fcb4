"""Per-sample columns an `agent.function` returns (a verifiers environment's reward components):
validated names and values, and one trace column per name with NaN where a sample has none.
Needs no verifiers install (tests/test_verifiers_env.py covers the real library)."""

from __future__ import annotations

import numpy as np
import pytest

from axrl.core.trajectory import Trajectory
from axrl.rollout.blackbox import returned_columns
from axrl.runtime.recording.builders import agent_columns


def test_an_agent_function_returns_namespaced_numeric_columns_or_fails_the_episode():
    assert returned_columns("42") == {} and returned_columns(None) == {} and returned_columns({"x": 1}) == {}
    assert returned_columns({"columns": {"reward.ok": 1, "metric.n-2": 0.5}}) == {"reward.ok": 1.0, "metric.n-2": 0.5}
    with pytest.raises(ValueError, match="column name 'reward'.*namespaced"):
        returned_columns({"columns": {"reward": 1.0}})   # would be the trace's own /samples/reward
    with pytest.raises(ValueError, match="column name 'reward/x'"):
        returned_columns({"columns": {"reward/x": 1.0}})
    with pytest.raises(ValueError, match="column 'reward.ok' = 'yes': expected a number"):
        returned_columns({"columns": {"reward.ok": "yes"}})
    with pytest.raises(ValueError, match="expected a dict of name -> number"):
        returned_columns({"columns": [1.0]})


def test_one_column_per_name_nan_where_a_sample_has_none():
    trajs = [Trajectory(sample_id=i, group_id=0, prompt_id="p") for i in range(3)]
    trajs[0].info["columns"] = {"reward.correct": 1.0, "reward.brief": 0.1}
    trajs[2].info["columns"] = {"reward.correct": 0.0, "metric.turns": 2.0}   # trajs[1]: a failed episode
    cols = agent_columns(trajs)
    assert sorted(cols) == ["metric.turns", "reward.brief", "reward.correct"]
    np.testing.assert_array_equal(cols["reward.correct"], [1.0, np.nan, 0.0])
    np.testing.assert_array_equal(cols["reward.brief"], [0.1, np.nan, np.nan])
    assert agent_columns([Trajectory(sample_id=0, group_id=0, prompt_id="p")]) == {}
