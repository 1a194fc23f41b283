"""Where and how often a run's training state is saved: :class:`CheckpointConfig`, validated
when it is built on the driver."""

from __future__ import annotations

import dataclasses
from typing import Optional

from sparkdl.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    """Where and how often training state is saved.

    Args:
        url: directory (local path, ``file://``, ``hdfs://``, ``s3://``, any fsspec URL...) every
            executor can write and the driver can read.
        every_steps: save every this many optimizer steps; None saves at the end of each epoch.
        keep: how many complete checkpoints to keep (older ones are deleted).
        resume: resume from the newest checkpoint, or return the stored result of a finished
            run; False ignores what is in ``url`` and trains from scratch (overwriting it).
        async_write: write in the background after a copy to host memory (training stalls for
            the copy only); False: every part is written and committed before the save returns.
    """

    url: str
    every_steps: Optional[int] = None
    keep: int = 3
    resume: bool = True
    async_write: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.url, str) or not self.url:
            raise ConfigError(f"checkpoint_dir={self.url!r} must be a non-empty path or URL")
        if self.every_steps is not None and (
            not isinstance(self.every_steps, int) or isinstance(self.every_steps, bool) or self.every_steps < 1
        ):
            raise ConfigError(
                f"checkpoint_every={self.every_steps!r} must be a positive number of steps, or None for every epoch"
            )
        if not isinstance(self.keep, int) or self.keep < 1:
            raise ConfigError(f"keep_checkpoints={self.keep!r} must be a positive integer")
        if not isinstance(self.async_write, bool):
            raise ConfigError(f"checkpoint_async={self.async_write!r} must be True or False")
