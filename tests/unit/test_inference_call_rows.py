"""optimize="auto" scores in smaller calls where the model runs faster per row in them, only where
that gives the same outputs, and never under optimize="off"."""

from __future__ import annotations

from typing import List

import numpy as np
import pytest
import torch

from sparkdl.inference import call_rows, frozen
from sparkdl.inference.execution import ModelRunner


class _Superlinear(torch.nn.Module):
    """Each row's output is its own (x * 2), but a call costs rows² work and memory: every row
    picked out of a [rows, rows, features] product with the identity, what an activation that
    overflows the caches does to a CNN, made certain (8x the work per row in a call of 128
    rows as in calls of 16). Records the rows of every call."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: List[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.append(len(x))
        if bool(torch.isnan(x).any()):  # Python steered by the data: the tracer warns, it stays eager
            raise ValueError("NaN input")
        picked = (torch.eye(len(x)).unsqueeze(2) * x.unsqueeze(0)).sum(dim=1)  # exactly x: adds zeros
        return picked * 2


class _BatchCentred(_Superlinear):
    """As costly, but each row's output depends on the batch (its mean): must keep whole calls."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        return out - out.mean(dim=0, keepdim=True)


@pytest.fixture(autouse=True)
def _fresh_decisions(monkeypatch):
    monkeypatch.setattr(frozen, "_decisions", {})
    monkeypatch.setattr(frozen, "_call_rows", {})
    # The time budget has its own test below; on a machine busy with other tests one call of the
    # costly test model can take long enough to skip the timing, which is not what these test.
    monkeypatch.setattr(call_rows, "_BUDGET_SECONDS", 120.0)
    # One thread, as a scoring task of one CPU has: two OpenMP threads on a machine busy with
    # other tests wait for each other at every operation, a cost per call that hides the rest.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _rows(n: int) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(n).random((n, 256), dtype=np.float32))


def test_a_model_faster_per_row_in_small_calls_gets_them_with_the_same_outputs():
    model = _Superlinear()
    chosen = call_rows.fastest_call_rows(model, _rows(512))
    assert chosen in call_rows._CANDIDATES and chosen < call_rows._SAMPLE_ROWS
    inputs = _rows(300)
    model.calls.clear()
    out = call_rows.chunked_call(model, inputs, chosen)
    assert model.calls == [chosen] * (300 // chosen) + ([300 % chosen] if 300 % chosen else [])
    torch.testing.assert_close(out, inputs * 2)


def test_a_model_whose_rows_depend_on_the_batch_keeps_whole_calls():
    assert call_rows.fastest_call_rows(_BatchCentred(), _rows(512)) is None


def test_a_model_too_slow_to_time_within_the_budget_is_not_tuned(monkeypatch):
    monkeypatch.setattr(call_rows, "_BUDGET_SECONDS", 1e-9)
    model = _Superlinear()
    assert call_rows.fastest_call_rows(model, _rows(512)) is None
    # One call for the outputs, one timed to estimate what the timing would cost: no more.
    assert model.calls == [call_rows._SAMPLE_ROWS] * 2


def test_too_few_rows_to_split_decide_nothing():
    model = _Superlinear()
    assert call_rows.fastest_call_rows(model, _rows(min(call_rows._CANDIDATES) * 2 - 1)) is None
    assert model.calls == []


def test_several_heads_are_joined_back_in_their_structure():
    def heads(x: torch.Tensor):
        return {"double": x * 2, "sum": x.sum(dim=1, keepdim=True)}

    inputs = _rows(37)
    joined = call_rows.chunked_call(heads, inputs, 16)
    assert list(joined) == ["double", "sum"]
    torch.testing.assert_close(joined["double"], inputs * 2)
    torch.testing.assert_close(joined["sum"], inputs.sum(dim=1, keepdim=True))
    pair = call_rows.chunked_call(lambda x: (x + 1, x - 1), inputs, 16)
    assert isinstance(pair, tuple)
    torch.testing.assert_close(pair[1], inputs - 1)


@pytest.mark.parametrize("optimize", ["auto", "off"])
def test_the_runner_splits_calls_only_under_auto(optimize):
    model = _Superlinear().eval()
    runner = ModelRunner(model, torch.device("cpu"), None, 1024, key=f"superlinear-{optimize}", optimize=optimize)
    inputs = _rows(400).numpy()
    runner(inputs)  # the first batch decides
    model.calls.clear()
    out = runner(inputs)
    np.testing.assert_allclose(out[""], inputs * 2, rtol=1e-6)
    if optimize == "off":
        assert model.calls == [400]
    else:
        assert list(frozen._decisions.values()) == [None]  # the tracer warned: the module, eager
        decided = frozen._call_rows[next(iter(frozen._call_rows))]
        assert decided in call_rows._CANDIDATES
        assert model.calls == [decided] * (400 // decided) + ([400 % decided] if 400 % decided else [])
