"""Model factories importable on executors (tests put this folder on the executors' PYTHONPATH)."""

import torch


def digits_mlp() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))


def accuracy(module: torch.nn.Module, features, labels) -> float:
    with torch.no_grad():
        predicted = module(torch.as_tensor(features)).argmax(1).numpy()
    return float((predicted == labels).mean())


def pairs(chunks):
    """A reader's chunks (named row-aligned arrays) as the (features, labels) pairs of a
    feature_cols run."""
    from sparkdl.data.inputs import LABEL_KEY, POSITIONAL

    return [(chunk[POSITIONAL], chunk.get(LABEL_KEY)) for chunk in chunks]


class DigitsCNN(torch.nn.Module):
    """A small CNN for 8x8 grayscale digits, called as ``model(image=...)``."""

    def __init__(self) -> None:
        super().__init__()
        self.features = torch.nn.Sequential(
            torch.nn.Conv2d(1, 16, 3, padding=1),
            torch.nn.ReLU(),
            torch.nn.Conv2d(16, 32, 3, padding=1),
            torch.nn.ReLU(),
            torch.nn.MaxPool2d(2),
        )
        self.head = torch.nn.Linear(32 * 4 * 4, 10)

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(image).flatten(1))


class TokenCounter(torch.nn.Module):
    """Embedding + GRU over padded token ids (packed by their lengths) with a dense side input."""

    def __init__(self, vocabulary: int = 12, width: int = 16, hidden: int = 32) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocabulary, width, padding_idx=0)
        self.gru = torch.nn.GRU(width, hidden, batch_first=True)
        self.head = torch.nn.Sequential(torch.nn.Linear(hidden + 1, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2))

    def forward(self, tokens: torch.Tensor, lengths: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
        packed = torch.nn.utils.rnn.pack_padded_sequence(
            self.embed(tokens), lengths.clamp(min=1).cpu(), batch_first=True, enforce_sorted=False
        )
        _, state = self.gru(packed)
        return self.head(torch.cat([state[-1], dense], dim=1))


class WideAndDeep(torch.nn.Module):
    """A user-id Embedding (deep) beside dense features (wide)."""

    def __init__(self, users: int = 40) -> None:
        super().__init__()
        self.user_embedding = torch.nn.Embedding(users, 8)
        self.deep = torch.nn.Sequential(torch.nn.Linear(8 + 2, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2))
        self.wide = torch.nn.Linear(2, 2)

    def forward(self, user: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
        return self.deep(torch.cat([self.user_embedding(user), dense], dim=1)) + self.wide(dense)


def png_bytes(pixels, format: str = "PNG") -> bytes:
    """An encoded image of a uint8 array (HxW grayscale, HxWx3 RGB, HxWx4 RGBA)."""
    import io

    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format=format)
    return buffer.getvalue()


def read_digits(path: str):
    """(features float32 [n, 64], labels int64 [n]) of a digits Parquet dataset, to score a model on
    exactly the rows written there."""
    import numpy as np
    import pyarrow.parquet as pq

    table = pq.read_table(path)
    features = np.array(table.column("features").to_pylist(), dtype=np.float32)
    return features, np.asarray(table.column("label").to_numpy(), dtype=np.int64)


class Poisonable(torch.nn.Module):
    """An MLP 8-16-3 (seeded) that raises on a row whose first feature is 999 and answers
    infinity where it is 555: bad rows for the inference tests."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (x[:, 0] == 999).any():
            raise ValueError("feature 0 is 999")
        out = self.net(x)
        return torch.where(x[:, :1] == 555, torch.full_like(out, float("inf")), out)


class CountingFactory:
    """Builds a :class:`Poisonable` and leaves one file per build in ``directory``, named by the
    building process and holding the Spark resources its task was given: what the inference
    tests count builds and read task resources from."""

    def __init__(self, directory: str) -> None:
        self.directory = directory

    def __call__(self) -> torch.nn.Module:
        import json
        import os
        import uuid

        from pyspark import TaskContext

        context = TaskContext.get()
        resources = {k: list(v.addresses) for k, v in context.resources().items()} if context else {}
        with open(os.path.join(self.directory, f"{os.getpid()}-{uuid.uuid4().hex}.json"), "w") as handle:
            json.dump({"pid": os.getpid(), "resources": resources, "threads": torch.get_num_threads()}, handle)
        return Poisonable()


def wide_mlp() -> torch.nn.Module:
    """64 -> 100,000 -> 2: about 26 MiB of weights for 2 outputs (a model too large to inline)."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 100_000), torch.nn.ReLU(), torch.nn.Linear(100_000, 2))


class HoldingDoubler(torch.nn.Module):
    """``y = 2 x`` (a bias-free ``Linear(1, 1)`` of weight 2) whose forward first holds while at
    least N parts of a predict job's output are committed, N read from the JSON file ``control``
    (``{"output": dir, "hold_at": N}``; no file or N = 0: no hold; bounded: 120 s). A test kills
    the job's driver while its tasks hold, at a point it chose, without sleeping for it; the
    factory's bytes do not depend on N, so every run is the same model to the job's record."""

    def __init__(self, control: str = "") -> None:
        super().__init__()
        self.control = control
        self.linear = torch.nn.Linear(1, 1, bias=False)
        with torch.no_grad():
            self.linear.weight.fill_(2.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._hold()
        return self.linear(x)

    def _hold(self) -> None:
        import json
        import os
        import time

        if not self.control or not os.path.exists(self.control):
            return
        with open(self.control) as handle:
            settings = json.load(handle)
        markers = os.path.join(settings["output"], "_committed")
        deadline = time.monotonic() + 120
        while settings["hold_at"] and _committed_count(markers) >= settings["hold_at"]:
            if time.monotonic() > deadline:  # the test kills this driver meanwhile
                raise RuntimeError("the driver was not killed within 120 s")
            time.sleep(0.05)


def _committed_count(directory: str) -> int:
    import os

    return len([n for n in os.listdir(directory) if n.endswith(".json")]) if os.path.isdir(directory) else 0


def doubling_model(control: str, weight: float = 2.0):
    """The job's TorchModel: y = weight * x on the column ``x``, holding as ``control`` says."""
    import functools

    import torch

    import sparkdl

    module = HoldingDoubler(control)
    with torch.no_grad():
        module.linear.weight.fill_(weight)
    factory = functools.partial(HoldingDoubler, control)
    model = sparkdl.TorchModel.from_state(module.state_dict(), model=factory, feature_cols=["x"], output_shape=[])
    # Its forward holds in Python, which a frozen graph of it (optimize="auto") would not run.
    return model.setOptimize("off")
