"""ShardedDataParallel on two real gloo ranks (no Spark): sharding, the gathered result,
checkpoint state and exact resume, and the bad-input errors."""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any, Dict, List

import pytest
import torch

import sparkdl
from sparkdl.errors import ConfigError
from tests.gloo import cpu_env, join_group, save_results, spawn_ranks

WORLD = 2
STEPS = 6
BATCH = 8
# min_params below every Linear's size: each Linear is its own shard unit, the root holds none.
CONFIG = sparkdl.ShardedDataParallel(min_params=100)


def _mlp() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(12, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 5)
    )


def _batches() -> List[List[torch.Tensor]]:
    """batches[step][rank] = (x, y), the same on every rank."""
    gen = torch.Generator().manual_seed(7)
    return [
        [(torch.randn(BATCH, 12, generator=gen), torch.randint(0, 5, (BATCH,), generator=gen)) for _ in range(WORLD)]
        for _ in range(STEPS)
    ]


def _prepared(rank: int, port: int, config: sparkdl.ShardedDataParallel = CONFIG, seed: int = 0):
    torch.manual_seed(seed)
    runtime = config.create_runtime(cpu_env(rank, port, WORLD))
    model = runtime.prepare_model(_mlp())
    optimizer = runtime.prepare_optimizer(torch.optim.Adam(model.parameters(), lr=1e-2))
    return runtime, model, optimizer


def _train(model, optimizer, rank: int, steps) -> None:
    for step in steps:
        x, y = step[rank]
        optimizer.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()


def _digest(module: torch.nn.Module) -> str:
    digest = hashlib.sha256()
    for name, tensor in sorted(module.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().contiguous().numpy().tobytes())
    return digest.hexdigest()


def _error(fn) -> str:
    try:
        fn()
    except ConfigError as exc:
        return str(exc)
    return "no error"


def _worker(rank: int, port: int, out_dir: str) -> None:
    from sparkdl._runtime.checkpoint_writer import capture
    from sparkdl.checkpoint import decode_part, encode_part

    join_group(rank, port, WORLD)
    batches = _batches()
    out: Dict[str, Any] = {}

    # Different seeds per rank: prepare_model must start both from rank 0's weights.
    runtime, model, optimizer = _prepared(rank, port, seed=100 + rank)
    out["local_param_numel"] = sum(p.to_local().numel() for p in model.parameters())
    out["param_types"] = sorted({type(p).__name__ for p in model.parameters()})
    _train(model, optimizer, rank, batches)
    out["local_optimizer_numel"] = sum(
        v.to_local().numel() for entry in optimizer.state.values() for k, v in entry.items() if k != "step"
    )
    out["comm_bytes"] = runtime.comm_bytes
    final = runtime.final_module(model)
    out["final_type"] = type(final).__name__
    out["final_state"] = {k: v.detach().clone() for k, v in final.state_dict().items()}
    out["final_digest"] = _digest(final)
    out["final_is_plain"] = all(type(p) is torch.nn.Parameter for p in final.parameters())
    out["predicts"] = final(batches[0][0][0]).shape
    # Uneven numbers of forward passes on the evaluation copy: no collective, so no hang.
    evaluation = runtime.evaluation_module(model)
    with torch.no_grad():
        outputs = [evaluation(batches[step][rank][0]) for step in range(3 if rank == 0 else 1)]
    out["evaluation_digest"] = _digest(evaluation)
    out["evaluation_outputs"] = len(outputs)

    # Exact resume: 3 steps, a checkpoint part through the real encode/decode (weights_only),
    # a fresh sharded model and optimizer loading it, 3 more steps == 6 uninterrupted steps.
    runtime_a, model_a, opt_a = _prepared(rank, port)
    _train(model_a, opt_a, rank, batches)
    straight = _digest(runtime_a.final_module(model_a))
    runtime_b, model_b, opt_b = _prepared(rank, port)
    _train(model_b, opt_b, rank, batches[:3])
    part = capture(
        user=runtime_b.model_state(model_b, opt_b),
        replicated=None,
        strategy={},
        grad_scaler=None,
        batches_taken=0,
        device=torch.device("cpu"),
        rank=rank,
        world_size=WORLD,
    )
    _train(model_b, opt_b, rank, batches[3:4])  # steps after the save must not leak into it
    saved = decode_part(encode_part(3, WORLD, rank, part), 3, WORLD, rank).user
    out["saved_types"] = sorted({type(v).__name__ for v in saved["model"].values()})
    runtime_c, model_c, opt_c = _prepared(rank, port, seed=55)
    runtime_c.load_model_state(model_c, opt_c, saved)
    _train(model_c, opt_c, rank, batches[3:])
    out["resume_equal"] = _digest(runtime_c.final_module(model_c)) == straight
    # Resuming without the optimizer state is not the same run: the test could fail.
    runtime_d, model_d, opt_d = _prepared(rank, port, seed=55)
    runtime_d.load_model_state(model_d, torch.optim.Adam(model_d.parameters(), lr=1e-2), saved)
    _train(model_d, opt_d, rank, batches[3:])
    out["resume_without_optimizer_equal"] = _digest(runtime_d.final_module(model_d)) == straight

    wrong = {**saved, "sharded": {**saved["sharded"], "world_size": 3}}
    out["error_world_size"] = _error(lambda: runtime_c.load_model_state(model_c, opt_c, wrong))
    out["error_other_strategy"] = _error(
        lambda: runtime_c.load_model_state(model_c, opt_c, {"model": {}, "optimizer": {}})
    )

    def prepare(module, config=CONFIG):
        return lambda: config.create_runtime(cpu_env(rank, port, WORLD)).prepare_model(module)

    out["error_shard_modules"] = _error(prepare(_mlp(), sparkdl.ShardedDataParallel(shard_modules=("encoder",))))
    out["error_container"] = _error(
        prepare(
            torch.nn.Sequential(torch.nn.ModuleList([torch.nn.Linear(2, 2)])),
            sparkdl.ShardedDataParallel(shard_modules=("0",)),
        )
    )
    out["error_no_params"] = _error(prepare(torch.nn.ReLU()))
    out["error_sparse"] = _error(prepare(torch.nn.Sequential(torch.nn.Embedding(10, 4, sparse=True))))
    scalar = torch.nn.Module()
    scalar.scale = torch.nn.Parameter(torch.tensor(2.0))
    out["error_fully_shard"] = _error(prepare(scalar))
    out["error_sharded_twice"] = _error(prepare(model))  # the sharded model trained above
    # Named by class name: every Linear becomes a unit.
    by_class = (
        sparkdl.ShardedDataParallel(shard_modules=("Linear",))
        .create_runtime(cpu_env(rank, port, WORLD))
        .prepare_model(_mlp())
    )
    out["units_by_class"] = sorted(
        name for name, sub in by_class.named_modules() if type(sub).__name__.startswith("FSDP")
    )

    # bf16-mixed: the run's autocast around FSDP's forward; weights and gradients stay float32.
    from sparkdl._runtime.precision import Precision, PrecisionRuntime

    amp = PrecisionRuntime(Precision("bf16-mixed"), torch.device("cpu"), WORLD)
    _, model_e, opt_e = _prepared(rank, port)
    x, y = batches[0][rank]
    with amp.autocast():
        output = model_e(x)
        loss = torch.nn.functional.cross_entropy(output, y)
    amp.backward_and_step(loss, opt_e, max_grad_norm=1.0)
    out["bf16_output_dtype"] = str(output.dtype)
    out["bf16_param_dtype"] = sorted({str(p.dtype) for p in model_e.parameters()})
    out["bf16_finite"] = bool(torch.isfinite(loss.float()))

    # 16-mixed's overflow check on sharded gradients (a CPU grad scaler stands in for the GPU's):
    # an inf in rank 1's shard only must make both ranks skip the step.
    scaled = PrecisionRuntime(Precision("16-mixed"), torch.device("cpu"), WORLD, scaler=torch.amp.GradScaler("cpu"))
    _, model_f, opt_f = _prepared(rank, port)
    x, y = batches[0][rank]
    torch.nn.functional.cross_entropy(model_f(x), y).backward()
    out["overflow_clean"] = scaled._overflow(opt_f)
    if rank == 1:
        next(iter(model_f.parameters())).grad.to_local().view(-1)[0] = float("inf")
    out["overflow_one_rank"] = scaled._overflow(opt_f)
    save_results(out, out_dir, rank)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> List[Dict[str, Any]]:
    return spawn_ranks(_worker, WORLD, str(tmp_path_factory.mktemp("sharded")))


def _reference() -> Dict[str, torch.Tensor]:
    """One unsharded model trained on both ranks' batches at once: what sharded data
    parallelism computes, up to float rounding."""
    torch.manual_seed(100)  # rank 0's seed: its weights are the ones broadcast
    model = _mlp()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for step in _batches():
        optimizer.zero_grad()
        x = torch.cat([x for x, _ in step])
        y = torch.cat([y for _, y in step])
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    return model.state_dict()


def test_parameters_and_optimizer_state_are_sharded(ranks):
    total = sum(p.numel() for p in _mlp().parameters())
    assert all(r["param_types"] == ["DTensor"] for r in ranks)
    for r in ranks:
        # Linear(32, 5)'s 5 rows split 3 + 2: within a few rows of an even split.
        assert abs(r["local_param_numel"] - total / WORLD) <= 40, (r["local_param_numel"], total)
        # Adam's two moments per parameter, sharded like the parameters.
        assert r["local_optimizer_numel"] == 2 * r["local_param_numel"]
    assert sum(r["local_param_numel"] for r in ranks) == total


def test_final_module_is_the_full_trained_model_on_every_rank(ranks):
    reference = _reference()
    for r in ranks:
        assert r["final_type"] == "Sequential" and r["final_is_plain"]
        assert {k: tuple(v.shape) for k, v in r["final_state"].items()} == {
            k: tuple(v.shape) for k, v in reference.items()
        }
        for name, tensor in reference.items():
            torch.testing.assert_close(r["final_state"][name], tensor, rtol=1e-4, atol=1e-5, msg=name)
        assert tuple(r["predicts"]) == (BATCH, 5)
    assert ranks[0]["final_digest"] == ranks[1]["final_digest"]


def test_evaluation_module_is_a_plain_copy_ranks_may_run_unevenly(ranks):
    assert [r["evaluation_outputs"] for r in ranks] == [3, 1]
    assert all(r["evaluation_digest"] == r["final_digest"] for r in ranks)


def test_comm_bytes_count_the_gathers_and_reduce_scatters(ranks):
    model_bytes = sum(p.numel() * 4 for p in _mlp().parameters())
    # Three Linear units, resharded after forward: two all-gathers and one reduce-scatter each,
    # in each of which one of the two ranks sends the half of the bytes the other holds.
    assert ranks[0]["comm_bytes"] == STEPS * 3 * model_bytes // 2


def test_checkpoint_holds_plain_shards_and_resume_is_exact(ranks):
    for r in ranks:
        assert r["saved_types"] == ["Tensor"]
        assert r["resume_equal"]
        assert not r["resume_without_optimizer_equal"]


@pytest.mark.parametrize(
    "key, needles",
    [
        ("error_world_size", ["num_workers=2", "3 workers"]),
        ("error_other_strategy", ["no ShardedDataParallel state"]),
        ("error_shard_modules", ["shard_modules", "'encoder'", "Linear"]),
        ("error_container", ["shard_modules", "ModuleList"]),
        ("error_no_params", ["has none", "ReLU"]),
        ("error_sparse", ["sparse=True", "'0'"]),
        ("error_fully_shard", ["fully_shard rejected the root module", "scalar", "min_params"]),
        ("error_sharded_twice", ["sharded already", "model()"]),
    ],
)
def test_bad_input_fails_naming_the_rank_and_the_setting(ranks, key, needles):
    for rank, r in enumerate(ranks):
        message = r[key]
        assert message.startswith(f"rank {rank}: ") or key == "error_other_strategy" and f"rank {rank}" in message, (
            message
        )
        for needle in needles:
            assert needle in message, (needle, message)


def test_shard_modules_by_class_name(ranks):
    assert ranks[0]["units_by_class"] == ["", "0", "2", "4"]  # the root and the three Linears


def test_bf16_mixed_runs_under_sharding(ranks):
    for r in ranks:
        assert r["bf16_finite"] and r["bf16_output_dtype"] == "torch.bfloat16"
        assert r["bf16_param_dtype"] == ["torch.float32"]


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        ({"reshard_after_forward": 1}, "reshard_after_forward=1"),
        ({"shard_modules": ("",)}, "shard_modules"),
        ({"shard_modules": 3}, "shard_modules=3"),
        ({"min_params": 0}, "min_params=0"),
    ],
)
def test_config_errors_name_the_field(kwargs, needle):
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        sparkdl.ShardedDataParallel(**kwargs)


def test_registered_frozen_and_a_string_is_one_module():
    assert sparkdl.strategies.strategy_from_name("sharded") == sparkdl.ShardedDataParallel()
    assert sparkdl.ShardedDataParallel(shard_modules="Block").shard_modules == ("Block",)
    with pytest.raises(dataclasses.FrozenInstanceError):
        sparkdl.ShardedDataParallel().min_params = 5  # type: ignore[misc]
    assert not sparkdl.ShardedDataParallel().create_runtime(cpu_env(0, 1, WORLD)).replicas_identical


def test_auto_policy_makes_units_of_large_enough_subtrees_never_of_containers():
    from sparkdl.strategies.sharded import shard_units

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = torch.nn.Linear(20, 20), torch.nn.Linear(20, 20)  # 420 parameters each

    model = torch.nn.Module()
    model.blocks = torch.nn.ModuleList([Block() for _ in range(3)])
    model.head = torch.nn.Linear(20, 2)  # 42: left to the root
    names = [name for name, _ in shard_units(model, sparkdl.ShardedDataParallel(min_params=500))]
    # Each Linear alone (420) is below 500, a Block (840) is not; the list never is a unit.
    assert names == ["blocks.0", "blocks.1", "blocks.2"]
    assert [n for n, _ in shard_units(model, sparkdl.ShardedDataParallel(min_params=400))] == [
        "blocks.0.a",
        "blocks.0.b",
        "blocks.1.a",
        "blocks.1.b",
        "blocks.2.a",
        "blocks.2.b",
    ]
    assert shard_units(model, sparkdl.ShardedDataParallel(min_params=10**6)) == []
    # Small Linears whose sum reaches min_params only in their ModuleList: the list has no
    # forward of its own, so it is no unit; its parameters go up to the root.
    small = torch.nn.Module()
    small.layers = torch.nn.ModuleList([torch.nn.Linear(10, 10) for _ in range(3)])  # 110 each
    assert shard_units(small, sparkdl.ShardedDataParallel(min_params=300)) == []


def test_an_elastic_resume_on_another_num_workers_fails_naming_it():
    runtime = sparkdl.ShardedDataParallel().create_runtime(cpu_env(1, 1, WORLD))
    with pytest.raises(ConfigError, match=r"rank 1: .*written by 3 workers.*num_workers=2.*use num_workers=3"):
        runtime.reshard_state([({}, {})] * 3, 3)


def test_sixteen_bit_overflow_in_one_ranks_shard_skips_the_step_on_every_rank(ranks):
    assert [r["overflow_clean"] for r in ranks] == [False, False]
    assert [r["overflow_one_rank"] for r in ranks] == [True, True]
