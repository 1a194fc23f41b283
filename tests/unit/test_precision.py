"""precision="32" | "bf16-mixed" | "16-mixed": validation, the autocast and grad-scaler decisions,
overflow skips agreed over ranks, and a real FitLoop step under bf16 autocast on the CPU."""

from __future__ import annotations

import functools
import math
import os
from typing import Any, Dict, List

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

import sparkdl
from sparkdl._driver import LaunchConfig
from sparkdl._runtime.precision import PRECISIONS, Precision, PrecisionRuntime
from sparkdl._runtime.rendezvous import rendezvous, teardown
from sparkdl._task.fit_loop import FitLoop
from sparkdl.context import TrainContext
from sparkdl.data.dataset import inspect_dataset
from sparkdl.data.readers import reader_from_name
from sparkdl.data.spec import DataSpec
from sparkdl.errors import ConfigError
from sparkdl.strategies._tensors import SyncingOptimizer as _SyncingOptimizer
from sparkdl.strategies.allreduce import AllReduce
from tests.gloo import join_group, save_results, spawn_ranks

CPU = torch.device("cpu")


# ---- validation --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "given, value",
    [("32", "32"), (32, "32"), ("32-true", "32"), ("bf16-mixed", "bf16-mixed"), ("16-mixed", "16-mixed")],
)
def test_valid_precisions_normalize(given, value):
    assert Precision(given).value == value
    assert LaunchConfig(num_workers=1, precision=given).precision == value


@pytest.mark.parametrize(
    "given, hint", [("bf16", "bf16-mixed"), ("fp16", "16-mixed"), (16, "16-mixed"), ("64", None), (True, None)]
)
def test_invalid_precision_is_a_config_error_listing_the_valid_ones(given, hint):
    with pytest.raises(ConfigError) as raised:
        Precision(given)
    message = str(raised.value)
    assert all(repr(p) in message for p in PRECISIONS)
    assert (f"did you mean {hint!r}" in message) if hint else "did you mean" not in message


def test_estimator_and_run_validate_precision_before_anything_starts():
    with pytest.raises(ConfigError, match="precision='half'"):
        sparkdl.TorchEstimator(model=lambda: torch.nn.Linear(2, 2), precision="half")
    with pytest.raises(ConfigError, match="precision='bf16'"):
        sparkdl.run(lambda ctx: None, num_workers=1, precision="bf16")  # fails before looking for Spark


# ---- decisions ---------------------------------------------------------------------------------


def test_fp32_and_bf16_need_no_grad_scaler_fp16_does():
    assert not Precision("32").needs_grad_scaler and Precision("32").autocast_dtype is None
    assert not Precision("bf16-mixed").needs_grad_scaler and Precision("bf16-mixed").autocast_dtype is torch.bfloat16
    assert Precision("16-mixed").needs_grad_scaler and Precision("16-mixed").autocast_dtype is torch.float16
    assert PrecisionRuntime(Precision("32"), CPU).scaler is None
    assert PrecisionRuntime(Precision("bf16-mixed"), CPU).scaler is None


def test_fp16_on_a_gpu_builds_a_grad_scaler():
    # This machine has no CUDA, so torch disables a "cuda" scaler (with a warning); what is
    # tested is sparkdl's decision to build one for the GPU.
    with pytest.warns(UserWarning, match="CUDA is not available"):
        runtime = PrecisionRuntime(Precision("16-mixed"), torch.device("cuda", 0))
    assert isinstance(runtime.scaler, torch.amp.GradScaler)
    assert runtime.dtype is torch.float16


def test_fp16_on_the_cpu_is_a_clear_error():
    with pytest.raises(ConfigError, match="precision='16-mixed' needs a GPU.*use precision='bf16-mixed'"):
        PrecisionRuntime(Precision("16-mixed"), CPU)


def test_bf16_autocast_runs_linear_layers_in_bfloat16_on_the_cpu():
    layer = torch.nn.Linear(8, 4)
    x = torch.randn(3, 8)
    with PrecisionRuntime(Precision("bf16-mixed"), CPU).autocast():
        assert layer(x).dtype is torch.bfloat16
    with PrecisionRuntime(Precision("32"), CPU).autocast():
        assert layer(x).dtype is torch.float32
    assert layer.weight.dtype is torch.float32  # the weights themselves stay float32


# ---- the grad scaler step and the cross-rank skip agreement ------------------------------------


def _scaled_runtime(world_size: int = 1, all_reduce_max=None) -> PrecisionRuntime:
    # torch.amp.GradScaler works on the CPU; it stands in for the CUDA one sparkdl builds.
    return PrecisionRuntime(
        Precision("16-mixed"),
        CPU,
        world_size=world_size,
        all_reduce_max=all_reduce_max,
        scaler=torch.amp.GradScaler("cpu", init_scale=1024.0),
    )


def _problem(poison: bool = False):
    torch.manual_seed(0)
    layer = torch.nn.Linear(3, 1)
    x = torch.randn(4, 3)
    if poison:
        x[0, 0] = math.inf
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
    return layer, x, optimizer


def test_a_finite_step_is_taken_and_an_overflow_is_skipped_with_a_lower_scale():
    runtime = _scaled_runtime()
    layer, x, optimizer = _problem()
    before = layer.weight.detach().clone()
    assert runtime.backward_and_step(layer(x).pow(2).mean(), optimizer) is True
    assert not torch.equal(layer.weight, before) and runtime.scaler.get_scale() == 1024.0

    layer, x, optimizer = _problem(poison=True)
    before = layer.weight.detach().clone()
    assert runtime.backward_and_step(layer(x).sum(), optimizer) is False
    assert torch.equal(layer.weight, before) and runtime.scaler.get_scale() == 512.0


# Scenarios for two real gloo ranks: which ranks' gradients overflow. Each rank runs every one,
# through the default all-reduce (torch.distributed's MAX), and records what it did.
OVERFLOWS = {"rank 1 only": {1}, "rank 0 only": {0}, "none": set()}


def _overflow_worker(rank: int, port: int, out_dir: str) -> None:
    join_group(rank, port, 2)
    results: Dict[str, Any] = {}
    for name, overflowing in OVERFLOWS.items():
        runtime = _scaled_runtime(world_size=2)  # no all_reduce_max: torch.distributed's
        poisoned = rank in overflowing
        layer, x, inner = _problem(poison=poisoned)
        after_steps: List[int] = []
        # The averaging strategies' wrapper counts step() calls to schedule their collectives.
        optimizer = _SyncingOptimizer(inner, functools.partial(after_steps.append, 1))
        before = layer.weight.detach().clone()
        loss = layer(x).sum() if poisoned else layer(x).pow(2).mean()
        stepped = runtime.backward_and_step(loss, optimizer)
        results[name] = {
            "stepped": stepped,
            "weights_moved": not torch.equal(layer.weight, before),
            "after_steps": len(after_steps),
            "scale": runtime.scaler.get_scale(),
        }
    save_results(results, out_dir, rank)


@pytest.fixture(scope="module")
def overflow_ranks(tmp_path_factory) -> List[Dict[str, Any]]:
    """What each of two real gloo ranks did in every OVERFLOWS scenario (one spawn, ~5 s)."""
    return spawn_ranks(_overflow_worker, 2, str(tmp_path_factory.mktemp("overflow")))


@pytest.mark.parametrize("scenario", ["rank 1 only", "rank 0 only"])
def test_an_overflow_on_one_rank_skips_the_step_on_every_rank_alike(overflow_ranks, scenario):
    for rank in (0, 1):
        seen = overflow_ranks[rank][scenario]
        # Both skip, neither the inner optimizer nor the strategy's after-step ran, and both lower
        # the scale alike (the rank with finite gradients too), so the ranks stay in step.
        assert seen == {"stepped": False, "weights_moved": False, "after_steps": 0, "scale": 512.0}, (rank, seen)


def test_when_no_rank_overflows_every_rank_steps(overflow_ranks):
    for rank in (0, 1):
        assert overflow_ranks[rank]["none"] == {
            "stepped": True,
            "weights_moved": True,
            "after_steps": 1,
            "scale": 1024.0,
        }


def test_the_scaler_state_survives_a_checkpoint():
    runtime = _scaled_runtime()
    layer, x, optimizer = _problem(poison=True)
    runtime.backward_and_step(layer(x).sum(), optimizer)
    state = runtime.state_dict()
    assert state["scale"] == 512.0
    restored = _scaled_runtime()
    restored.load_state_dict(state)
    assert restored.scaler.get_scale() == 512.0
    assert PrecisionRuntime(Precision("bf16-mixed"), CPU).state_dict() is None


# ---- FitLoop on a one-rank process group -------------------------------------------------------


def _dataset(directory: str, rows: int = 256, width: int = 8):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((rows, width)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int64)
    column = pa.FixedSizeListArray.from_arrays(pa.array(x.reshape(-1)), width).cast(pa.list_(pa.float32()))
    os.makedirs(directory, exist_ok=True)
    pq.write_table(
        pa.table({"features": column, "label": y}), os.path.join(directory, "part-0.parquet"), row_group_size=64
    )
    return inspect_dataset(directory, ["features"], "label")


def _fit_one_rank(tmp_path, precision: str) -> Dict[str, Any]:
    """Runs the real FitLoop through a real TrainContext (reader, prefetch thread, DeviceFeed)."""
    seen: Dict[str, Any] = {"dtypes": set()}

    def model_fn() -> torch.nn.Module:
        module = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
        module[0].register_forward_hook(lambda _m, _i, out: seen["dtypes"].add(out.dtype))
        return module

    dataset = _dataset(str(tmp_path / "data"))
    env = rendezvous(0, 1, ["127.0.0.1:0"], lambda value: [value], CPU, timeout_s=60)
    runtime = AllReduce().create_runtime(env)
    records: List[Dict[str, Any]] = []
    ctx = TrainContext(
        env,
        runtime,
        records.append,
        dataset=dataset,
        data_spec=DataSpec(batch_size=32),
        reader=reader_from_name("arrow"),
        steps_per_epoch=4,
        precision=precision,
    )
    try:
        result = FitLoop(
            model=model_fn,
            optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
            loss=torch.nn.functional.cross_entropy,
            epochs=2,
            seed=0,
        )(ctx)
    finally:
        ctx.close()
        runtime.close()
        teardown()
    seen["result"] = result
    seen["records"] = records
    return seen


def test_fitloop_trains_under_bf16_autocast_with_float32_weights(tmp_path):
    seen = _fit_one_rank(tmp_path, "bf16-mixed")
    assert seen["dtypes"] == {torch.bfloat16}  # every forward ran under autocast
    result = seen["result"]
    assert result["precision"] == "bf16-mixed" and result["device"] == "cpu"
    assert [r["epoch"] for r in result["history"]] == [1, 2]
    assert all(math.isfinite(r["loss"]) for r in result["history"])
    import io

    weights = torch.load(io.BytesIO(result["state_dict"]), weights_only=True)
    assert all(w.dtype is torch.float32 for w in weights.values())


def test_fitloop_in_fp32_does_not_autocast(tmp_path):
    seen = _fit_one_rank(tmp_path, "32")
    assert seen["dtypes"] == {torch.float32}
    assert seen["result"]["precision"] == "32"


@pytest.mark.parametrize("scaled", [False, True])
def test_clipping_bounds_the_true_gradient_even_when_the_loss_is_scaled(scaled):
    runtime = _scaled_runtime() if scaled else PrecisionRuntime(Precision("32"), CPU)
    layer, x, optimizer = _problem()
    before = torch.cat([p.detach().reshape(-1).clone() for p in layer.parameters()])
    assert runtime.backward_and_step((layer(x) * 100).pow(2).mean(), optimizer, max_grad_norm=0.5)
    after = torch.cat([p.detach().reshape(-1) for p in layer.parameters()])
    # SGD without momentum, lr 0.1: the update is lr * the clipped gradient, of norm 0.5 — not
    # 0.5 / 1024, which clipping the scaled gradients would give.
    assert torch.linalg.vector_norm(after - before).item() == pytest.approx(0.1 * 0.5, rel=1e-4)


def test_an_optimizer_with_its_own_amp_handling_behind_a_strategy_wrapper_never_steps_on_an_overflow():
    # Fused optimizers (Adam(fused=True) on CUDA) set _step_supports_amp_scaling: GradScaler.step
    # would hand them grad_scale/found_inf as attributes — of the strategies' wrapper, not theirs.
    steps: List[int] = []

    class FusedLike(torch.optim.SGD):
        _step_supports_amp_scaling = True

        def step(self, closure=None):
            steps.append(1)
            return super().step(closure)

    runtime = _scaled_runtime()
    layer, x, _ = _problem(poison=True)
    optimizer = _SyncingOptimizer(FusedLike(layer.parameters(), lr=0.1), lambda: None)
    assert runtime.backward_and_step(layer(x).sum(), optimizer) is False
    assert steps == []
    layer, x, _ = _problem()
    optimizer = _SyncingOptimizer(FusedLike(layer.parameters(), lr=0.1), lambda: None)
    before = layer.weight.detach().clone()
    loss = layer(x).pow(2).mean()
    expected = torch.autograd.grad(loss, layer.weight, retain_graph=True)[0]
    assert runtime.backward_and_step(loss, optimizer) is True
    assert steps == [1]
    # The step used the true (unscaled) gradient.
    assert torch.allclose(before - layer.weight.detach(), 0.1 * expected, rtol=1e-5)
