"""The sparse tables' frames (ROW_PULL, ROW_PUSH, ROWS) on a real ShardServer over loopback: a
worker of the job pulls and pushes rows, encrypted or not; frames that are authentic but
inconsistent (sizes, ids out of range or owned by another rank, repeats, skipped clocks) drop
the connection before anything is applied. A row read waits for the staleness bound like a dense
one, and fails naming a lost worker instead of hanging."""

from __future__ import annotations

import logging
import socket
import threading
import time
from typing import Iterator

import pytest
import torch

from sparkdl.strategies.parameter_server.rows import RowOptimizer, initial_rows, owners
from sparkdl.strategies.parameter_server.shard import ServerState
from sparkdl.strategies.parameter_server.sparse_shard import SparseShard, SparseSpec
from sparkdl.strategies.parameter_server.transport import ShardClient, ShardServer, listen
from sparkdl.strategies.parameter_server.wire import (
    DTYPE_CODES,
    Header,
    Kind,
    ParameterServerError,
    byte_view,
    client_handshake,
)
from tests.sockets import closed_by_server

WORLD, ROWS, DIM = 2, 1000, 3
SECRET = bytes(range(32))
F32 = DTYPE_CODES[torch.float32]
SPEC = SparseSpec(0, "items", ROWS, DIM, torch.float32, 4, 1.0, RowOptimizer("sgd", 0.5))
#: Rows the server (rank 0) owns, and some it does not.
MINE = [i for i in range(ROWS) if int(owners(torch.tensor([i]), WORLD)) == 0][:5]
THEIRS = [i for i in range(ROWS) if int(owners(torch.tensor([i]), WORLD)) == 1][:2]


class _Server:
    def __init__(self, encrypt: bool = False) -> None:
        self.state = ServerState(0, WORLD, 5.0)
        self.shard = SparseShard(SPEC, 0, WORLD, None, 5.0)
        self.shard.depart(0, clean=True, reason="rank 0's own worker takes no part here")
        self.state.register_sparse(0, self.shard)
        self.server = ShardServer(listen("127.0.0.1"), SECRET, 0, WORLD, self.state, 5.0, encrypt=encrypt)


@pytest.fixture(params=[False, True], ids=["integrity", "encrypted"])
def server(request) -> Iterator[_Server]:
    srv = _Server(encrypt=request.param)
    yield srv
    srv.server.close()


def _pull(client: ShardClient, ids, clock: int = 0) -> torch.Tensor:
    ids = torch.tensor(ids, dtype=torch.int64)
    client.send(Header(Kind.ROW_PULL, F32, 0, client.rank, clock, len(ids), 8 * len(ids)), byte_view(ids))
    out = torch.empty(len(ids), DIM)
    reply = client.receive(byte_view(out), 0, Kind.ROWS)
    assert reply.kind == Kind.ROWS and reply.rank == 0
    return out


def _push(client: ShardClient, ids, grads: torch.Tensor, clock: int) -> None:
    ids = torch.tensor(ids, dtype=torch.int64)
    length = len(ids) * (8 + 4 * DIM)
    client.send(Header(Kind.ROW_PUSH, F32, 0, client.rank, clock, len(ids), length), byte_view(ids), byte_view(grads))
    client.receive(memoryview(bytearray(0)), 0, Kind.ROWS)


def test_a_worker_pulls_rows_pushes_gradients_and_reads_them_back(server):
    client = ShardClient(server.server.address, SECRET, 1, 0, timeout_s=10, encrypt=server.server.encrypt)
    try:
        initial = initial_rows(4, 0, torch.tensor(MINE), DIM, 1.0, torch.float32)
        assert torch.equal(_pull(client, MINE), initial)
        _push(client, MINE[:2], torch.ones(2, DIM), clock=0)
        _push(client, [], torch.empty(0, DIM), clock=1)  # a step that touched none of this rank's rows
        after = _pull(client, MINE, clock=2)
    finally:
        client.close()
    assert torch.equal(after[:2], initial[:2] - 0.5) and torch.equal(after[2:], initial[2:])
    assert server.shard.rows_held == len(MINE) and server.shard.clock.clocks[1] == 2


@pytest.mark.parametrize(
    "kind, ids, length, count, clock, message",
    [
        (Kind.ROW_PULL, MINE[:2], 16, 2**40, 0, "rows in one frame"),
        (Kind.ROW_PULL, MINE[:2], 17, 2, 0, "ROW_PULL of 17 bytes for 2 rows"),
        (Kind.ROW_PUSH, MINE[:2], 16, 2, 0, "ROW_PUSH of 16 bytes for 2 rows"),
        (Kind.ROW_PULL, [MINE[0], ROWS], 16, 2, 0, "row ids outside sparse table 0's 1000 rows"),
        (Kind.ROW_PULL, [MINE[0], -1], 16, 2, 0, "row ids outside sparse table 0's 1000 rows"),
        (Kind.ROW_PUSH, THEIRS, 2 * (8 + 4 * DIM), 2, 0, "that rank 0 does not own"),
        (Kind.ROW_PUSH, [MINE[0], MINE[0]], 2 * (8 + 4 * DIM), 2, 0, "repeated row ids"),
        (Kind.ROW_PUSH, MINE[:2], 2 * (8 + 4 * DIM), 2, 3, "pushed clock 3, expected 0"),
    ],
    ids=[
        "huge-count",
        "pull-length",
        "push-length",
        "id-too-large",
        "negative-id",
        "not-owned",
        "repeats",
        "clock-skip",
    ],
)
def test_inconsistent_row_frames_are_dropped_before_anything_is_applied(
    caplog, kind, ids, length, count, clock, message
):
    srv = _Server()
    try:
        with caplog.at_level(logging.WARNING, logger="sparkdl.parameter_server"):
            sock = socket.create_connection(srv.server.address, timeout=10)
            _, keys = client_handshake(sock, SECRET, 1, time.monotonic() + 10)
            body = bytes(byte_view(torch.tensor(ids, dtype=torch.int64)))
            if kind == Kind.ROW_PUSH:
                body += bytes(byte_view(torch.ones(len(ids), DIM)))[: max(0, length - len(body))]
            body = body[:length] if length <= len(body) else body + b"\0" * (length - len(body))
            header = Header(kind, F32, 0, 1, clock, count, length)
            sock.sendall(keys.sealer.seal(header.encode(), body))
            assert closed_by_server(sock)
        assert message in "\n".join(r.getMessage() for r in caplog.records)
        assert srv.shard.rows_held == 0 and srv.shard.clock.clocks[1] == 0  # nothing was applied
    finally:
        srv.server.close()


# ---- the staleness bound on row reads ------------------------------------------------------


def test_a_row_read_waits_for_the_slowest_worker_and_wakes_on_its_push():
    shard = SparseShard(SPEC, 0, WORLD, 0, 30.0)  # bulk-synchronous
    ids = torch.tensor(MINE[:2])
    shard.push(0, 0, ids, torch.ones(2, DIM))
    result = {}

    def read() -> None:
        result["read"] = shard.pull(ids, 0, 1)

    reader = threading.Thread(target=read)
    reader.start()
    shard.push(1, 0, ids, torch.full((2, DIM), 2.0))
    reader.join(30)
    assert not reader.is_alive()
    rows, staleness, slowest = result["read"]
    # The read at clock 1 includes both workers' first pushes: SGD lr 0.5 of 1 and 2.
    assert torch.equal(rows, initial_rows(4, 0, ids, DIM, 1.0, torch.float32) - 1.5)
    assert (staleness, slowest) == (0, 1)


def test_a_row_read_blocked_by_a_lost_worker_fails_naming_it():
    shard = SparseShard(SPEC, 0, WORLD, 0, 30.0)
    shard.push(0, 0, torch.tensor(MINE[:1]), torch.ones(1, DIM))
    shard.depart(1, clean=False, reason="disconnected without saying bye")
    with pytest.raises(ParameterServerError) as info:
        shard.pull(torch.tensor(MINE[:1]), 0, 1)
    assert info.value.peer_rank == 1
    assert "rank 1's worker left the parameter server on rank 0" in str(info.value)
