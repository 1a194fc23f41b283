"""How a model's weights reach the executors that score with it, and its identity there.

Driver side, :func:`ship_model` picks one way per call for the weights (the pickled factory,
small, always travels with the job):

* **a broadcast** (classic sessions): one per model identity, kept for the session, so scoring
  again with the same weights ships nothing new.
* **inside the job** (Spark Connect): when the weights fit in a quarter of the largest message
  the server takes (``spark.connect.grpc.maxInboundMessageSize``, 128 MiB by default).
* **its saved location** (Spark Connect, larger models): a model saved (``save``) or loaded
  (``load``) since its weights last changed is read by the executors from that URL
  (``state_dict.pt``), so only the URL travels in the plan.

Anything else is refused with the way out (save the model where the executors can read it).

The identity (:attr:`ModelRef.key`) is a hash of the weights and the factory, computed from the
bytes at every call: an executor's cache (:mod:`sparkdl.inference.model_cache`) serves a model
for a key and only for it, so weights changed in place are never served stale.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import threading
from collections import OrderedDict
from typing import Any, Optional, Tuple

import cloudpickle
import torch

from sparkdl import filesystem
from sparkdl._spark import is_connect
from sparkdl.errors import ConfigError

#: Default of the Spark Connect server's largest message, when the client cannot read its setting.
_CONNECT_MESSAGE_LIMIT = 128 * 1024 * 1024

#: Broadcasts kept on the driver per SparkContext, by model key (older ones are unpersisted, not
#: destroyed: a DataFrame planned with one may still run, and re-fetches it).
_KEPT_BROADCASTS = 8
_broadcasts: "OrderedDict[Tuple[int, str], Any]" = OrderedDict()
_broadcasts_lock = threading.Lock()


@dataclasses.dataclass(frozen=True)
class ModelRef:
    """Where an executor gets a model's weights, its factory, and the model's identity. Picklable.

    Attributes:
        key: a hash of the factory and the weights.
        size: bytes of the weights.
        factory: the pickled factory (small: it travels with the job).
        url: a saved model directory the executors read ``state_dict.pt`` from.
        broadcast: a classic session's ``Broadcast`` of the weights' bytes.
        inline: the weights' bytes, carried in the job itself.
    """

    key: str
    size: int
    factory: bytes
    url: Optional[str] = None
    broadcast: Any = None
    inline: Optional[bytes] = None

    def weights(self) -> bytes:
        """The weights' bytes (``torch.save`` of the state dict), on an executor."""
        if self.url is not None:
            try:
                _, fs, root = filesystem.open_url(self.url, "model path")
                return filesystem.read_bytes(fs, filesystem.join(root, "state_dict.pt"))
            except Exception as exc:  # noqa: BLE001 - in the user's terms: where, and what to do
                import socket

                raise ConfigError(
                    f"cannot read the model's weights from {self.url!r} on executor host {socket.gethostname()} "
                    f"({type(exc).__name__}: {exc}): over Spark Connect a large model is read where it was saved, "
                    f"so save it where every executor can read it (a shared or object-store URL)"
                ) from exc
        if self.broadcast is not None:
            return self.broadcast.value
        assert self.inline is not None
        return self.inline

    def build(self) -> torch.nn.Module:
        """The module in eval mode, built by its factory with its weights loaded."""
        from sparkdl.strategies.parameter_server.table_files import resolve_tables

        module = cloudpickle.loads(self.factory)()
        state = torch.load(io.BytesIO(self.weights()), weights_only=True)
        # A saved model's sparse tables are referred to relative to its directory.
        module.load_state_dict(resolve_tables(state, self.url) if self.url is not None else state)
        return module.eval()


def weights_bytes(module: torch.nn.Module) -> bytes:
    """A module's weights as the executors load them (``torch.save`` of its state dict)."""
    buffer = io.BytesIO()
    torch.save(module.state_dict(), buffer)
    return buffer.getvalue()


def weights_key(state_bytes: bytes) -> str:
    """The identity of a model's weights (what a saved location is checked against)."""
    return hashlib.blake2b(state_bytes, digest_size=16).hexdigest()


def ship_model(spark: Any, module: torch.nn.Module, factory: Any, saved: Optional[Tuple[str, str]] = None) -> ModelRef:
    """How this call's executors get the model (see the module docstring).

    Args:
        spark: the session the job runs in.
        module: the model's module (its current weights).
        factory: what builds the module on an executor.
        saved: ``(url, weights key)`` of the model's last save or load, if any.

    Raises:
        ConfigError: over Spark Connect, a model too large to travel with the job and never
            saved (or changed since): the message says how large and what to do.
    """
    factory_bytes = cloudpickle.dumps(factory)
    state_bytes = weights_bytes(module)
    state_key = weights_key(state_bytes)
    key = hashlib.blake2b(factory_bytes + state_key.encode(), digest_size=16).hexdigest()
    if not is_connect(spark):
        return ModelRef(key, len(state_bytes), factory_bytes, broadcast=_broadcast(spark, key, state_bytes))
    limit = _connect_message_limit(spark)
    if len(factory_bytes) + len(state_bytes) <= limit // 4:
        return ModelRef(key, len(state_bytes), factory_bytes, inline=state_bytes)
    if saved is not None and saved[1] == state_key:
        return ModelRef(key, len(state_bytes), factory_bytes, url=saved[0])
    raise ConfigError(
        f"the model's weights ({len(state_bytes) / 2**20:.1f} MiB) are too large to travel inside a Spark Connect "
        f"plan (sparkdl inlines up to a quarter of spark.connect.grpc.maxInboundMessageSize = {limit / 2**20:.0f} "
        f"MiB): save the model where the executors can read it (model.save('s3://bucket/m') or a shared path), or "
        f"load it from there, and transform again: then only its URL travels"
    )


def _broadcast(spark: Any, key: str, value: bytes) -> Any:
    context = spark.sparkContext
    slot = (id(context), key)
    with _broadcasts_lock:
        found = _broadcasts.get(slot)
        if found is not None and context._jsc is not None:
            _broadcasts.move_to_end(slot)
            return found
        made = context.broadcast(value)
        _broadcasts[slot] = made
        while len(_broadcasts) > _KEPT_BROADCASTS:
            _, old = _broadcasts.popitem(last=False)
            try:
                old.unpersist()
            except Exception:  # noqa: BLE001 - its SparkContext may be gone; nothing to free then
                pass
        return made


def _connect_message_limit(spark: Any) -> int:
    try:
        value = spark.conf.get("spark.connect.grpc.maxInboundMessageSize", None)
    except Exception:  # noqa: BLE001 - a server that does not answer for its static settings
        value = None
    if not value:
        return _CONNECT_MESSAGE_LIMIT
    text = str(value).strip().lower()
    units = {"k": 2**10, "m": 2**20, "g": 2**30}
    for suffix in ("kb", "mb", "gb", "k", "m", "g", "b"):
        if text.endswith(suffix):
            number = text[: -len(suffix)]
            return int(float(number) * units.get(suffix[0], 1))
    return int(text)
