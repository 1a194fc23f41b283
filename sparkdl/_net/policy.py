"""What sparkdl's own network traffic must do, from Spark's security settings.

sparkdl opens three kinds of connection of its own: the progress channel (tasks -> driver), the
rendezvous store (tasks -> rank 0) and the parameter server (tasks <-> tasks). All three
authenticate every peer with the per-job secret and integrity-check every frame; when Spark
encrypts its own RPC (``spark.network.crypto.enabled`` or ``spark.ssl.enabled``), they encrypt
too (AES-256-GCM keyed from the secret, :mod:`sparkdl._net.frames`).

The collectives of torch.distributed (gloo on CPUs, NCCL on GPUs: gradients and weights) have no
encryption in the torch builds sparkdl runs on. Under Spark encryption, training would put the
model on the network in the clear while the user asked for the opposite, so sparkdl refuses,
naming the setting that accepts it (``spark.sparkdl.allowUnencryptedCollectives=true``, for a
network that is trusted, e.g. one host or a private VLAN) — as PySpark's TorchDistributor does
under ``spark.ssl``. See docs/security.md.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional, Tuple

from sparkdl.errors import ConfigError

#: Spark settings under which Spark's own RPC between driver and executors is encrypted.
ENCRYPTION_SETTINGS: Tuple[str, ...] = ("spark.network.crypto.enabled", "spark.ssl.enabled")
#: Setting that accepts unencrypted torch.distributed collectives under Spark encryption.
ALLOW_PLAINTEXT_COLLECTIVES = "spark.sparkdl.allowUnencryptedCollectives"


@dataclasses.dataclass(frozen=True)
class SecurityPolicy:
    """Whether sparkdl's connections encrypt, and why."""

    encrypt: bool
    #: The Spark setting that turned encryption on (for messages), or "".
    because: str = ""


def security_policy(conf_get: Callable[[str], Optional[str]]) -> SecurityPolicy:
    """The policy for a session whose settings ``conf_get(key)`` reads (None when unset).

    Raises:
        ConfigError: Spark encrypts its traffic but torch.distributed's collectives cannot, and
            ``spark.sparkdl.allowUnencryptedCollectives`` does not accept that.
    """
    enabled = [key for key in ENCRYPTION_SETTINGS if _true(conf_get(key))]
    if not enabled:
        return SecurityPolicy(encrypt=False)
    if not _true(conf_get(ALLOW_PLAINTEXT_COLLECTIVES)):
        raise ConfigError(
            f"{enabled[0]}=true: Spark encrypts its traffic, but the torch.distributed collectives sparkdl trains with "
            f"(gloo, NCCL) cannot encrypt theirs, so gradients and weights would cross the network in the clear. "
            f"sparkdl's own connections (progress channel, rendezvous, parameter server) are encrypted; to accept "
            f"unencrypted collectives on a network you trust, set {ALLOW_PLAINTEXT_COLLECTIVES}=true (docs/security.md)"
        )
    return SecurityPolicy(encrypt=True, because=enabled[0])


def _true(value: Optional[str]) -> bool:
    return value is not None and str(value).strip().lower() == "true"
