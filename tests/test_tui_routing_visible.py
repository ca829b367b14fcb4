"""The TUI's routing column of a large MoE step is computed for the rows on screen only: their
token ranges of the routing are read, their values are the whole step's decode, and the rows
off screen stay pending until asked for."""

from __future__ import annotations

import numpy as np
import pytest

from axrl.trace import StepFile
from axrl_debug.synthetic import write_run
from axrl_debug.tui import data, metrics
from test_trace import make_record


@pytest.mark.parametrize("encoding", ["raw", "packed"])
def test_fill_routing_decodes_only_the_rows_on_screen(tmp_path, monkeypatch, encoding):
    rec = make_record(step=0, num_experts=64, num_layers=6, topk=4, n_groups=6, group_size=4)
    write_run(tmp_path / "run", [rec], routing_encoding=encoding)
    path = tmp_path / "run" / "trace" / "step_000000.h5"
    with StepFile(path) as sf:
        off = np.asarray(sf["/samples/offsets"], dtype=np.int64)
        cols = sf.read_columns(metrics.SAMPLE_ROUTING_COLUMNS[:2], optional=metrics.SAMPLE_ROUTING_COLUMNS[2:])
        whole = metrics._routing_agree(off, cols, compiled=True)
    assert 0.0 < float(np.nanmean(whole)) < 1.0
    monkeypatch.setattr(data, "LAZY_ROUTING_TOKENS", 0)
    step = data.RunModel(tmp_path / "run").step(0)
    assert step.routing_pending and np.isnan(step.stats.routing_agree).all()

    read: list[tuple[str, int, int]] = []
    real = StepFile.read_slice

    def spy(self, name, a, b):
        read.append((name, a, b))
        return real(self, name, a, b)

    monkeypatch.setattr(StepFile, "read_slice", spy)
    monkeypatch.setattr(metrics, "chunked_routing_agree", lambda sf, *a: pytest.fail("streamed the whole routing"))
    screen = [3, 0, 7, 12]
    step.fill_routing(rows=screen)
    for i in range(step.num_samples):
        if i in screen:
            assert step.stats.routing_agree[i] == whole[i] or (np.isnan(whole[i]) and np.isnan(step.stats.routing_agree[i])), i
        else:
            assert np.isnan(step.stats.routing_agree[i]), i
    ranges = {(a, b) for name, a, b in read if name.startswith("/routing/")}
    assert ranges == {(int(off[i]), int(off[i + 1])) for i in screen}
    assert step.routing_pending

    read.clear()
    step.fill_routing(rows=[0, 3])                   # already on screen once: nothing read again
    assert not read
    monkeypatch.undo()
    step.fill_routing()                              # the rest (e.g. the user scrolled through)
    assert not step.routing_pending
    assert np.array_equal(step.stats.routing_agree, whole, equal_nan=True)


def test_fill_routing_streams_when_the_screen_holds_most_of_the_step(tmp_path, monkeypatch):
    """A few long samples all on screen: one streamed pass (cheaper than sample by sample), the
    same values, nothing left pending."""
    rec = make_record(step=0, num_experts=64, num_layers=6, topk=4, n_groups=2, group_size=2, mean_len=300)
    write_run(tmp_path / "run", [rec], routing_encoding="packed")
    monkeypatch.setattr(data, "LAZY_ROUTING_TOKENS", 0)
    step = data.RunModel(tmp_path / "run").step(0)
    streamed = []
    real = metrics.chunked_routing_agree
    monkeypatch.setattr(metrics, "chunked_routing_agree", lambda sf, *a: streamed.append(1) or real(sf, *a))
    assert step.fill_routing(rows=range(3)) == step.num_samples
    assert streamed and not step.routing_pending
    with StepFile(tmp_path / "run" / "trace" / "step_000000.h5") as sf:
        assert np.array_equal(step.stats.routing_agree, real(sf), equal_nan=True)
