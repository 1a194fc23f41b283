"""Elastic resume's strategy state without Spark: parameter-server shards re-laid out for a new
number of ranks, and the averaging strategies' merge of the old replicas."""

from __future__ import annotations

import math

import pytest
import torch

from sparkdl.strategies._reshard import average_states, averaged_reshard
from sparkdl.strategies.parameter_server.layout import TableSpec, make_layout, shard_segments
from sparkdl.strategies.parameter_server.reshard import relayout_state
from sparkdl.strategies.parameter_server.shard import Shard

SHAPES = ((4, 3), (5,), (2, 2), (7,))
GROUPS = (0, 0, 1, 1)


def _spec(kind: str, world_size: int) -> TableSpec:
    sizes = [math.prod(s) for s in SHAPES]
    return TableSpec(0, torch.float32, SHAPES, GROUPS, 2, make_layout(kind, sizes, world_size))


def _template() -> torch.optim.Optimizer:
    params = [torch.nn.Parameter(torch.zeros(s)) for s in SHAPES]
    return torch.optim.Adam([{"params": params[:2], "lr": 0.1}, {"params": params[2:], "lr": 0.01}], betas=(0.8, 0.9))


def _flat_params(values) -> torch.Tensor:
    return torch.cat([v.reshape(-1) for v in values])


class _Table:
    """One table's shards on ``world_size`` ranks, fed whole-parameter gradients."""

    def __init__(self, kind: str, world_size: int, params) -> None:
        self.spec = _spec(kind, world_size)
        self.world_size = world_size
        sizes = self.spec.sizes
        wire = torch.cat([params[i].reshape(-1) for i in self.spec.layout.order])
        self.shards = []
        for rank in range(world_size):
            low, high = self.spec.shard_bounds(rank)
            self.shards.append(Shard(self.spec, rank, world_size, None, 5.0, wire[low:high], _template()))
        self.sizes = sizes

    def push(self, clock: int, grads) -> None:
        wire = torch.cat([grads[i].reshape(-1) for i in self.spec.layout.order])
        for shard in self.shards:
            low, high = self.spec.shard_bounds(shard.rank)
            shard.push(0, clock, [float("nan")] * 2, wire[low:high])  # one update per clock, whatever the ranks

    def params(self):
        out = [torch.empty(s) for s in self.sizes]
        for shard in self.shards:
            for segment in shard_segments(self.spec.layout, self.sizes, shard.rank):
                out[segment.param][segment.start : segment.stop] = shard.values[
                    segment.offset : segment.offset + segment.size
                ]
        return out

    def states(self, clock: int):
        return [
            {
                "format": 1,
                "rank": s.rank,
                "world_size": self.world_size,
                "tables": [{**s.state_dict(), "worker_clock": clock}],
            }
            for s in self.shards
        ]

    def load(self, states) -> None:
        for shard, state in zip(self.shards, states):
            shard.load_state_dict(state["tables"][0])


@pytest.mark.parametrize("kind", ["balanced", "tensors"])
@pytest.mark.parametrize("old_world, new_world", [(2, 1), (1, 2), (2, 3), (3, 2)])
def test_parameter_server_shards_are_re_laid_out_with_their_optimizer_state(kind, old_world, new_world):
    torch.manual_seed(0)
    start = [torch.randn(s) for s in SHAPES]
    grads = [[torch.randn(s) for s in SHAPES] for _ in range(4)]
    # Adam is elementwise: any sharding of the same pushes gives the same parameters.
    reference, old = _Table(kind, 1, start), _Table(kind, old_world, start)
    for clock in range(3):
        reference.push(clock, grads[clock])
        old.push(clock, grads[clock])
    saved = old.states(clock=3)
    new = _Table(kind, new_world, [torch.zeros(s) for s in SHAPES])
    new.load(
        [relayout_state(kind, saved, [(new.spec, s.optimizer)], rank, new_world) for rank, s in enumerate(new.shards)]
    )
    assert torch.allclose(_flat_params(new.params()), _flat_params(reference.params()))
    assert all(s.clock.clocks == [3] * new_world for s in new.shards)
    # The moments and step counters moved with the values: the next step is the reference's too.
    reference.push(3, grads[3])
    new.push(3, grads[3])
    assert torch.allclose(_flat_params(new.params()), _flat_params(reference.params()), atol=1e-6)
    lrs = sorted({g["lr"] for s in new.shards if s.optimizer for g in s.optimizer.param_groups})
    assert set(lrs) <= {0.1, 0.01}


def test_a_checkpoint_of_other_parameters_is_refused():
    start = [torch.zeros(s) for s in SHAPES]
    old = _Table("balanced", 2, start)
    saved = old.states(clock=0)
    saved[1]["tables"][0]["fingerprint"] = "something else"
    new = _Table("balanced", 1, start)
    with pytest.raises(ValueError, match="different parameters"):
        relayout_state("balanced", saved, [(new.spec, new.shards[0].optimizer)], 0, 1)


def test_model_averaging_starts_new_ranks_from_the_average_of_the_old_replicas():
    replicas = [
        {"w": torch.tensor([1.0, 2.0]), "steps": torch.tensor(5)},
        {"w": torch.tensor([3.0, 6.0]), "steps": torch.tensor(5)},
    ]
    old = [({"model": replica, "optimizer": {"rank": r}}, {"steps": 7}) for r, replica in enumerate(replicas)]
    assert torch.equal(average_states(replicas)["w"], torch.tensor([2.0, 4.0]))
    for rank in range(3):
        user, strategy = averaged_reshard(old, rank)
        assert torch.equal(user["model"]["w"], torch.tensor([2.0, 4.0])) and int(user["model"]["steps"]) == 5
        assert user["optimizer"] == {"rank": rank % 2} and strategy == {"steps": 7}
