"""The frozen graph a CPU scoring task may use instead of the module (sparkdl.inference.frozen):
used only where it traces cleanly and gives the module's outputs, on real torch models; the
speed rule is set by its threshold (timing on a shared machine is not what these tests check)."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from sparkdl.inference import frozen
from sparkdl.inference.execution import ModelRunner


class _ConvNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3, padding=1)
        self.head = torch.nn.Linear(4 * 8 * 8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.conv(x)).flatten(1))


class _Branchy(torch.nn.Module):
    """Its output depends on its data through a Python branch: a trace would keep one side."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) if float(x.sum()) > 0 else -self.linear(x)


class _Noisy(torch.nn.Module):
    """Traces without a warning, but no two calls agree: the comparison must catch it."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) + torch.rand(x.shape[0], 2)


class _Heads(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 3)

    def forward(self, features: torch.Tensor, scale: torch.Tensor):
        out = self.linear(features) * scale
        return {"score": out.sum(1), "classes": out}


@pytest.fixture(autouse=True)
def _fresh_decisions(monkeypatch):
    monkeypatch.setattr(frozen, "_decisions", {})
    monkeypatch.setattr(frozen, "_FASTER", float("inf"))  # any graph that passes the checks counts as faster


def _images(rows: int) -> torch.Tensor:
    return torch.randn(rows, 3, 8, 8, generator=torch.Generator().manual_seed(rows))


def test_a_clean_model_is_scored_by_its_frozen_graph_with_the_modules_outputs_and_decided_once():
    module = _ConvNet().eval()
    chosen = frozen.model_for(module, "k1", torch.device("cpu"), _images(100))
    assert isinstance(chosen, torch.jit.ScriptModule)
    with torch.inference_mode():
        for rows in (100, 7, 1):  # other batch sizes than the one traced
            assert torch.allclose(chosen(_images(rows)), module(_images(rows)), rtol=1e-4, atol=1e-5)
    assert frozen.model_for(module, "k1", torch.device("cpu"), _images(3)) is chosen
    assert len(frozen._decisions) == 1
    other_shape = torch.randn(4, 3, 8, 8).to(torch.float64)
    frozen.model_for(module.double(), "k1", torch.device("cpu"), other_shape)
    assert len(frozen._decisions) == 2  # another input dtype is decided on its own


def test_named_inputs_and_several_heads_are_traced_too():
    module = _Heads().eval()
    inputs = {"features": torch.randn(20, 4), "scale": torch.rand(20, 1)}
    chosen = frozen.model_for(module, "heads", torch.device("cpu"), inputs)
    assert isinstance(chosen, torch.jit.ScriptModule)
    with torch.inference_mode():
        got, want = chosen(**inputs), module(**inputs)
    assert set(got) == {"score", "classes"} and torch.allclose(got["classes"], want["classes"])


@pytest.mark.parametrize(
    "module, reason",
    [
        (_Branchy(), "depends on its data in Python"),
        (_Noisy(), "outputs differ from the module's on 64 rows"),
    ],
)
def test_a_model_the_graph_cannot_stand_for_is_scored_eagerly_and_says_why(module, reason, caplog):
    module.eval()
    with caplog.at_level(logging.INFO, logger="sparkdl.inference"):
        chosen = frozen.model_for(module, "k2", torch.device("cpu"), torch.rand(100, 4) + 0.1)
    assert chosen is module
    assert "scoring with the eager module" in caplog.text and reason in caplog.text
    assert frozen.model_for(module, "k2", torch.device("cpu"), torch.rand(5, 4)) is module  # decided once


def test_a_slower_graph_is_not_used(monkeypatch, caplog):
    monkeypatch.setattr(frozen, "_FASTER", 0.0)
    module = _ConvNet().eval()
    with caplog.at_level(logging.INFO, logger="sparkdl.inference"):
        assert frozen.model_for(module, "k3", torch.device("cpu"), _images(10)) is module
    assert "the graph is not faster" in caplog.text


def test_rows_that_cannot_decide_leave_the_decision_to_a_later_batch():
    module = _ConvNet().eval()
    assert frozen.model_for(module, "k4", torch.device("cpu"), _images(1)) is module
    assert frozen.model_for(module, "k4", torch.device("cpu"), torch.randn(5, 3, 8, 9)[..., :8]) is not module
    bad = torch.randn(6, 3, 8, 8)
    assert frozen.model_for(_ConvNet().eval(), "k5", torch.device("cpu"), bad[:, :2]) is not None
    assert ("k5", "cpu", (("", "torch.float32", (2, 8, 8)),)) not in frozen._decisions  # the module raised


def test_the_runner_uses_the_graph_only_when_optimize_is_auto_on_a_cpu_without_autocast():
    module = _ConvNet().eval()
    images = _images(12).numpy()
    outputs = {}
    for optimize, precision in (("auto", None), ("off", None), ("auto", "bf16")):
        frozen._decisions.clear()
        runner = ModelRunner(module, torch.device("cpu"), precision, 1024, key="k6", optimize=optimize)
        outputs[optimize, precision] = runner(images)[""]
        assert bool(frozen._decisions) == (optimize == "auto" and precision is None)
    np.testing.assert_allclose(outputs["auto", None], outputs["off", None], rtol=1e-4, atol=1e-5)


def test_decisions_go_with_the_models_the_cache_drops():
    frozen.model_for(_ConvNet().eval(), "old", torch.device("cpu"), _images(4))
    frozen.model_for(_ConvNet().eval(), "new", torch.device("cpu"), _images(4))
    frozen.forget(lambda key, device: key == "new")
    assert {slot[0] for slot in frozen._decisions} == {"new"}
