"""Typed calls to the Megatron ranks (`axrl/train/megatron/rank_calls.py`): a call names a
`MegatronRank` method itself, its arguments are checked against the method's signature where the
call is made, and a rank runs only the registered public methods — on every transport."""

from __future__ import annotations

import pickle

import pytest
import torch

from axrl.model import build_model, preset_config
from axrl.train.megatron.rank import MegatronRank
from axrl.train.megatron.rank_calls import RANK_METHODS, RankCall

import megatron.core as _megatron_core  # noqa: E402,F401  (the test extra installs it: a broken import fails)

from axrl.train.megatron import MegatronBackend, MegatronBackendConfig  # noqa: E402

torch.set_num_threads(1)


def test_the_registry_holds_the_public_rank_methods_only() -> None:
    names = {k.rpartition(".")[2] for k in RANK_METHODS}
    assert {"optimizer_step", "forward", "forward_backward", "on_critic", "load_optimizer_state"} <= names
    assert not any(n.startswith("_") for n in names)
    assert RANK_METHODS["MegatronRank.zero_grad"] is MegatronRank.zero_grad


def test_a_call_is_checked_against_the_signature_before_it_is_sent() -> None:
    call = RankCall.of(MegatronRank.optimizer_step, "main", 1e-3, 1.0, (0.9, 0.999), 1e-8, 0.0)
    assert (call.method, call.name, call.takes_first) == ("MegatronRank.optimizer_step", "optimizer_step", False)
    assert pickle.loads(pickle.dumps(call)) == call  # what the worker pipes and Ray send
    with pytest.raises(TypeError, match=r"MegatronRank.optimizer_step: missing a required argument: 'weight_decay'"):
        RankCall.of(MegatronRank.optimizer_step, "main", 1e-3, 1.0, (0.9, 0.999), 1e-8)
    with pytest.raises(TypeError, match=r"MegatronRank.zero_grad: too many positional arguments"):
        RankCall.of(MegatronRank.zero_grad, "main")
    with pytest.raises(TypeError, match=r"MegatronRank.keep_weights: got an unexpected keyword argument 'kee'"):
        RankCall.of(MegatronRank.keep_weights, "ref", kee="typo")
    # call_each: checked with a rank's first argument in its place, sent without it
    each = RankCall.each(MegatronRank.value_forward_backward, "work", None, 3.0)
    assert each.takes_first and each.args == (None, 3.0)
    with pytest.raises(TypeError, match="MegatronRank.value_forward: too many positional arguments"):
        RankCall.each(MegatronRank.value_forward, "work", 3.0)


def test_only_registered_methods_are_sent_or_run() -> None:
    with pytest.raises(TypeError, match="not a public MegatronRank method"):
        RankCall.of(MegatronRank._reports, "x")          # private: not part of what a driver may call
    with pytest.raises(TypeError, match="not a public MegatronRank method"):
        RankCall.of(print, "x")
    # a forged call (any name in a string) is refused on the rank, not looked up on it
    with pytest.raises(TypeError, match="'MegatronRank.__init__' is not a registered MegatronRank method"):
        RankCall("MegatronRank.__init__").run(object())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="one first argument expected"):
        RankCall.each(MegatronRank.value_forward, "work").run(object())  # type: ignore[arg-type]


def test_the_in_process_group_runs_typed_calls() -> None:
    """World size 1: the same typed path as worker processes and Ray actors (a wrong call raises
    TypeError in the caller; a right one runs on the rank)."""
    backend = MegatronBackend(build_model(preset_config("micro-moe"), seed=0),
                              MegatronBackendConfig(lr=1e-2, num_threads=1))
    try:
        group = backend._group
        assert group.call(MegatronRank.data_parallel_rank) == [0]
        with pytest.raises(TypeError, match="MegatronRank.swap_weights: missing a required argument: 'key'"):
            group.call(MegatronRank.swap_weights)
        with pytest.raises(TypeError, match="not a public MegatronRank method"):
            group.call(MegatronRank._owned, "x")
        group.call(MegatronRank.keep_weights, key="k")     # keyword arguments travel too
        backend._kept.add("k")
        before = backend.fingerprint()
        group.call(MegatronRank.swap_weights, "k")
        assert backend.fingerprint() == before            # same weights kept: swapping changes nothing
    finally:
        backend.close()
