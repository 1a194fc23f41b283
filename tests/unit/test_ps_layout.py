"""How tables are cut into shards, alone: the layouts are pure functions of the parameter sizes
(no process group), and every rank must compute the same one."""

from __future__ import annotations

from typing import List

import pytest
import torch

from sparkdl.strategies.parameter_server.layout import (
    LAYOUTS,
    Layout,
    TableSpec,
    balanced_layout,
    make_layout,
    shard_segments,
    tensor_layout,
)

# ---- layouts ------------------------------------------------------------------------------------


def _covers_exactly_once(layout: Layout, sizes: List[int]) -> None:
    seen = [torch.zeros(size, dtype=torch.int32) for size in sizes]
    offset_check = []
    for shard in range(len(layout.bounds) - 1):
        position = 0
        for seg in shard_segments(layout, sizes, shard):
            assert seg.offset == position
            seen[seg.param][seg.start : seg.stop] += 1
            position += seg.size
        offset_check.append(position)
    assert offset_check == layout.sizes
    assert all(bool((s == 1).all()) for s in seen)
    assert sorted(layout.order) == list(range(len(sizes)))


@pytest.mark.parametrize("shards", [1, 2, 3, 7])
@pytest.mark.parametrize("sizes", [[4096, 64, 640, 10], [5], [1, 1, 1], [1000, 0, 3, 999_999]])
def test_balanced_layout_is_even_to_one_element_and_covers_everything(sizes, shards):
    layout = balanced_layout(sizes, shards)
    assert max(layout.sizes) - min(layout.sizes) <= 1
    assert layout.order == tuple(range(len(sizes)))
    _covers_exactly_once(layout, sizes)


@pytest.mark.parametrize("shards", [1, 2, 3, 7])
@pytest.mark.parametrize("sizes", [[4096, 64, 640, 10], [5], [3, 3, 2, 2, 2], [1000, 0, 3, 999_999]])
def test_tensor_layout_keeps_tensors_whole_and_covers_everything(sizes, shards):
    layout = tensor_layout(sizes, shards)
    _covers_exactly_once(layout, sizes)
    for shard in range(shards):
        for seg in shard_segments(layout, sizes, shard):
            assert (seg.start, seg.stop) == (0, sizes[seg.param])


def test_tensor_layout_is_greedy_largest_first():
    # LPT on [3, 3, 2, 2, 2] into 2 bins: 3->A, 3->B, 2->A, 2->B, 2->A: loads 7 and 5.
    layout = tensor_layout([3, 3, 2, 2, 2], 2)
    assert layout.sizes == [7, 5]
    assert layout.order == (0, 2, 4, 1, 3)
    # The digits MLP (64x64+64, 64x10+10) cannot be split evenly into two whole-tensor shards.
    digits = tensor_layout([4096, 64, 640, 10], 2)
    assert digits.sizes == [4096, 714]
    assert digits.imbalance() == pytest.approx(2 * 4096 / 4810)
    assert balanced_layout([4096, 64, 640, 10], 2).imbalance() == pytest.approx(1.0)


def test_more_shards_than_tensors():
    # Whole tensors: the extra shards stay empty (their servers hold nothing for this table).
    whole = tensor_layout([5, 3], 4)
    assert whole.sizes == [5, 3, 0, 0] and whole.order == (0, 1)
    assert [shard_segments(whole, [5, 3], k) for k in (2, 3)] == [[], []]
    assert whole.imbalance() == pytest.approx(4 * 5 / 8)
    # Balanced: tensors are cut, so every shard gets its share.
    cut = balanced_layout([5, 3], 4)
    assert cut.sizes == [2, 2, 2, 2]
    assert [(s.param, s.start, s.stop) for s in shard_segments(cut, [5, 3], 2)] == [(0, 4, 5), (1, 0, 1)]
    for layout in (whole, cut):
        _covers_exactly_once(layout, [5, 3])


@pytest.mark.parametrize("kind", LAYOUTS)
def test_one_shard_holds_everything_in_the_original_order(kind):
    sizes = [7, 1, 30, 2]
    layout = make_layout(kind, sizes, 1)
    assert layout.bounds == (0, 40) and layout.order == (0, 1, 2, 3) and layout.imbalance() == 1.0
    assert [(s.param, s.start, s.stop, s.offset) for s in shard_segments(layout, sizes, 0)] == [
        (0, 0, 7, 0),
        (1, 0, 1, 7),
        (2, 0, 30, 8),
        (3, 0, 2, 38),
    ]


@pytest.mark.parametrize("kind", LAYOUTS)
def test_no_parameters_make_empty_shards(kind):
    layout = make_layout(kind, [], 3)
    assert layout.order == () and layout.bounds == (0, 0, 0, 0)
    assert layout.sizes == [0, 0, 0] and layout.imbalance() == 1.0
    assert shard_segments(layout, [], 1) == []


@pytest.mark.parametrize("layout_fn", [balanced_layout, tensor_layout])
@pytest.mark.parametrize("shards", [0, -1])
def test_fewer_than_one_shard_is_an_error(layout_fn, shards):
    with pytest.raises(ValueError, match=f"num_shards={shards} must be >= 1"):
        layout_fn([4, 4], shards)


def test_make_layout_by_name():
    sizes = [3, 3, 2, 2, 2]
    assert LAYOUTS == ("balanced", "tensors")
    assert make_layout("balanced", sizes, 2) == balanced_layout(sizes, 2)
    assert make_layout("tensors", sizes, 2) == tensor_layout(sizes, 2)
    with pytest.raises(ValueError, match="unknown layout 'random'"):
        make_layout("random", sizes, 2)


def test_table_spec_sizes_bounds_and_fingerprint():
    layout = tensor_layout([6, 4], 2)
    spec = TableSpec(table=1, dtype=torch.float32, shapes=((2, 3), (4,)), groups=(0, 1), num_groups=2, layout=layout)
    assert spec.sizes == [6, 4]
    assert [spec.shard_bounds(k) for k in range(2)] == [(0, 6), (6, 10)]
    # Every rank builds its own spec: equal specs must agree, and any difference must show.
    assert (
        spec.fingerprint()
        == TableSpec(1, torch.float32, ((2, 3), (4,)), (0, 1), 2, tensor_layout([6, 4], 2)).fingerprint()
    )
    other_dtype = TableSpec(1, torch.float64, ((2, 3), (4,)), (0, 1), 2, layout)
    other_groups = TableSpec(1, torch.float32, ((2, 3), (4,)), (0, 0), 2, layout)
    other_layout = TableSpec(1, torch.float32, ((2, 3), (4,)), (0, 1), 2, balanced_layout([6, 4], 2))
    assert len({s.fingerprint() for s in (spec, other_dtype, other_groups, other_layout)}) == 4
