"""DiLoCo (``ModelAveraging(outer_optimizer=...)``) on a real gloo process group, without Spark.

One spawn of two ranks (module-scoped) runs every scenario and saves what each rank saw; the
tests compare those recordings with references of the update rules. As in test_averaging.py the
ranks start from different random weights and see different data.
"""

from __future__ import annotations

from typing import Any, Dict, List

import numpy as np
import pytest
import torch

import sparkdl
from sparkdl._runtime.checkpoint_writer import capture
from sparkdl.checkpoint import decode_part, encode_part
from sparkdl.errors import ConfigError
from sparkdl.strategies.averaging import ModelAveraging
from sparkdl.strategies.base import DistEnv, strategy_from_name
from tests.gloo import cpu_env, join_group, save_results, spawn_ranks
from tests.unit.test_averaging import _Net, _snapshot, _train

WORLD = 2
TAU, WARMUP, STEPS = 3, 2, 10  # averages after steps 1, 2 (warm-up), 5, 8; final at 10
SYNCED = (1, 2, 5, 8)
OUTER_STEPS = (5, 8, 10)  # the warm-up averages are plain; 10 is final_module's
OUTER_LR, OUTER_MOMENTUM = 0.7, 0.9
RESUME_AT = 7  # mid-round: the last sync was after step 5, the next is after step 8
DIGITS_TAU, DIGITS_EPOCHS = 16, 6  # 28 steps an epoch per rank: 10 outer steps, and a final one


def _plain_identity() -> sparkdl.OuterSGD:
    return sparkdl.OuterSGD(lr=1.0, momentum=0.0, nesterov=False)


def _batch(rank: int, step: int):
    """Step ``step``'s batch on ``rank``: a function of both only, so a resumed run sees the same."""
    generator = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(8, 4, generator=generator) + rank, torch.randn(8, 3, generator=generator)


def _adam_run(env: DistEnv, rank: int, steps: range, restore: Any = None) -> Dict[str, Any]:
    """DiLoCo over Adam on a _Net for ``steps``; ``restore`` is a checkpoint part (bytes) to
    resume from, as FitLoop does: prepare, load the strategy's state, then model and optimizer."""
    runtime = ModelAveraging(sync_every=TAU, warmup_steps=WARMUP, outer_optimizer=sparkdl.OuterSGD()).create_runtime(
        env
    )
    torch.manual_seed(7 + rank + (100 if restore else 0))
    model = runtime.prepare_model(_Net())
    optimizer = runtime.prepare_optimizer(torch.optim.Adam(model.parameters(), lr=0.01))
    if restore is not None:
        part = decode_part(restore, RESUME_AT, WORLD, rank)
        runtime.load_state_dict(part.strategy)
        model.load_state_dict(part.user["model"])
        optimizer.load_state_dict(part.user["optimizer"])
    for step in steps:
        features, targets = _batch(rank, step)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(features), targets).backward()
        optimizer.step()
    out: Dict[str, Any] = {"state": runtime.state_dict()}
    if steps.stop == RESUME_AT:
        # Through the real checkpoint encoding (torch.save, read back with weights_only=True).
        part = capture(
            user={"model": model.state_dict(), "optimizer": optimizer.state_dict()},
            replicated=None,
            strategy=runtime.state_dict(),
            grad_scaler=None,
            batches_taken=RESUME_AT,
            device=torch.device("cpu"),
            rank=rank,
            world_size=WORLD,
        )
        out["part"] = encode_part(RESUME_AT, WORLD, rank, part)
        return out
    out["final"] = _snapshot(runtime.final_module(model))
    out["final_state"] = runtime.state_dict()
    return out


def _digits(env: DistEnv, rank: int, outer: Any) -> Dict[str, Any]:
    """Adam on this rank's half of digits, averaged every DIGITS_TAU steps; full-data loss before/after."""
    from sklearn.datasets import load_digits

    features, labels = load_digits(return_X_y=True)
    x_all = torch.tensor(features / 16.0, dtype=torch.float32)
    y_all = torch.tensor(labels, dtype=torch.int64)
    x, y = x_all[rank::WORLD], y_all[rank::WORLD]
    runtime = ModelAveraging(sync_every=DIGITS_TAU, outer_optimizer=outer).create_runtime(env)
    torch.manual_seed(0)
    model = runtime.prepare_model(
        torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    )
    optimizer = runtime.prepare_optimizer(torch.optim.Adam(model.parameters(), lr=3e-3))

    def full_loss(module: torch.nn.Module) -> float:
        with torch.no_grad():
            return torch.nn.functional.cross_entropy(module(x_all), y_all).item()

    initial = full_loss(model)
    generator = torch.Generator().manual_seed(rank)
    for _ in range(DIGITS_EPOCHS):
        order = torch.randperm(len(y), generator=generator)
        for start in range(0, len(y) - 31, 32):
            batch = order[start : start + 32]
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(x[batch]), y[batch]).backward()
            optimizer.step()
    final = runtime.final_module(model)
    with torch.no_grad():
        accuracy = (final(x_all).argmax(1) == y_all).double().mean().item()
    return {
        "initial": initial,
        "final": full_loss(final),
        "accuracy": accuracy,
        "weights": _snapshot(final),
        "syncs": runtime.syncs,
    }


def _bad_factories(env: DistEnv) -> Dict[str, str]:
    other = torch.nn.Linear(2, 2)
    factories = {
        "not_an_optimizer": lambda params: "sgd",
        "raises": lambda params: torch.optim.SGD(params, lr=-1.0),
        "other_params": lambda params: torch.optim.SGD(other.parameters(), lr=0.1),
    }
    messages = {}
    for key, factory in factories.items():
        runtime = ModelAveraging(outer_optimizer=factory).create_runtime(env)
        try:
            runtime.prepare_model(torch.nn.Linear(2, 2))
        except ConfigError as exc:
            messages[key] = str(exc)
    # A checkpoint of plain averaging resumed with an outer optimizer (and the other way round).
    plain = ModelAveraging().create_runtime(env)
    plain.prepare_model(torch.nn.Linear(2, 2))
    diloco = ModelAveraging(outer_optimizer=sparkdl.OuterSGD()).create_runtime(env)
    diloco.prepare_model(torch.nn.Linear(2, 2))
    for key, (source, target) in {"resume_without": (plain, diloco), "resume_with": (diloco, plain)}.items():
        try:
            target.load_state_dict(source.state_dict())
        except ConfigError as exc:
            messages[key] = str(exc)
    return messages


def _worker(rank: int, port: int, out_dir: str) -> None:
    join_group(rank, port, WORLD)
    env = cpu_env(rank, port, WORLD)
    outer = ModelAveraging(sync_every=TAU, warmup_steps=WARMUP, outer_optimizer=sparkdl.OuterSGD()).create_runtime(env)
    results = {
        "plain": _train(ModelAveraging(sync_every=TAU, warmup_steps=WARMUP).create_runtime(env), rank, STEPS),
        "lr1": _train(
            ModelAveraging(sync_every=TAU, warmup_steps=WARMUP, outer_optimizer=_plain_identity()).create_runtime(env),
            rank,
            STEPS,
        ),
        "nesterov": _train(outer, rank, STEPS),
        "nesterov_state": outer.state_dict(),
        "uninterrupted": _adam_run(env, rank, range(1, STEPS + 1)),
        "interrupted": _adam_run(env, rank, range(1, RESUME_AT)),
    }
    results["resumed"] = _adam_run(env, rank, range(RESUME_AT, STEPS + 1), restore=results["interrupted"]["part"])
    results["digits_plain"] = _digits(env, rank, None)
    results["digits_diloco"] = _digits(env, rank, sparkdl.OuterSGD(lr=OUTER_LR, momentum=OUTER_MOMENTUM, nesterov=True))
    results["bad"] = _bad_factories(env)
    save_results(results, out_dir, rank)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> List[Dict[str, Any]]:
    return spawn_ranks(_worker, WORLD, str(tmp_path_factory.mktemp("diloco")))


def _keys(snapshot: Dict[str, torch.Tensor]) -> List[str]:
    return [k for k, v in snapshot.items() if v.is_floating_point()]


def _average(ranks: List[Dict[str, Any]], run: str, step: int, key: str) -> torch.Tensor:
    """What the allreduce computes from the pre-sync replicas, in their own precision: each rank
    divides by 2, and a sum of two floats is one correctly rounded addition, whatever the order."""
    return sum(r[run]["pre"][step - 1][key] / WORLD for r in ranks)


# ------------------------------------------------------------------ outer SGD(lr=1) is averaging


def test_outer_sgd_lr1_is_plain_averaging_at_every_sync(ranks):
    """At a sync SGD(lr=1) computes global - (global - average). In floating point that is the
    average exactly when global and average are within a factor of two (Sterbenz: the difference
    is exact) and otherwise differs from it by at most two roundings of a number no larger than
    2·max(|global|, |average|): |error| <= 3·u·max with u = 2^-24 (float32), 2^-53 (float64).
    The test checks that bound, and that the replicas got exactly that floating-point formula."""
    keys = _keys(ranks[0]["lr1"]["post"][0])
    params = [k for k in keys if "running" not in k]  # buffers are plainly averaged
    held = {k: ranks[0]["lr1"]["init"][k] for k in params}  # the global copy
    for step in SYNCED + (STEPS,):
        for key in keys:
            average = _average(ranks, "lr1", step, key)
            got = (ranks[0]["lr1"]["final"] if step == STEPS else ranks[0]["lr1"]["post"][step - 1])[key]
            if key in params and step in OUTER_STEPS:
                g = held[key]
                assert torch.equal(got, g - (g - average)), (step, key)
                u = 2.0**-24 if got.dtype == torch.float32 else 2.0**-53
                bound = 3 * u * torch.maximum(g.abs(), average.abs())
                assert bool(((got - average).abs() <= bound).all()), (step, key)
            else:
                assert torch.equal(got, average), (step, key)  # warm-up and buffers: the plain average
            if key in params:
                held[key] = got


def test_outer_sgd_lr1_run_matches_plain_averaging_run(ranks):
    """The same runs end to end. They can differ only by the per-sync rounding bounded above
    (< 4e-7 relative) carried through the later steps: SGD at lr 0.05 on a 4-input layer over
    five more steps scales a perturbation by far less than 10, so 1e-6 absolute (the weights are
    of order 1) separates "the same thing" from any real difference in the update, which moves
    weights by ~1e-2 per step. (Measured here: no difference at all, every case was exact.)"""
    for r in ranks:
        for key in _keys(r["plain"]["final"]):
            np.testing.assert_allclose(
                r["lr1"]["final"][key].double().numpy(),
                r["plain"]["final"][key].double().numpy(),
                rtol=0,
                atol=1e-6,
                err_msg=key,
            )
        assert r["lr1"]["comm"] == r["plain"]["comm"] and r["lr1"]["comm_final"] == r["plain"]["comm_final"]
        assert r["lr1"]["syncs"] == r["plain"]["syncs"] == 5


# ------------------------------------------------------------------- Nesterov outer optimizer


def test_nesterov_outer_step_matches_the_diloco_rule(ranks):
    """global <- SGD-Nesterov(global, grad = global - average): b = m·b + d, global -= lr·(d + m·b)."""
    keys = _keys(ranks[0]["nesterov"]["post"][0])
    params = [k for k in keys if "running" not in k]
    held = {k: ranks[0]["nesterov"]["init"][k].double().numpy() for k in params}
    momentum: Dict[str, np.ndarray] = {}
    for step in SYNCED + (STEPS,):
        posts = [r["nesterov"]["final"] if step == STEPS else r["nesterov"]["post"][step - 1] for r in ranks]
        assert all(torch.equal(p[k], posts[0][k]) for p in posts for k in keys), f"replicas differ after sync {step}"
        for key in keys:
            average = _average(ranks, "nesterov", step, key).double().numpy()
            if key in params and step in OUTER_STEPS:
                d = held[key] - average
                momentum[key] = OUTER_MOMENTUM * momentum[key] + d if key in momentum else d
                held[key] = held[key] - OUTER_LR * (d + OUTER_MOMENTUM * momentum[key])
                expected = held[key]
            else:
                expected = average  # warm-up: the global copy follows the average; buffers: averaged
                if key in params:
                    held[key] = average
            np.testing.assert_allclose(
                posts[0][key].double().numpy(), expected, rtol=1e-5, atol=1e-6, err_msg=f"step {step} {key}"
            )
    # Between syncs the replicas train apart (local steps stay local).
    assert not torch.equal(
        ranks[0]["nesterov"]["post"][3]["linear.weight"], ranks[1]["nesterov"]["post"][3]["linear.weight"]
    )
    # Same traffic as plain averaging: the outer step itself sends nothing.
    assert [r["nesterov"]["comm"] for r in ranks] == [r["plain"]["comm"] for r in ranks]


def test_outer_state_is_identical_on_every_rank(ranks):
    first, second = (r["nesterov_state"]["outer"] for r in ranks)
    assert len(first) == 1 and len(first[0]["global"]) == 5  # linear w, b; norm w, b; scale
    for a, b in zip(first[0]["global"], second[0]["global"]):
        assert torch.equal(a, b)
    assert first[0]["optimizer"]["param_groups"] == second[0]["optimizer"]["param_groups"]
    states = [s[0]["optimizer"]["state"] for s in (first, second)]
    assert sorted(states[0]) == sorted(states[1]) == list(range(5))
    for index in states[0]:
        assert torch.equal(states[0][index]["momentum_buffer"], states[1][index]["momentum_buffer"])


def test_diloco_differs_from_plain_averaging_and_trains_digits(ranks):
    for r in ranks:
        plain, diloco = r["digits_plain"], r["digits_diloco"]
        assert diloco["syncs"] == plain["syncs"] == 11  # 168 steps / 16, and the final one
        assert diloco["final"] < 0.1 * diloco["initial"], (diloco["initial"], diloco["final"])
        assert diloco["accuracy"] >= 0.9, diloco["accuracy"]
        gap = max((diloco["weights"][k] - plain["weights"][k]).abs().max().item() for k in plain["weights"])
        assert gap > 1e-2, gap  # a different trajectory, not rounding
    assert ranks[0]["digits_diloco"]["weights"].keys() == ranks[1]["digits_diloco"]["weights"].keys()
    for key, value in ranks[0]["digits_diloco"]["weights"].items():
        assert torch.equal(value, ranks[1]["digits_diloco"]["weights"][key]), key


# ------------------------------------------------------------------------------------ resume


def test_resumed_diloco_run_equals_the_uninterrupted_one_bit_for_bit(ranks):
    for r in ranks:
        reference, resumed = r["uninterrupted"], r["resumed"]
        for key, value in reference["final"].items():
            assert torch.equal(value, resumed["final"][key]), key
        ref_outer, res_outer = reference["final_state"]["outer"][0], resumed["final_state"]["outer"][0]
        for a, b in zip(ref_outer["global"], res_outer["global"]):
            assert torch.equal(a, b)
        for index, state in ref_outer["optimizer"]["state"].items():
            assert torch.equal(state["momentum_buffer"], res_outer["optimizer"]["state"][index]["momentum_buffer"])
        assert reference["final_state"]["syncs"] == resumed["final_state"]["syncs"] == 5


# ------------------------------------------------------------------------------------ errors


def test_bad_outer_factories_fail_naming_the_setting(ranks):
    for r in ranks:
        bad = r["bad"]
        assert (
            "ModelAveraging.outer_optimizer=" in bad["not_an_optimizer"]
            and "returned str, not a torch.optim.Optimizer" in bad["not_an_optimizer"]
        )
        assert "raised ValueError: Invalid learning rate" in bad["raises"]
        assert "built an optimizer over other parameters than the 2 it was given" in bad["other_params"]
        assert "outer_optimizer is set in this run, but the checkpoint was written without it" in bad["resume_without"]
        assert "outer_optimizer is None in this run, but the checkpoint was written with it" in bad["resume_with"]


@pytest.mark.parametrize(
    "build, needle",
    [
        (
            lambda: ModelAveraging(outer_optimizer=0.7),
            "ModelAveraging.outer_optimizer=0.7 must be None (plain averaging), a function params",
        ),
        (lambda: ModelAveraging(outer_optimizer={"lr": 0.7, "beta": 1}), "unknown OuterSGD field(s) ['beta']"),
        (lambda: sparkdl.OuterSGD(lr=0), "OuterSGD.lr=0 must be a finite number > 0"),
        (lambda: sparkdl.OuterSGD(momentum=1.0), "OuterSGD.momentum=1.0 must be a number with 0 <= momentum < 1"),
        (lambda: sparkdl.OuterSGD(nesterov="yes"), "OuterSGD.nesterov='yes' must be True or False"),
        (lambda: sparkdl.OuterSGD(momentum=0), "OuterSGD.nesterov=True needs momentum > 0"),
    ],
)
def test_outer_config_errors(build, needle):
    with pytest.raises(ConfigError) as info:
        build()
    assert needle in str(info.value)


def test_outer_settings_from_the_command_line_describe_and_pickle():
    import cloudpickle

    # --strategy-arg 'outer_optimizer={"lr": 0.5}' parses to a dict: it becomes an OuterSGD.
    strategy = strategy_from_name("model_averaging", sync_every=64, outer_optimizer={"lr": 0.5})
    assert strategy == ModelAveraging(sync_every=64, outer_optimizer=sparkdl.OuterSGD(lr=0.5))
    assert strategy.describe()["outer_optimizer"] == {"name": "OuterSGD", "lr": 0.5, "momentum": 0.9, "nesterov": True}
    assert isinstance(hash(strategy), int)  # frozen configs stay hashable
    notebook = ModelAveraging(
        outer_optimizer=lambda params: torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True)
    )
    copy = cloudpickle.loads(cloudpickle.dumps(notebook))
    built = copy.outer_optimizer([torch.nn.Parameter(torch.zeros(1))])
    assert isinstance(built, torch.optim.SGD) and built.defaults["nesterov"] is True
    assert ModelAveraging().describe()["outer_optimizer"] is None
    assert sparkdl.OuterSGD()([torch.nn.Parameter(torch.zeros(1))]).defaults["lr"] == 0.7
