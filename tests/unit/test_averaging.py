"""The averaging strategies' maths on a real gloo process group, without Spark.

One ``torch.multiprocessing.spawn`` of two ranks (module-scoped: starting interpreters that
import torch is the expensive part, about 5 s on a 2-core machine) runs every scenario and saves
what each rank saw; the tests then compare those recordings with numpy references of the update
rules. Ranks start from different random weights and see different data, so a missed
synchronization shows up as unequal replicas.
"""

from __future__ import annotations

from typing import Any, Dict, List

import numpy as np
import pytest
import torch

import sparkdl
from sparkdl.errors import ConfigError
from sparkdl.strategies._tensors import SyncingOptimizer
from sparkdl.strategies.averaging import ElasticAveraging, ModelAveraging
from sparkdl.strategies.base import DistEnv, strategy_from_name
from tests.gloo import cpu_env, join_group, save_results, spawn_ranks

WORLD = 2
LR = 0.05
MOMENTUM = 0.9
MA = dict(sync_every=3, warmup_steps=2, steps=10)  # averages after steps 1, 2, 5, 8; final at 10
EA = dict(sync_every=3, steps=7)  # elastic rounds after steps 3, 6; final round at 7
# _Net: float32 = linear 12+3, norm 3+3 (params) + running mean/var 3+3 (buffers) = 27 values;
# float64 = scale (1); int64 = num_batches_tracked (1, broadcast only, never averaged).
SYNC_BYTES = 27 * 4 + 1 * 8
BROADCAST_BYTES = SYNC_BYTES + 1 * 8


class _Net(torch.nn.Module):
    """Float32 parameters and buffers, one float64 parameter (a second flat buffer), one int buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 3)
        self.norm = torch.nn.BatchNorm1d(3)
        self.scale = torch.nn.Parameter(torch.ones(1, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.linear(x)) * self.scale.float()


def _snapshot(model: torch.nn.Module) -> Dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _train(runtime: Any, rank: int, steps: int) -> Dict[str, Any]:
    """Trains a _Net (rank-seeded init and data) through the runtime, recording every step."""
    torch.manual_seed(100 + rank)  # different initial weights on purpose: prepare_model must fix it
    net = _Net()
    record: Dict[str, Any] = {"init_local": _snapshot(net)}
    model = runtime.prepare_model(net)
    record["init"] = _snapshot(model)
    record["comm_after_prepare"] = runtime.comm_bytes
    inner = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    pre: List[Dict[str, torch.Tensor]] = []
    grads: List[Dict[str, torch.Tensor]] = []
    momenta: List[Dict[str, torch.Tensor]] = []

    def after_inner_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        # Runs inside the wrapped step, before any synchronization: the purely local result.
        pre.append(_snapshot(model))
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        momenta.append({n: optimizer.state[p]["momentum_buffer"].clone() for n, p in model.named_parameters()})

    inner.register_step_post_hook(after_inner_step)
    optimizer = runtime.prepare_optimizer(inner)
    generator = torch.Generator().manual_seed(rank)
    post, comm = [], []
    for _ in range(steps):
        features = torch.randn(8, 4, generator=generator) + rank  # ranks see different data
        targets = torch.randn(8, 3, generator=generator)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(features), targets).backward()
        optimizer.step()
        post.append(_snapshot(model))
        comm.append(runtime.comm_bytes)
    final = runtime.final_module(model)
    record.update(
        pre=pre,
        grads=grads,
        momenta=momenta,
        post=post,
        comm=comm,
        final=_snapshot(final),
        final_is_model=final is model,
        comm_final=runtime.comm_bytes,
        syncs=runtime.syncs,
    )
    return record


def _misuse(env: DistEnv) -> Dict[str, str]:
    """Error messages of loops that skip a step of the protocol (same on every rank)."""
    messages = {}
    runtime = ModelAveraging(sync_every=2).create_runtime(env)
    model = runtime.prepare_model(torch.nn.Linear(2, 2))
    try:
        runtime.final_module(model)
    except RuntimeError as exc:
        messages["no_optimizer"] = str(exc)
    stray = torch.nn.Parameter(torch.zeros(2))
    try:
        runtime.prepare_optimizer(torch.optim.SGD(list(model.parameters()) + [stray], lr=0.1))
    except RuntimeError as exc:
        messages["stray_parameter"] = str(exc)
    return messages


def _worker(rank: int, port: int, out_dir: str) -> None:
    join_group(rank, port, WORLD)
    env = cpu_env(rank, port, WORLD)
    ma = ModelAveraging(sync_every=MA["sync_every"], warmup_steps=MA["warmup_steps"])
    ea_runtime = ElasticAveraging(sync_every=EA["sync_every"]).create_runtime(env)
    results = {
        "ma": _train(ma.create_runtime(env), rank, MA["steps"]),
        "ea": _train(ea_runtime, rank, EA["steps"]),
        "ea_alpha": ea_runtime.alpha,
        "misuse": _misuse(env),
    }
    save_results(results, out_dir, rank)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> List[Dict[str, Any]]:
    """Every rank's recordings, indexed by rank."""
    return spawn_ranks(_worker, WORLD, str(tmp_path_factory.mktemp("averaging")))


def _floating(snapshot: Dict[str, torch.Tensor]) -> List[str]:
    return [k for k, v in snapshot.items() if v.is_floating_point()]


def _identical(snapshots: List[Dict[str, torch.Tensor]], keys: List[str]) -> bool:
    return all(torch.equal(s[k], snapshots[0][k]) for s in snapshots[1:] for k in keys)


def _mean(snapshots: List[Dict[str, torch.Tensor]], key: str) -> np.ndarray:
    return np.mean([s[key].double().numpy() for s in snapshots], axis=0)


# ------------------------------------------------------------------------------ ModelAveraging


def test_prepare_model_starts_every_replica_from_rank0(ranks):
    for run in ("ma", "ea"):
        local = [r[run]["init_local"] for r in ranks]
        assert not _identical(local, ["linear.weight"]), "ranks were seeded differently; the test needs that"
        for r in ranks:
            for key, value in local[0].items():
                assert torch.equal(r[run]["init"][key], value), (run, key)


def test_model_averaging_syncs_every_step_in_warmup_then_every_tau(ranks):
    keys = _floating(ranks[0]["ma"]["post"][0])
    synced = [step + 1 for step in range(MA["steps"]) if _identical([r["ma"]["post"][step] for r in ranks], keys)]
    assert synced == [1, 2, 5, 8]
    assert ranks[0]["ma"]["syncs"] == 5  # and once more in final_module (steps 9-10 were local)


def test_model_averaging_average_is_the_mean_and_local_steps_stay_local(ranks):
    keys = _floating(ranks[0]["ma"]["post"][0])
    for step in range(MA["steps"]):
        pre = [r["ma"]["pre"][step] for r in ranks]
        post = [r["ma"]["post"][step] for r in ranks]
        if step + 1 in (1, 2, 5, 8):
            for key in keys:
                np.testing.assert_allclose(
                    post[0][key].double().numpy(),
                    _mean(pre, key),
                    rtol=1e-6,
                    atol=1e-7,
                    err_msg=f"step {step + 1} {key}",
                )
        else:
            for p, q in zip(pre, post):
                assert all(torch.equal(p[k], q[k]) for k in p), f"step {step + 1} was local but changed the weights"


def test_model_averaging_continues_from_the_average_with_local_momentum(ranks):
    # SGD with momentum: buf_k = m * buf_{k-1} + g_k and x_k = x_{k-1} - lr * buf_k, where
    # x_{k-1} is the weights after the previous step's synchronization and buf_{k-1} is this
    # rank's own buffer: optimizer state is neither averaged nor reset at an average.
    for r in ranks:
        run = r["ma"]
        for step in range(1, MA["steps"]):
            for name in run["grads"][step]:
                buf = run["momenta"][step][name]
                np.testing.assert_allclose(
                    buf.numpy(),
                    (MOMENTUM * run["momenta"][step - 1][name] + run["grads"][step][name]).numpy(),
                    rtol=1e-6,
                    atol=1e-7,
                )
                np.testing.assert_allclose(
                    run["pre"][step][name].numpy(),
                    (run["post"][step - 1][name] - LR * buf).numpy(),
                    rtol=1e-6,
                    atol=1e-7,
                )
    # After the step-8 average the weights agree, the momentum buffers do not.
    assert not _identical([r["ma"]["momenta"][7] for r in ranks], ["linear.weight"])


def test_model_averaging_final_module_is_the_final_average(ranks):
    keys = _floating(ranks[0]["ma"]["final"])
    finals = [r["ma"]["final"] for r in ranks]
    assert all(r["ma"]["final_is_model"] for r in ranks)
    assert _identical(finals, list(finals[0]))
    last = [r["ma"]["post"][-1] for r in ranks]
    assert not _identical(last, keys), "steps 9-10 were local, so the final average has work to do"
    for key in keys:
        np.testing.assert_allclose(finals[0][key].double().numpy(), _mean(last, key), rtol=1e-6, atol=1e-7)
    # Integer buffers count steps; they are not averaged (every rank took all 10 steps).
    assert all(f["norm.num_batches_tracked"].item() == MA["steps"] for f in finals)


def test_model_averaging_comm_bytes(ranks):
    for rank, r in enumerate(ranks):
        run = r["ma"]
        start = BROADCAST_BYTES if rank == 0 else 0  # only the broadcast's root puts bytes in
        assert run["comm_after_prepare"] == start
        expected, syncs = [], 0
        for step in range(1, MA["steps"] + 1):
            syncs += step in (1, 2, 5, 8)
            expected.append(start + syncs * SYNC_BYTES)
        assert run["comm"] == expected
        assert run["comm_final"] == start + 5 * SYNC_BYTES


# ---------------------------------------------------------------------------- ElasticAveraging


def test_elastic_update_matches_the_easgd_formulas(ranks):
    alpha = ranks[0]["ea_alpha"]
    assert alpha == pytest.approx(0.9 / WORLD)
    keys = _floating(ranks[0]["ea"]["init"])
    center = {k: ranks[0]["ea"]["init"][k].double().numpy() for k in keys}
    for step in range(EA["steps"]):
        pre = [{k: r["ea"]["pre"][step][k].double().numpy() for k in keys} for r in ranks]
        post = [r["ea"]["post"][step] for r in ranks]
        synced = (step + 1) % EA["sync_every"] == 0
        for key in keys:
            diffs = [p[key] - center[key] for p in pre]
            for rank, (p, q) in enumerate(zip(pre, post)):
                expected = p[key] - alpha * diffs[rank] if synced else p[key]
                np.testing.assert_allclose(
                    q[key].double().numpy(),
                    expected,
                    rtol=1e-5,
                    atol=1e-6,
                    err_msg=f"step {step + 1} rank {rank} {key}",
                )
            if synced:
                center[key] = center[key] + alpha * np.sum(diffs, axis=0)
        # Elastic averaging keeps the replicas apart: they never become identical.
        assert not _identical(post, keys)
    # final_module: one more round for step 7, then every rank returns the center.
    last = [{k: r["ea"]["post"][-1][k].double().numpy() for k in keys} for r in ranks]
    finals = [r["ea"]["final"] for r in ranks]
    assert _identical(finals, keys)
    for key in keys:
        center[key] = center[key] + alpha * np.sum([x[key] - center[key] for x in last], axis=0)
        np.testing.assert_allclose(finals[0][key].double().numpy(), center[key], rtol=1e-5, atol=1e-6, err_msg=key)
    assert all(r["ea"]["final_is_model"] for r in ranks)
    assert ranks[0]["ea"]["syncs"] == 3


def test_elastic_averaging_comm_bytes(ranks):
    for rank, r in enumerate(ranks):
        start = BROADCAST_BYTES if rank == 0 else 0
        assert r["ea"]["comm"] == [start + ((s + 1) // EA["sync_every"]) * SYNC_BYTES for s in range(EA["steps"])]
        assert r["ea"]["comm_final"] == start + 3 * SYNC_BYTES


def test_loops_that_skip_prepare_optimizer_fail_clearly(ranks):
    for r in ranks:
        assert "ctx.prepare_optimizer" in r["misuse"]["no_optimizer"]
        assert "1 parameter(s)" in r["misuse"]["stray_parameter"]


# ------------------------------------------------------------------------ no process group needed


def _env(world_size: int) -> DistEnv:
    return DistEnv(
        rank=0,
        world_size=world_size,
        device=torch.device("cpu"),
        backend="gloo",
        master_addr="127.0.0.1",
        master_port=1,
    )


@pytest.mark.parametrize(
    "build, needle",
    [
        (lambda: ModelAveraging(sync_every=0), "ModelAveraging.sync_every=0 must be a positive integer"),
        (lambda: ModelAveraging(sync_every=2.5), "ModelAveraging.sync_every=2.5 must be a positive integer"),
        (lambda: ModelAveraging(sync_every=True), "ModelAveraging.sync_every=True must be a positive integer"),
        (lambda: ModelAveraging(warmup_steps=-1), "ModelAveraging.warmup_steps=-1 must be an integer >= 0"),
        (lambda: ElasticAveraging(sync_every=-3), "ElasticAveraging.sync_every=-3 must be a positive integer"),
        (lambda: ElasticAveraging(alpha=0), "ElasticAveraging.alpha=0 must be None"),
        (lambda: ElasticAveraging(alpha=1.0), "ElasticAveraging.alpha=1.0 must be None"),
        (lambda: ElasticAveraging(alpha=float("nan")), "ElasticAveraging.alpha=nan must be None"),
        (lambda: ElasticAveraging(alpha="0.1"), "ElasticAveraging.alpha='0.1' must be None"),
    ],
)
def test_config_errors_name_the_field_value_and_what_is_valid(build, needle):
    with pytest.raises(ConfigError) as info:
        build()
    assert needle in str(info.value)


def test_elastic_alpha_times_workers_must_stay_below_one():
    with pytest.raises(ConfigError, match=r"alpha=0\.3 is too large for 4 workers.*use alpha < 0\.25"):
        ElasticAveraging(alpha=0.3).create_runtime(_env(4))
    assert ElasticAveraging(alpha=0.3).create_runtime(_env(3)).alpha == 0.3
    assert ElasticAveraging().create_runtime(_env(8)).alpha == pytest.approx(0.9 / 8)


def test_strategies_are_registered_exported_and_frozen():
    assert strategy_from_name("model_averaging", sync_every=4) == sparkdl.ModelAveraging(sync_every=4)
    assert strategy_from_name("elastic_averaging", alpha=0.2) == sparkdl.ElasticAveraging(alpha=0.2)
    assert sparkdl.ModelAveraging.identical_final_weights and sparkdl.ElasticAveraging.identical_final_weights
    assert ModelAveraging(sync_every=4).describe() == {
        "name": "model_averaging",
        "sync_every": 4,
        "warmup_steps": 0,
        "outer_optimizer": None,
    }
    with pytest.raises(AttributeError):
        ModelAveraging().sync_every = 2  # type: ignore[misc]


def test_prepare_optimizer_before_prepare_model_fails_clearly():
    runtime = ModelAveraging().create_runtime(_env(2))
    with pytest.raises(RuntimeError, match=r"call ctx.prepare_model\(module\) before ctx.prepare_optimizer"):
        runtime.prepare_optimizer(torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1))


def test_wrapped_optimizer_behaves_like_the_optimizer_it_wraps():
    model = torch.nn.Linear(3, 1)
    inner = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    events: List[str] = []
    inner.register_step_post_hook(lambda *_: events.append("inner step"))
    wrapped = SyncingOptimizer(inner, lambda: events.append("sync point"))
    assert isinstance(wrapped, torch.optim.Optimizer)
    assert wrapped.param_groups is inner.param_groups and wrapped.defaults is inner.defaults
    scheduler = torch.optim.lr_scheduler.StepLR(wrapped, step_size=1, gamma=0.5)

    def closure() -> torch.Tensor:
        wrapped.zero_grad()
        loss = model(torch.ones(2, 3)).pow(2).mean()
        loss.backward()
        return loss

    loss = wrapped.step(closure)
    assert isinstance(loss, torch.Tensor)
    assert events == ["inner step", "sync point"]  # the strategy acts after the real step
    scheduler.step()
    assert inner.param_groups[0]["lr"] == pytest.approx(0.05)
    assert wrapped.state is inner.state and len(inner.state) == 2  # momentum buffers, one per param
    saved = wrapped.state_dict()
    assert saved["param_groups"] == inner.state_dict()["param_groups"]
    wrapped.zero_grad()
    assert all(p.grad is None for p in model.parameters())
    other = torch.optim.SGD(model.parameters(), lr=1.0, momentum=0.9)
    SyncingOptimizer(other, lambda: None).load_state_dict(saved)
    assert other.param_groups[0]["lr"] == pytest.approx(0.05) and len(other.state) == 2
    extra = torch.nn.Parameter(torch.zeros(1))
    wrapped.add_param_group({"params": [extra]})
    assert inner.param_groups[-1]["params"] == [extra]
    assert "SGD" in repr(wrapped)
