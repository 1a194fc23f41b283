"""Strategies by name: ``sparkdl train --strategy``, ``sparkdl compare/plan --strategies`` and
``strategy_from_name`` take the same names, ``diloco`` among them (model averaging with DiLoCo's
outer optimizer), and an unknown name's error says how DiLoCo is spelled."""

from __future__ import annotations

import pytest

import sparkdl
from sparkdl.cli._train import _strategy_kwargs, build_parser
from sparkdl.comparison.strategies import labelled_strategies, parse_strategies
from sparkdl.errors import ConfigError
from sparkdl.strategies import strategy_from_name, strategy_names

DILOCO_64 = sparkdl.ModelAveraging(sync_every=64, outer_optimizer=sparkdl.OuterSGD(lr=0.7, momentum=0.9, nesterov=True))


def test_diloco_is_model_averaging_with_the_outer_sgd_defaults_and_takes_settings():
    assert strategy_from_name("diloco", sync_every=64) == DILOCO_64
    assert strategy_from_name("DiLoCo", sync_every=64) == DILOCO_64  # case aside
    assert strategy_from_name("diloco") == sparkdl.ModelAveraging(outer_optimizer=sparkdl.OuterSGD())
    # Settings given with the name override the preset outer optimizer.
    slower = strategy_from_name("diloco", sync_every=16, outer_optimizer={"lr": 0.5})
    assert slower.outer_optimizer == sparkdl.OuterSGD(lr=0.5) and slower.sync_every == 16
    assert strategy_names()["diloco"].startswith("model_averaging with outer_optimizer=OuterSGD(lr=0.7")


def test_sparkdl_train_and_compare_build_the_same_diloco():
    args = build_parser().parse_args(
        ["--data", "/d", "--model", "m:f", "--features", "x", "--label", "y", "--output", "/o"]
        + ["--strategy", "diloco", "--strategy-arg", "sync_every=64"]
    )
    from_train = strategy_from_name(args.strategy, **_strategy_kwargs(args.strategy_arg))
    ((label, from_compare),) = parse_strategies("diloco:sync_every=64")
    assert from_train == from_compare == DILOCO_64
    # Labelled as sparkdl plan's default list names it, however it was built.
    assert label == "DiLoCo(sync_every=64)"
    assert [name for name, _ in labelled_strategies([DILOCO_64])] == ["DiLoCo(sync_every=64)"]
    other = sparkdl.ModelAveraging(sync_every=8, outer_optimizer=sparkdl.OuterSGD(lr=0.5))
    assert labelled_strategies([other])[0][0] == (
        "DiLoCo(sync_every=8, outer_optimizer=OuterSGD(lr=0.5, momentum=0.9, nesterov=True))"
    )
    assert labelled_strategies([sparkdl.ModelAveraging(sync_every=4)])[0][0] == "ModelAveraging(sync_every=4)"


def test_an_unknown_name_lists_the_valid_ones_and_how_diloco_is_spelled():
    with pytest.raises(
        ConfigError,
        match=r"strategy='ring' is unknown; valid: allreduce, .*model_averaging.*"
        r"\(and diloco = model_averaging with outer_optimizer=OuterSGD\(lr=0.7, momentum=0.9",
    ):
        strategy_from_name("ring")
    with pytest.raises(
        ConfigError, match=r"unknown strategy 'di_loco' in 'allreduce,di_loco'; valid names: .*diloco = "
    ):
        parse_strategies("allreduce,di_loco")
    with pytest.raises(
        ConfigError, match=r"'diloco:every=4'.*diloco's settings: sync_every, warmup_steps, outer_optimizer"
    ):
        parse_strategies("diloco:every=4")
