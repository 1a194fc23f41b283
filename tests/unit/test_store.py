"""sparkdl's rendezvous store (:mod:`sparkdl._net.rendezvous_store`) and the rendezvous that uses it, on real
sockets: a real two-rank gloo process group (with DDP) started with
``torch.multiprocessing.spawn`` rendezvouses through it; torch's own TCPStore client, a raw
client without the secret and a client with a wrong secret get nothing out of it nor into it;
waits time out naming their keys; it listens on its one address only and not at all once closed.
"""

from __future__ import annotations

import datetime
import os
import socket
import struct
import sys
import threading
import time
import traceback
from typing import Any, Dict, List, Optional

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from sparkdl._net.rendezvous_client import StoreClient
from sparkdl._net.rendezvous_store import StoreError, StoreServer, StoreTimeoutError, StoreUnavailableError
from sparkdl._net.rendezvous_wire import (
    GREETING,
    GREETING_BYTES,
    MAX_KEY_BYTES,
    MAX_VALUE_BYTES,
    NONCE_BYTES,
    Message,
    Op,
    client_handshake,
    encode,
    store_key,
)
from sparkdl._runtime.rendezvous import active_store, rendezvous, teardown
from sparkdl.errors import PeerLostError
from tests.gloo import exit_without_finalizing

SECRET = b"s" * 32
WORLD = 2
CPU = torch.device("cpu")


def _td(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


@pytest.fixture
def server():
    srv = StoreServer("127.0.0.1", SECRET, timeout_s=10, handshake_timeout_s=2)
    yield srv
    srv.close()


def _until(condition, bound_s: float = 10.0) -> None:
    """Returns once ``condition()`` holds (a state of the server the test waits for), else fails."""
    deadline = time.monotonic() + bound_s
    while not condition():
        assert time.monotonic() < deadline, "the server never reached the state the test waits for"
        time.sleep(0.01)


def _client(srv: StoreServer, rank: int = 0, timeout_s: float = 10) -> StoreClient:
    return StoreClient(srv.address, SECRET, rank, _td(timeout_s))


def _refused(address) -> bool:
    try:
        with socket.create_connection(address, timeout=3):
            return False
    except ConnectionRefusedError:
        return True


def _read_all(sock: socket.socket, limit_s: float = 10) -> bytes:
    """Everything the peer sends until it closes (a reset counts as closing)."""
    sock.settimeout(limit_s)
    data = b""
    try:
        while True:
            chunk = sock.recv(4096)
            if not chunk:
                return data
            data += chunk
    except ConnectionResetError:
        return data


# --- the store's semantics -----------------------------------------------------------------


def test_every_store_operation_behaves_like_torchs_stores(server):
    store = _client(server)
    store.set("a", "1")
    store.set("b", b"\x00\xff")
    assert (store.get("a"), store.get("b")) == (b"1", b"\x00\xff")
    assert (store.add("n", 3), store.add("n", -1), store.get("n")) == (3, 2, b"2")
    assert store.check(["a", "n"]) and not store.check(["a", "missing"])
    # TCPStore's compare_set: an absent key is set only when expected is empty.
    assert store.compare_set("c", "", "v1") == b"v1"
    assert store.compare_set("c", "wrong", "v2") == b"v1"
    assert store.compare_set("c", "v1", "v2") == b"v2"
    assert store.compare_set("absent", "x", "y") == b"x" and not store.check(["absent"])
    assert store.num_keys() == 4
    assert store.delete_key("a") and not store.delete_key("a")
    store.multi_set(["m1", "m2"], [b"x", "y"])
    assert store.multi_get(["m1", "m2"]) == [b"x", b"y"]
    store.append("m1", b"z")
    store.append("fresh", b"q")
    assert (store.get("m1"), store.get("fresh")) == (b"xz", b"q")
    assert store.has_extended_api()
    with pytest.raises(StoreError, match="not an integer"):
        store.add("m1", 1)


def test_torch_reaches_it_through_a_prefix_store_by_its_cpp_method_names(server):
    # PrefixStore calls the C++ names (deleteKey, getNumKeys), which the client aliases.
    store = _client(server)
    prefixed = dist.PrefixStore("group", store)  # keys become "group/<key>"
    prefixed.set("k", "v")
    assert prefixed.get("k") == b"v" and store.get("group/k") == b"v"
    assert prefixed.num_keys() == 1
    assert prefixed.delete_key("k") and not store.check(["group/k"])
    prefixed.wait([], _td(1))


def test_clones_share_the_store_and_close_with_their_parent(server):
    store = _client(server)
    twin = store.clone()
    twin.set("k", b"v")
    assert store.get("k") == b"v"
    via_cpp = dist.PrefixStore("p", store).clone()  # PrefixStore::clone calls ours from C++
    via_cpp.set("k", b"w")
    assert store.get("p/k") == b"w"
    store.close()
    assert twin.closed
    with pytest.raises(StoreError, match="closed"):
        twin.get("k")


def test_a_wait_blocks_until_another_rank_sets_the_key(server):
    store = _client(server)
    other = _client(server, rank=1)
    threading.Timer(0.3, lambda: other.set("late", b"v")).start()
    started = time.monotonic()
    store.wait(["late"])
    assert store.get("late") == b"v" and time.monotonic() - started >= 0.25


def test_a_wait_times_out_with_an_error_naming_the_missing_keys(server):
    store = _client(server, timeout_s=0.5)
    store.set("present", b"1")
    started = time.monotonic()
    with pytest.raises(StoreTimeoutError, match=r"timed out after 0.8s waiting for 'missing/1', 'missing/2'") as caught:
        store.wait(["present", "missing/1", "missing/2"], _td(0.8))
    assert 0.7 <= time.monotonic() - started < 5
    # What torch's store-based barrier catches (RuntimeError), and a lost-peer consequence.
    assert isinstance(caught.value, dist.DistStoreError) and isinstance(caught.value, RuntimeError)
    assert isinstance(caught.value, PeerLostError)
    # get and wait without a timeout use the store's.
    with pytest.raises(StoreTimeoutError, match="'never'"):
        store.get("never")
    with pytest.raises(StoreTimeoutError, match="'never'"):
        store.wait(["never"])


def test_concurrent_callers_do_not_wait_for_each_other(server):
    store = _client(server)
    blocked = threading.Thread(target=lambda: store.wait(["unblock"], _td(20)), daemon=True)
    blocked.start()
    _until(lambda: server.blocked_requests == 1)
    started = time.monotonic()
    assert not store.check(["unblock"])  # answered while the other thread still waits
    assert time.monotonic() - started < 2
    store.set("unblock", b"1")
    blocked.join(10)
    assert not blocked.is_alive()


def test_sizes_over_the_limits_are_refused(server):
    store = _client(server)
    with pytest.raises(StoreError, match="exceeds the limit"):
        store.set("big", b"x" * (MAX_VALUE_BYTES + 1))
    with pytest.raises(StoreError, match="key of"):
        store.set("k" * (MAX_KEY_BYTES + 1), b"v")
    with pytest.raises(StoreError, match="request of"):
        store.multi_set(["a", "b"], [b"x" * MAX_VALUE_BYTES, b"y" * MAX_VALUE_BYTES])
    assert store.num_keys() == 0
    store.set("fine", b"x" * MAX_VALUE_BYTES)  # the connection survives refusals
    assert len(store.get("fine")) == MAX_VALUE_BYTES


# --- who can use it ------------------------------------------------------------------------


def test_torchs_own_tcpstore_client_cannot_connect_read_or_write(server):
    with pytest.raises(RuntimeError):  # DistNetworkError: its validation ping gets our greeting
        dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=_td(2))
    assert _client(server).num_keys() == 0


def test_a_raw_client_without_the_secret_is_dropped_and_cannot_read_or_write(server):
    store = _client(server)
    store.set("secret-key", b"secret-value")
    with socket.create_connection(server.address, timeout=5) as raw:
        greeting = raw.recv(GREETING_BYTES)
        assert greeting.startswith(GREETING)
        # Requests sent instead of a proof: read as a (failing) proof, never parsed.
        raw.sendall(encode(Message(Op.SET, items=(b"planted", b"x"))) + encode(Message(Op.GET, items=(b"secret-key",))))
        raw.sendall(b"\0" * 64)
        assert b"secret-value" not in _read_all(raw)
    with socket.create_connection(server.address, timeout=5) as idle:
        # One that says nothing is dropped at the handshake timeout (2 s here).
        started = time.monotonic()
        data = _read_all(idle)
        assert data.startswith(GREETING) and len(data) == GREETING_BYTES
        assert 1.5 <= time.monotonic() - started < 8
    assert not store.check(["planted"]) and store.num_keys() == 1


def test_a_wrong_secret_fails_the_handshake_both_ways(server):
    with pytest.raises(StoreUnavailableError, match=r"proved the job's secret, 3 times \(wrong secret\?\)"):
        StoreClient(server.address, b"w" * 32, 1, _td(5))
    # The client checks the server too: an impostor that cannot prove the secret is refused.
    impostor = socket.create_server(("127.0.0.1", 0))

    def pretend() -> None:
        conn, _ = impostor.accept()
        with conn:
            conn.sendall(GREETING + b"\x00" + os.urandom(NONCE_BYTES))
            conn.recv(4 + NONCE_BYTES + 1 + 32)
            conn.sendall(os.urandom(32))
            time.sleep(0.5)

    thread = threading.Thread(target=pretend, daemon=True)
    thread.start()
    try:
        with pytest.raises(StoreUnavailableError, match="failed to prove the job's secret"):
            StoreClient(impostor.getsockname()[:2], SECRET, 1, _td(5))
    finally:
        thread.join(5)
        impostor.close()


def test_the_key_is_derived_from_the_secret_with_its_own_label():
    import hashlib
    import hmac

    assert store_key(SECRET) == hmac.new(SECRET, b"sparkdl-rendezvous", hashlib.sha256).digest() != SECRET
    with pytest.raises(ValueError):
        store_key(b"")


def test_an_authenticated_peer_breaking_the_protocol_is_dropped(server):
    # An oversized length; a frame with a bad magic and a forged tag (it fails the tag check).
    for junk in (b"\xff\xff\xff\xff", struct.pack(">I", 20) + b"NOPE" + b"\0" * 16 + b"\0" * 16):
        with socket.create_connection(server.address, timeout=5) as sock:
            client_handshake(sock, store_key(SECRET), 3, time.monotonic() + 5)
            sock.sendall(junk)
            assert _read_all(sock) == b""
    assert _client(server).num_keys() == 0


def test_pending_handshakes_are_capped_the_oldest_going_first():
    server = StoreServer(
        "127.0.0.1", SECRET, timeout_s=10, handshake_timeout_s=5, max_pending_handshakes=4
    )  # 2 from one address
    rest = GREETING_BYTES - len(GREETING)  # what an idle peer has not read yet, before the EOF
    idle = [socket.create_connection(server.address, timeout=5) for _ in range(2)]
    try:
        for sock in idle:
            assert sock.recv(len(GREETING)) == GREETING  # both are being served
        with socket.create_connection(server.address, timeout=5) as third:
            assert third.recv(len(GREETING)) == GREETING  # a new one is served too: never refused
            assert len(_read_all(idle[0], 5)) == rest  # and the oldest was dropped for it
            # A rank still gets in with two idle ones pending: the older one goes.
            _client(server).set("k", b"v")
            assert len(_read_all(idle[1], 5)) == rest
            assert server.pending_handshakes == 1  # the third, still pending
    finally:
        for sock in idle:
            sock.close()
        server.close()


def test_a_flood_of_idle_connections_does_not_keep_the_ranks_out():
    # Issue #29: 300 idle connections as the fit starts; the ranks' store clients still get in.
    server = StoreServer("127.0.0.1", SECRET, timeout_s=600)
    flood = []
    try:
        flood += [socket.create_connection(server.address, timeout=5) for _ in range(300)]
        start = time.monotonic()
        clients = [_client(server, rank) for rank in range(4)]
        try:
            for rank, client in enumerate(clients):
                client.set(f"rank{rank}", b"here")
            assert clients[0].multi_get([f"rank{rank}" for rank in range(4)]) == [b"here"] * 4
        finally:
            for client in clients:
                client.close()
        assert time.monotonic() - start < 5.0
        assert server.pending_handshakes <= 32
    finally:
        for sock in flood:
            sock.close()
        server.close()


def test_a_store_that_never_answers_is_named_as_such():
    with socket.create_server(("127.0.0.1", 0)) as mute:  # the kernel accepts; nobody greets
        host, port = mute.getsockname()[:2]
        start = time.monotonic()
        with pytest.raises(StoreUnavailableError) as info:
            StoreClient((host, port), SECRET, 3, _td(1), served_by="the driver")
        assert time.monotonic() - start < 3.0
    text = str(info.value)
    assert (
        text.startswith("rank 3: the rendezvous store on the driver at")
        and f"{host}:{port} did not complete the handshake within 1 s" in text
    ), text
    assert "flooded" in text and "bad greeting" not in text, text


# --- where it listens, and for how long ----------------------------------------------------


def _non_loopback_address() -> Optional[str]:
    candidates: List[str] = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.1", 9))  # TEST-NET: routes only, sends nothing
            candidates.append(probe.getsockname()[0])
        except OSError:
            pass
    try:
        candidates += socket.gethostbyname_ex(socket.gethostname())[2]
    except OSError:
        pass
    for address in candidates:
        if not address.startswith("127.") and address != "0.0.0.0":
            try:
                with socket.socket() as sock:
                    sock.bind((address, 0))  # really one of this machine's
                return address
            except OSError:
                continue
    return None


def test_it_listens_on_its_address_only_not_on_other_loopback_addresses(server):
    assert server.address[0] == "127.0.0.1"
    if sys.platform.startswith("linux"):  # all of 127/8 is local on Linux
        assert _refused(("127.0.0.2", server.port))
    if socket.has_ipv6:
        try:
            reachable = not _refused(("::1", server.port))
        except OSError:  # no IPv6 loopback here
            reachable = False
        assert not reachable


def test_it_is_not_reachable_on_the_machines_other_address(server):
    # The machine's own interface when it has one; else another address of this host (all of
    # 127/8 is local on Linux), so the check always runs.
    address = _non_loopback_address() or "127.0.0.2"
    assert _refused((address, server.port))


def test_close_refuses_connections_and_wakes_blocked_waits():
    srv = StoreServer("127.0.0.1", SECRET, timeout_s=10)
    store = StoreClient(srv.address, SECRET, 1, _td(0))  # no timeout: waits until the store goes
    errors: List[BaseException] = []

    def wait() -> None:
        try:
            store.wait(["never"])
        except BaseException as exc:  # noqa: BLE001 - recorded
            errors.append(exc)

    thread = threading.Thread(target=wait, daemon=True)
    thread.start()
    _until(lambda: srv.blocked_requests == 1)
    srv.close()
    thread.join(10)
    assert not thread.is_alive()
    assert isinstance(errors[0], StoreUnavailableError) and "lost the rendezvous store" in str(errors[0])
    assert _refused(srv.address)
    store.close()


def test_wait_idle_returns_once_the_peers_hung_up(server):
    peer = _client(server, rank=1)
    peer.set("k", b"v")  # a live connection of rank 1
    idle: List[bool] = []
    draining = threading.Thread(target=lambda: idle.append(server.wait_idle(60.0)), daemon=True)
    started = time.monotonic()
    draining.start()
    draining.join(0.5)
    assert draining.is_alive(), "wait_idle returned while a peer was still connected"
    assert peer.get("k") == b"v"  # still served while draining
    peer.close()
    draining.join(30)
    assert idle == [True] and time.monotonic() - started < 30


def test_wait_idle_gives_up_on_a_peer_that_stays_connected(server):
    peer = _client(server, rank=1)
    peer.set("k", b"v")
    started = time.monotonic()
    assert server.wait_idle(0.5) is False
    assert 0.5 <= time.monotonic() - started < 10
    server.close()
    assert _refused(server.address)
    with pytest.raises(StoreUnavailableError):
        peer.get("k")
    peer.close()


def test_no_rank_leaves_the_rendezvous_barrier_before_every_rank_joined(server):
    from sparkdl._runtime.rendezvous import _wait_for_every_rank

    late, early = _client(server, rank=0), _client(server, rank=1)
    left: List[int] = []
    waiting = threading.Thread(target=lambda: (_wait_for_every_rank(early, 1, 2, _td(30)), left.append(1)), daemon=True)
    waiting.start()
    waiting.join(0.5)
    assert waiting.is_alive() and not left, "rank 1 left before rank 0 joined"
    _wait_for_every_rank(late, 0, 2, _td(30))
    waiting.join(30)
    assert left == [1]
    with pytest.raises(StoreTimeoutError, match="sparkdl/joined/2"):
        _wait_for_every_rank(late, 0, 3, _td(0.5))  # a third rank that never comes is named
    late.close()
    early.close()


# --- rendezvous() ---------------------------------------------------------------------------


def test_a_single_rank_rendezvous_and_teardown_close_the_store():
    env = rendezvous(0, 1, ["127.0.0.1:0"], lambda value: [value], CPU, timeout_s=30)
    try:
        server, client = active_store()
        assert (env.master_addr, env.master_port) == server.address == client.address
        tensor = torch.ones(2)
        dist.all_reduce(tensor)
        assert dist.get_backend() == "gloo"
    finally:
        teardown()
    assert active_store() is None and not dist.is_initialized()
    assert _refused((env.master_addr, env.master_port))
    teardown()  # twice is fine


def test_more_than_one_rank_needs_the_secret():
    with pytest.raises(ValueError, match="secret"):
        rendezvous(0, 2, ["127.0.0.1:0"] * 2, lambda value: [value, ""], CPU, timeout_s=5)


def test_a_failed_rendezvous_leaves_nothing_listening():
    ports: List[int] = []

    def gather_then_fail(value: str) -> List[str]:
        ports.append(int(value.rsplit(" ", 1)[1]))
        raise RuntimeError("barrier failed")

    with pytest.raises(RuntimeError, match="barrier failed"):
        rendezvous(0, 2, ["127.0.0.1:0"] * 2, gather_then_fail, CPU, timeout_s=5, secret=SECRET)
    assert active_store() is None and _refused(("127.0.0.1", ports[0]))


def test_a_rank_that_never_joins_fails_the_rendezvous_naming_its_key():
    with pytest.raises(StoreTimeoutError, match="waiting for") as caught:
        rendezvous(0, 2, ["127.0.0.1:0"] * 2, lambda value: [value, ""], CPU, timeout_s=2, secret=SECRET)
    assert "rank 0" in str(caught.value)
    assert active_store() is None and not dist.is_initialized()


def test_a_rank_that_cannot_reach_the_store_fails_clearly():
    closed = socket.create_server(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()
    with pytest.raises(StoreUnavailableError, match="cannot reach the rendezvous store on rank 0"):
        rendezvous(
            1, 2, ["127.0.0.1:0"] * 2, lambda value: [f"127.0.0.1 {port}", value], CPU, timeout_s=5, secret=SECRET
        )
    assert active_store() is None


# --- a real two-rank gloo group ------------------------------------------------------------


def _file_all_gather(directory: str, rank: int):
    """BarrierTaskContext.allGather between spawned processes, through files."""
    rounds = [0]

    def all_gather(value: str) -> List[str]:
        rounds[0] += 1
        path = os.path.join(directory, f"round{rounds[0]}-rank{rank}")
        with open(path + ".tmp", "w") as handle:
            handle.write(value)
        os.replace(path + ".tmp", path)
        out = []
        deadline = time.monotonic() + 60
        for other in range(WORLD):
            other_path = os.path.join(directory, f"round{rounds[0]}-rank{other}")
            while not os.path.exists(other_path):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"rank {other} never reached round {rounds[0]}")
                time.sleep(0.02)
            with open(other_path) as handle:
                out.append(handle.read())
        return out

    return all_gather


def _raw_probe(address) -> bytes:
    """An unauthenticated client asking for a key: what comes back."""
    with socket.create_connection(address, timeout=5) as raw:
        raw.sendall(encode(Message(Op.GET, items=(b"0//cpu//0/0",))) + b"\0" * 68)
        return _read_all(raw)


def _ranks_worker(rank: int, directory: str) -> None:
    torch.set_num_threads(1)
    result: Dict[str, Any] = {}
    gather = _file_all_gather(directory, rank)
    try:
        env = rendezvous(rank, WORLD, ["127.0.0.1:1", "127.0.0.1:2"], gather, CPU, timeout_s=60, secret=SECRET)
        result["address"] = (env.master_addr, env.master_port)
        tensor = torch.tensor([float(rank + 1)] * 3)
        dist.all_reduce(tensor)
        result["all_reduce"] = tensor.tolist()
        dist.barrier()
        torch.manual_seed(rank)
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2))
        for step in range(2):
            torch.manual_seed(100 + 10 * rank + step)
            model.zero_grad()
            model(torch.randn(8, 4)).sum().backward()
        result["grad"] = model.module.weight.grad.clone()
        group = dist.new_group([0, 1])
        again = torch.ones(1)
        dist.all_reduce(again, group=group)
        result["group"] = again.item()
        if rank == 0:
            result["raw_reply"] = _raw_probe((env.master_addr, env.master_port))
            try:
                dist.TCPStore(env.master_addr, env.master_port, is_master=False, timeout=_td(2))
                result["tcpstore"] = "connected"
            except RuntimeError as exc:
                result["tcpstore"] = type(exc).__name__
        dist.barrier()
        teardown()  # with the DDP module, which holds the group and so the store, still alive
        result["after_teardown"] = (dist.is_initialized(), active_store())
        gather("done")  # both torn down
        result["refused"] = _refused((env.master_addr, env.master_port))
        del model
    except Exception:  # noqa: BLE001 - recorded, so the test shows it
        result["exception"] = traceback.format_exc()
        teardown()
    torch.save(result, os.path.join(directory, f"rank{rank}.pt"))
    exit_without_finalizing()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> List[Dict[str, Any]]:
    directory = str(tmp_path_factory.mktemp("store"))
    mp.spawn(_ranks_worker, args=(directory,), nprocs=WORLD, join=True)
    results = [torch.load(os.path.join(directory, f"rank{r}.pt"), weights_only=False) for r in range(WORLD)]
    for rank, result in enumerate(results):
        assert "exception" not in result, f"rank {rank}:\n{result['exception']}"
    return results


def test_gloo_ranks_rendezvous_through_it_and_run_collectives_and_ddp(ranks):
    assert ranks[0]["address"] == ranks[1]["address"] and ranks[0]["address"][0] == "127.0.0.1"
    assert ranks[0]["all_reduce"] == ranks[1]["all_reduce"] == [3.0, 3.0, 3.0]
    assert ranks[0]["group"] == ranks[1]["group"] == 2.0
    torch.testing.assert_close(ranks[0]["grad"], ranks[1]["grad"])  # DDP averaged them


def test_during_the_run_neither_torchs_client_nor_a_raw_one_gets_in(ranks):
    assert ranks[0]["tcpstore"] in ("DistNetworkError", "DistStoreError", "RuntimeError")
    raw = ranks[0]["raw_reply"]
    assert raw.startswith(GREETING) and len(raw) == GREETING_BYTES  # a greeting, then nothing


def test_teardown_closes_the_group_and_the_store_even_with_ddp_alive(ranks):
    for result in ranks:
        assert result["after_teardown"] == (False, None)
        assert result["refused"]


def test_encrypted_frames_round_trip_and_a_mode_mismatch_fails_the_handshake():
    server = StoreServer("127.0.0.1", SECRET, timeout_s=10, handshake_timeout_s=2, encrypt=True)
    try:
        client = StoreClient(server.address, SECRET, 1, _td(5), encrypt=True)
        client.set("k", b"v" * 100)
        assert client.get("k") == b"v" * 100 and client.add("n", 3) == 3
        client.close()
        with pytest.raises(StoreUnavailableError, match="encryption mismatch"):
            StoreClient(server.address, SECRET, 1, _td(5), encrypt=False)
    finally:
        server.close()
