"""The parameter server's shards on a new number of ranks (elastic resume).

A checkpoint of N ranks holds N shards of each table, cut by the N-rank layout. On M ranks every
parameter's values and its server-optimizer state (Adam's moments, momentum buffers: tensors
shaped like the parameter's piece; step counters: scalars) are gathered from the old shards that
held its pieces and cut again by the M-rank layout (:mod:`~sparkdl.strategies.parameter_server.layout`),
so each lands on its new owner. The clocks restart level: every worker at the checkpoint's clock.

The dense shards are small: :func:`relayout_state` takes every old part's at once and builds each
parameter whole. The sparse tables' rows are not: :func:`each_old_part` hands them to
:func:`~sparkdl.strategies.parameter_server.sparse_checkpoint.reshard_tables` one old part at a
time, keeping only the dense shards of each.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from sparkdl.strategies.parameter_server.layout import Segment, TableSpec, make_layout, shard_segments

__all__ = ["each_old_part", "relayout_state"]


def _optimizer_order(spec: TableSpec, segments: List[Segment]) -> List[int]:
    """Segment indexes in the order of the shard optimizer's parameters (as :class:`Shard` builds it)."""
    by_group: Dict[int, List[int]] = {}
    for index, segment in enumerate(segments):
        by_group.setdefault(spec.groups[segment.param], []).append(index)
    return [index for group in sorted(by_group) for index in by_group[group]]


def _is_piece(value: Any, segment: Segment) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.numel() == segment.size


def _gather(
    spec: TableSpec, old_spec: TableSpec, saved: Sequence[Dict[str, Any]]
) -> Tuple[List[torch.Tensor], List[Dict[str, Any]], List[Dict[int, Dict[str, Any]]]]:
    """Every parameter's whole flat values and optimizer state from the old shards, and each old
    shard's hyperparameters per user param group."""
    sizes = spec.sizes
    values = [torch.empty(size, dtype=spec.dtype) for size in sizes]
    states: List[Dict[str, Any]] = [{} for _ in sizes]
    groups: List[Dict[int, Dict[str, Any]]] = []
    for shard, table in enumerate(saved):
        segments = shard_segments(old_spec.layout, sizes, shard)
        flat = table["values"]
        for segment in segments:
            values[segment.param][segment.start : segment.stop] = flat[segment.offset : segment.offset + segment.size]
        optimizer = table.get("optimizer")
        hyper: Dict[int, Dict[str, Any]] = {}
        if optimizer is not None:
            order = _optimizer_order(old_spec, segments)
            for q, index in enumerate(order):
                segment = segments[index]
                for key, value in optimizer["state"].get(q, {}).items():
                    if _is_piece(value, segment):
                        whole = states[segment.param].setdefault(
                            key, torch.zeros(sizes[segment.param], dtype=value.dtype)
                        )
                        whole[segment.start : segment.stop] = value.reshape(-1)
                    else:
                        states[segment.param][key] = value
            user_groups = sorted({old_spec.groups[s.param] for s in segments})
            for user_group, group in zip(user_groups, optimizer["param_groups"]):
                hyper[user_group] = {k: v for k, v in group.items() if k != "params"}
        groups.append(hyper)
    return values, states, groups


def each_old_part(
    old: Sequence[Sequence[Dict[str, Any]]], dense: List[Dict[str, Any]]
) -> Iterator[List[Dict[str, Any]]]:
    """The old ranks' sparse-table states (their ``"sparse"`` entries), in rank order. Each old
    part's strategy state is taken once (``old[i][1]``, which an elastic resume reads from the
    checkpoint then: :func:`sparkdl._runtime.resume.old_rank_states`) and released before the
    next is taken; its dense shards (every other entry) are appended to ``dense`` on the way."""
    for pair in old:
        state = pair[1]
        dense.append({key: value for key, value in state.items() if key != "sparse"})
        rows = state.get("sparse", [])
        del state, pair
        yield rows
        del rows  # released before the next part is read


def relayout_state(
    kind: str,
    old_states: Sequence[Dict[str, Any]],
    tables: Sequence[Tuple[TableSpec, Optional[torch.optim.Optimizer]]],
    rank: int,
    world_size: int,
) -> Dict[str, Any]:
    """New rank ``rank``'s :meth:`ParameterServerRuntime.state_dict` from the old ranks' ones.

    Args:
        kind: the strategy's ``layout``.
        old_states: every old rank's parameter-server state, in rank order.
        tables: this rank's tables (spec with the new layout, the shard's server optimizer or None).
        rank, world_size: the new rank and number of ranks.

    Raises:
        ValueError: the checkpoint's tables are not this run's parameters.
    """
    old_world = len(old_states)
    out = []
    for index, (spec, optimizer) in enumerate(tables):
        saved = [state["tables"][index] for state in old_states]
        old_spec = dataclasses.replace(spec, layout=make_layout(kind, spec.sizes, old_world))
        if any(table["fingerprint"] != old_spec.fingerprint() for table in saved):
            raise ValueError(
                f"ParameterServer checkpoint of table {spec.table} holds different parameters than this run prepared"
            )
        values, states, hyper = _gather(spec, old_spec, saved)
        segments = shard_segments(spec.layout, spec.sizes, rank)
        low, high = spec.shard_bounds(rank)
        flat = torch.empty(high - low, dtype=spec.dtype)
        for segment in segments:
            flat[segment.offset : segment.offset + segment.size] = values[segment.param][segment.start : segment.stop]
        optimizer_state = None
        piece_keys = _piece_keys(saved, old_spec)
        if optimizer is not None:
            state: Dict[int, Dict[str, Any]] = {}
            for q, seg_index in enumerate(_optimizer_order(spec, segments)):
                segment = segments[seg_index]
                shape = spec.shapes[segment.param] if segment.size == spec.sizes[segment.param] else (segment.size,)
                entry = {}
                for key, value in states[segment.param].items():
                    is_whole = (
                        isinstance(value, torch.Tensor)
                        and value.dim() == 1
                        and value.numel() == spec.sizes[segment.param]
                        and key in piece_keys
                    )
                    entry[key] = (
                        value[segment.start : segment.stop].clone().view(shape)
                        if is_whole
                        else (value.clone() if isinstance(value, torch.Tensor) else value)
                    )
                if entry:
                    state[q] = entry
            param_groups = optimizer.state_dict()["param_groups"]
            user_groups = sorted({spec.groups[s.param] for s in segments})
            for user_group, group in zip(user_groups, param_groups):
                for old in hyper:
                    if user_group in old:
                        group.update(old[user_group])
                        break
            optimizer_state = {"state": state, "param_groups": param_groups}
        clock = int(saved[0]["worker_clock"])
        out.append(
            {
                "fingerprint": spec.fingerprint(),
                "values": flat,
                "optimizer": optimizer_state,
                "clocks": [clock] * world_size,
                "updates": max(int(table.get("updates", 0)) for table in saved),
                "worker_clock": clock,
            }
        )
    return {"format": 1, "rank": rank, "world_size": world_size, "tables": out}


def _piece_keys(saved: Sequence[Dict[str, Any]], old_spec: TableSpec) -> set:
    """Optimizer-state keys that hold a piece of the parameter (not a scalar) in the old shards."""
    keys = set()
    for shard, table in enumerate(saved):
        optimizer = table.get("optimizer")
        if optimizer is None:
            continue
        segments = shard_segments(old_spec.layout, old_spec.sizes, shard)
        for q, index in enumerate(_optimizer_order(old_spec, segments)):
            for key, value in optimizer["state"].get(q, {}).items():
                if _is_piece(value, segments[index]):
                    keys.add(key)
    return keys
