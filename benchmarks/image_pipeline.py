"""Image pipelines side by side: JPEG bytes to a small CNN's training step, images/s.

Four ways to feed the same synthetic 64x64 RGB JPEGs (``benchmarks/make_images.py``: 20,000
images in 10 classes, generated once and reused) to the same model on the same 2 cores, and a
reference row:

1. sparkdl, Arrow reader      ``sparkdl.run(inputs={"image": sparkdl.Image(...)}, reader="arrow")``
2. sparkdl, Petastorm reader  the same with ``reader="petastorm"``
3. Petastorm's own loop       ``make_batch_reader`` + a ``TransformSpec`` decoding the JPEGs
                              with Pillow to float CHW, into ``petastorm.pytorch.DataLoader``
4. torch DataLoader           ``torchvision.datasets.ImageFolder`` (``transforms.ToTensor()``) on
                              the same bytes as files, ``torch.utils.data.DataLoader``
5. in-memory tensors          reference only: batches sliced from images decoded beforehand,
                              i.e. what the model alone reaches on these cores

The model is a small ResNet-style CNN (conv-BN-ReLU stem and downsampling convs, two residual
blocks, global average pool, linear to 10 classes; ~117k parameters at ``--width 16``); every
batch runs forward, cross-entropy, backward and an SGD step (lr 0.01). Per pipeline it prints:

* into the model: images/s in steady state (the batches after the first, model step included);
* data path alone: images/s with no model step (batches taken as fast as possible) — the
  pipeline's decode capacity on these cores;
* time to the first batch: from the call that starts the pipeline (``sparkdl.run`` — Spark job,
  barrier task, rendezvous included —, ``make_batch_reader``, ``ImageFolder(...)``). The sparkdl
  rows run after warm-up jobs, so an executor Python worker that PySpark started fresh (after a
  minute idle) does not count; the session's first, cold, ``sparkdl.run`` is printed apart;
* the ratio of each images/s figure to the torch DataLoader row and to Petastorm's own loop.

Each measurement takes ``--images`` images (default 8,000, i.e. 125 batches of 64, from a
shuffled pass over the 20,000); each figure is the best of ``--repeats`` runs (a shared machine's
load only ever slows a run down), the rows interleaved within each repeat. After the table, a
single-thread decoder comparison: Pillow vs ``torchvision.io.decode_jpeg`` on the same bytes.

Threading, 2 cores (``--cores``) for every row:

* sparkdl: one ``local-cluster[1,2,2048]`` executor with ``spark.task.cpus=2``, so the one barrier
  task gets both cores: sparkdl sets torch's intra-op threads to the task's cores (2) and
  decodes on ``decode_threads=None`` = the task's cores (2 threads, same process).
* Petastorm's loop: this process, ``torch.set_num_threads(2)`` for the model; a thread pool
  (Petastorm's default ``reader_pool_type="thread"``) of ``workers_count=2`` runs the
  TransformSpec (decoding) in the same process.
* torch DataLoader: this process, ``torch.set_num_threads(2)`` for the model; ``num_workers=2``
  worker processes decode (PyTorch gives each worker 1 torch thread).

So each pipeline runs its decoders next to a 2-thread model on 2 cores, as each would by default.

Shuffling: sparkdl shuffles row groups and rows (its default); Petastorm's loop shuffles row
groups (``shuffle_row_groups=True``), and rows too with ``--petastorm-shuffle-queue N``
(default 0: rows of a row group in file order, the cheaper choice); the torch DataLoader
shuffles images (``shuffle=True``).

    .venv-petastorm/bin/python benchmarks/image_pipeline.py [--images 8000] [--batch-size 64] [--repeats 2]

(the Petastorm stack, for rows 2 and 3; on .venv those two rows report that Petastorm is missing)

(``--pipelines`` picks rows, ``--count``/``--size`` the generated images, ``--data`` their
folder; about 5 minutes with the defaults on 2 cores). Row 4 and the decode_jpeg figures need
torchvision built for the installed torch (PyPI's torchvision is a CUDA build: beside a ``+cpu``
torch it fails to import with "operator torchvision::nms does not exist"). Without an importable
torchvision, row 4 uses a stand-in with ImageFolder's loader and ToTensor's arithmetic (Pillow
open + RGB convert, HWC uint8 to CHW float / 255), says so in its name, and the decoder table
shows Pillow only. ``SPARKDL_BENCH_TRACEBACK=1`` prints a failed row's traceback.
"""

from __future__ import annotations

import argparse
import io
import os
import sys
import time
import traceback
import warnings
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import numpy as np
import torch
from torch import nn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "benchmarks")
sys.path.insert(0, ROOT)
sys.path.insert(0, BENCH)

from make_images import CLASSES, default_out, generate  # noqa: E402

PIPELINES = {
    "sparkdl-arrow": "sparkdl, Arrow reader",
    "sparkdl-petastorm": "sparkdl, Petastorm reader",
    "petastorm": "Petastorm's own loop",
    "torch": "torch DataLoader + ImageFolder",
    "memory": "in-memory tensors (reference: no decoding)",
}

# ---- the model and the timed loop (shipped to the Spark task by value) -----------------------


def _conv_bn_relu(cin: int, cout: int, stride: int) -> List[nn.Module]:
    return [nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True)]


class ResidualBlock(nn.Module):
    """conv-BN-ReLU-conv-BN plus the identity, then ReLU (a ResNet basic block)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.body = nn.Sequential(
            *_conv_bn_relu(channels, channels, 1),
            nn.Conv2d(channels, channels, 3, 1, 1, bias=False),
            nn.BatchNorm2d(channels),
        )
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.relu(x + self.body(x))


def make_cnn(width: int = 16, classes: int = CLASSES) -> nn.Module:
    """64x64 -> 32 -> 16 (residual block) -> 8 (residual block) -> pool -> linear."""
    torch.manual_seed(0)
    return nn.Sequential(
        *_conv_bn_relu(3, width, 2),
        *_conv_bn_relu(width, 2 * width, 2),
        ResidualBlock(2 * width),
        *_conv_bn_relu(2 * width, 4 * width, 2),
        ResidualBlock(4 * width),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(4 * width, classes),
    )


def timed_loop(
    batches: Iterator[Tuple[torch.Tensor, torch.Tensor]],
    steps: int,
    size: int,
    model: Optional[nn.Module] = None,
    optimizer: Optional[torch.optim.Optimizer] = None,
) -> Dict[str, Any]:
    """Takes ``steps`` batches (and, with a model, trains on each); times the ones after the
    first. Returns wall-clock ``first_batch_at``, ``steady_s``, ``images`` (after the first
    batch) and the mean loss of the first and last 10 steps."""
    losses: List[float] = []
    first_at = steady_start = None
    images = 0
    if model is not None:
        model.train()
    for step in range(steps):
        x, y = next(batches)
        if step == 0:
            first_at, steady_start = time.time(), time.perf_counter()
            if x.dtype != torch.float32 or tuple(x.shape[1:]) != (3, size, size) or y.dtype != torch.int64:
                raise AssertionError(f"bad batch: images {x.dtype} {tuple(x.shape)}, labels {y.dtype} {tuple(y.shape)}")
            if float(x.min()) < 0.0 or float(x.max()) > 1.0:
                raise AssertionError(f"images outside [0, 1]: {float(x.min())}..{float(x.max())}")
        else:
            images += len(x)
        if model is not None:
            optimizer.zero_grad(set_to_none=True)
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            losses.append(loss.detach().item())
    return {
        "first_batch_at": first_at,
        "steady_s": time.perf_counter() - steady_start,
        "images": images,
        "loss_head": float(np.mean(losses[:10])) if losses else None,
        "loss_tail": float(np.mean(losses[-10:])) if losses else None,
        "torch_threads": torch.get_num_threads(),
    }


def _sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.01)


# ---- 1, 2: sparkdl --------------------------------------------------------------------------


#: PySpark ends executor Python workers idle for a minute (PythonWorkerFactory); the next jobs
#: then start fresh ones and import torch, sparkdl, pyarrow, Pillow... in the task: seconds that
#: would land on whichever row comes first after a pause, e.g. after rows 3-5.
WORKER_IDLE_S = 45.0


class SparkdlRunner:
    """Runs the sparkdl rows, with warm-up jobs whenever the executor's Python workers may have
    been ended since the last job (and at the start), so that no row pays for a cold worker."""

    def __init__(self, spark: Any, parquet: str, args: argparse.Namespace) -> None:
        self.spark, self.parquet, self.args = spark, parquet, args
        self.last_job_end: Optional[float] = None
        self.cold_first_batch_s: Optional[float] = None

    def __call__(self, reader: str, model_step: bool) -> Dict[str, Any]:
        if self.last_job_end is None or time.time() - self.last_job_end > WORKER_IDLE_S:
            for _ in range(2):  # after a pause the first two jobs were seen starting cold
                warm = run_sparkdl(self.spark, reader, self.parquet, self.args, True, steps=2)
                if self.cold_first_batch_s is None:
                    self.cold_first_batch_s = warm["first_batch_s"]
        try:
            return run_sparkdl(self.spark, reader, self.parquet, self.args, model_step)
        finally:
            self.last_job_end = time.time()


def run_sparkdl(
    spark: Any, reader: str, parquet: str, args: argparse.Namespace, model_step: bool, steps: Optional[int] = None
) -> Dict[str, Any]:
    import sparkdl

    steps, size, width = steps or args.images // args.batch_size, args.size, args.width

    def train_fn(ctx):
        started = time.time()
        model = optimizer = None
        if model_step:
            model = ctx.prepare_model(make_cnn(width))
            optimizer = ctx.prepare_optimizer(_sgd(model))

        def batches():
            while True:  # more images than one epoch: the next epoch's batches
                for inputs, labels in ctx.epoch_batches():
                    yield inputs["image"], labels

        result = timed_loop(batches(), steps, size, model, optimizer)
        result["task_started_at"] = started
        return result

    started = time.time()
    result = sparkdl.run(
        train_fn,
        num_workers=1,
        data=parquet,
        inputs={"image": sparkdl.Image("image", size=(size, size), channels=3)},
        label_col="label",
        batch_size=args.batch_size,
        reader=reader,
        spark=spark,
        progress=False,
        decode_threads=None,
    )
    return {
        "images_per_s": result["images"] / result["steady_s"],
        "first_batch_s": result["first_batch_at"] - started,
        "first_batch_in_task_s": result["first_batch_at"] - result["task_started_at"],
        "loss": (result["loss_head"], result["loss_tail"]),
        "torch_threads": result["torch_threads"],
    }


# ---- 3: Petastorm's own loop ----------------------------------------------------------------


def decode_pillow_chw(jpeg: bytes) -> np.ndarray:
    """JPEG bytes -> float32 [3, H, W] in [0, 1] (what ToTensor computes)."""
    from PIL import Image

    with Image.open(io.BytesIO(jpeg)) as image:
        pixels = np.asarray(image.convert("RGB"))
    # C-contiguous: Petastorm's TransformSpec path only ravels row-major arrays.
    return np.ascontiguousarray(pixels.transpose(2, 0, 1), dtype=np.float32) * np.float32(1 / 255)


def run_petastorm(parquet: str, args: argparse.Namespace, model_step: bool) -> Dict[str, Any]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Petastorm 0.12 on pyarrow 14: legacy-API warnings
        from petastorm import TransformSpec, make_batch_reader
        from petastorm.pytorch import DataLoader

    size = args.size

    def decode_frame(frame):
        frame["image"] = frame["image"].map(decode_pillow_chw)
        return frame

    spec = TransformSpec(
        decode_frame, edit_fields=[("image", np.float32, (3, size, size), False)], selected_fields=["image", "label"]
    )
    model = make_cnn(args.width) if model_step else None
    optimizer = _sgd(model) if model_step else None
    started = time.time()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reader = make_batch_reader(
            "file://" + os.path.abspath(parquet),
            schema_fields=["image", "label"],
            transform_spec=spec,
            reader_pool_type="thread",
            workers_count=args.cores,
            shuffle_row_groups=True,
            seed=0,
            num_epochs=None,  # endless: --images may exceed one pass
        )
        loader = DataLoader(reader, batch_size=args.batch_size, shuffling_queue_capacity=args.petastorm_shuffle_queue)
        try:
            batches = ((b["image"], b["label"]) for b in loader)
            result = timed_loop(batches, args.images // args.batch_size, size, model, optimizer)
        finally:
            reader.stop()
            reader.join()
    return {
        "images_per_s": result["images"] / result["steady_s"],
        "first_batch_s": result["first_batch_at"] - started,
        "loss": (result["loss_head"], result["loss_tail"]),
        "torch_threads": result["torch_threads"],
    }


# ---- 4: torch DataLoader over ImageFolder ---------------------------------------------------


class PillowImageFolder(torch.utils.data.Dataset):
    """Stand-in for ``ImageFolder(root, transform=ToTensor())`` when torchvision cannot be
    imported: the same sorted class folders, the same PIL loader, ToTensor's arithmetic."""

    def __init__(self, root: str) -> None:
        classes = sorted(e.name for e in os.scandir(root) if e.is_dir())
        self.samples = [
            (os.path.join(root, c, name), index)
            for index, c in enumerate(classes)
            for name in sorted(os.listdir(os.path.join(root, c)))
        ]

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> Tuple[torch.Tensor, int]:
        from PIL import Image

        path, label = self.samples[index]
        with open(path, "rb") as f:
            image = Image.open(f).convert("RGB")
        pixels = torch.from_numpy(np.asarray(image).copy()).permute(2, 0, 1).contiguous()
        return pixels.float().div(255), label


def torchvision_or_error() -> Tuple[Any, Optional[str]]:
    try:
        import torchvision  # noqa: F401 - a CUDA torchvision beside a CPU torch fails here
        import torchvision.datasets  # noqa: F401
        import torchvision.io  # noqa: F401
        import torchvision.transforms  # noqa: F401

        return torchvision, None
    except Exception as exc:  # noqa: BLE001 - RuntimeError "operator torchvision::nms does not exist", ImportError...
        return None, f"{type(exc).__name__}: {exc}"


def run_torch(folder: str, args: argparse.Namespace, model_step: bool) -> Dict[str, Any]:
    torchvision, _ = torchvision_or_error() if args.folder_dataset != "pillow" else (None, None)
    model = make_cnn(args.width) if model_step else None
    optimizer = _sgd(model) if model_step else None
    started = time.time()
    if torchvision is not None:
        from torchvision import datasets, transforms

        dataset = datasets.ImageFolder(folder, transform=transforms.ToTensor())
    else:
        dataset = PillowImageFolder(folder)
    loader = torch.utils.data.DataLoader(
        dataset,
        batch_size=args.batch_size,
        shuffle=True,
        num_workers=args.cores,
        drop_last=True,
        generator=torch.Generator().manual_seed(0),
    )

    def batches():
        while True:
            yield from loader

    result = timed_loop(batches(), args.images // args.batch_size, args.size, model, optimizer)
    return {
        "images_per_s": result["images"] / result["steady_s"],
        "first_batch_s": result["first_batch_at"] - started,
        "loss": (result["loss_head"], result["loss_tail"]),
        "torch_threads": result["torch_threads"],
    }


# ---- reference: the model on batches already in memory -------------------------------------


def run_memory(parquet: str, args: argparse.Namespace, model_step: bool, pool: int = 2048) -> Dict[str, Any]:
    """The model's own ceiling on these cores: shuffled batches sliced from ``pool`` images
    decoded beforehand (cycled), so no decoding or loading is timed."""
    import pyarrow.parquet as pq

    table = pq.read_table(parquet).slice(0, pool)
    images = torch.from_numpy(np.stack([decode_pillow_chw(b) for b in table.column("image").to_pylist()]))
    labels = torch.from_numpy(table.column("label").to_numpy().astype(np.int64))
    started = time.time()  # the decoding above is not the pipeline's: the first batch is immediate
    model = make_cnn(args.width) if model_step else None
    optimizer = _sgd(model) if model_step else None
    generator = torch.Generator().manual_seed(0)

    def batches():
        while True:
            order = torch.randperm(len(labels), generator=generator)
            for start in range(0, len(order) - args.batch_size + 1, args.batch_size):
                index = order[start : start + args.batch_size]
                yield images[index], labels[index]

    result = timed_loop(batches(), args.images // args.batch_size, args.size, model, optimizer)
    return {
        "images_per_s": result["images"] / result["steady_s"],
        "first_batch_s": result["first_batch_at"] - started,
        "loss": (result["loss_head"], result["loss_tail"]),
        "torch_threads": result["torch_threads"],
    }


# ---- decoders, single thread ----------------------------------------------------------------


def decoder_figures(parquet: str, count: int, repeats: int) -> Dict[str, Any]:
    """Single-thread images/s of Pillow and torchvision.io.decode_jpeg on the same bytes."""
    import pyarrow.parquet as pq
    from PIL import Image

    table = pq.read_table(parquet, columns=["image"])
    jpegs = table.column("image").to_pylist()[:count]
    torchvision, error = torchvision_or_error()
    cases: Dict[str, Callable[[bytes], Any]] = {}

    def pillow_uint8(b):
        with Image.open(io.BytesIO(b)) as image:
            return np.asarray(image.convert("RGB"))

    def pillow_plain(b):
        with Image.open(io.BytesIO(b)) as image:
            return np.asarray(image)

    cases["Pillow: open + np.asarray (no convert; these are RGB already) -> uint8 HWC"] = pillow_plain
    cases["Pillow: open + convert('RGB') -> uint8 HWC (ImageFolder's loader)"] = pillow_uint8
    cases["Pillow + float CHW / 255 (ToTensor's arithmetic)"] = lambda b: (
        torch.from_numpy(pillow_uint8(b)).permute(2, 0, 1).float().div(255)
    )
    if torchvision is not None:
        from torchvision.io import ImageReadMode, decode_jpeg

        cases["torchvision.io.decode_jpeg -> uint8 CHW"] = lambda b: decode_jpeg(
            torch.frombuffer(b, dtype=torch.uint8), mode=ImageReadMode.RGB
        )
        cases["decode_jpeg + float / 255"] = lambda b: (
            decode_jpeg(torch.frombuffer(b, dtype=torch.uint8), mode=ImageReadMode.RGB).float().div(255)
        )
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    figures: Dict[str, float] = {}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # frombuffer on read-only bytes
            for name, fn in cases.items():
                for b in jpegs[:50]:
                    fn(b)  # warm-up
                best = 0.0
                for _ in range(repeats):
                    start = time.perf_counter()
                    for b in jpegs:
                        fn(b)
                    best = max(best, len(jpegs) / (time.perf_counter() - start))
                figures[name] = best
    finally:
        torch.set_num_threads(saved)
    return {"figures": figures, "images": len(jpegs), "torchvision_error": error}


# ---- driver ---------------------------------------------------------------------------------


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=8_000, help="images per measurement (per row and mode)")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2, help="best of N")
    parser.add_argument(
        "--cores", type=int, default=2, help="cores every pipeline gets (decode threads/workers, torch threads)"
    )
    parser.add_argument("--count", type=int, default=20_000, help="images generated")
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--data", default=None, help="where the images are (generated there if missing)")
    parser.add_argument("--width", type=int, default=16, help="the CNN's first conv channels (then 2x, 4x)")
    parser.add_argument("--pipelines", default=",".join(PIPELINES), help=f"comma-separated, of: {', '.join(PIPELINES)}")
    parser.add_argument(
        "--petastorm-shuffle-queue", type=int, default=0, help="petastorm.pytorch.DataLoader shuffling_queue_capacity"
    )
    parser.add_argument(
        "--folder-dataset",
        choices=("auto", "pillow"),
        default="auto",
        help="auto: torchvision's ImageFolder when importable; pillow: the stand-in",
    )
    parser.add_argument(
        "--decode-images", type=int, default=2_000, help="images in the single-thread decoder comparison (0: skip)"
    )
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.pipelines.split(",") if n.strip()]
    unknown = [n for n in names if n not in PIPELINES]
    if unknown:
        parser.error(f"unknown pipeline(s) {unknown}; choose from {list(PIPELINES)}")
    if args.images < 2 * args.batch_size:
        parser.error("--images must be at least two batches")
    warnings.simplefilter("ignore", FutureWarning)

    manifest = generate(args.data or default_out(args.count, args.size), args.count, args.size)
    parquet, folder = manifest["parquet"], manifest["folder"]
    torch.set_num_threads(args.cores)
    torchvision, tv_error = torchvision_or_error()
    if args.folder_dataset == "pillow" or torchvision is None:
        PIPELINES["torch"] = "torch DataLoader + Pillow folder dataset" + (
            "" if args.folder_dataset == "pillow" else " (no torchvision)"
        )

    spark = None
    if any(n.startswith("sparkdl") for n in names):
        from _spark import local_cluster

        spark = local_cluster(
            "sparkdl-benchmark-images",
            executor_memory_mb=2048,
            pythonpath=(ROOT, BENCH),
            workers=1,
            cores_per_worker=args.cores,
            task_cpus=args.cores,
        )
    sparkdl_runner = SparkdlRunner(spark, parquet, args)
    runners = {
        "sparkdl-arrow": lambda model_step: sparkdl_runner("arrow", model_step),
        "sparkdl-petastorm": lambda model_step: sparkdl_runner("petastorm", model_step),
        "petastorm": lambda model_step: run_petastorm(parquet, args, model_step),
        "torch": lambda model_step: run_torch(folder, args, model_step),
        "memory": lambda model_step: run_memory(parquet, args, model_step),
    }
    print(
        f"{manifest['params']['count']:,} JPEGs {args.size}x{args.size} RGB (mean {manifest['mean_jpeg_bytes'] / 1024:.1f} KiB) in {parquet} "
        f"and {folder}; {args.images:,} images ({args.images // args.batch_size} batches of {args.batch_size}) per measurement, "
        f"best of {args.repeats}; {args.cores} cores; model: ResNet-style CNN width {args.width} "
        f"({sum(p.numel() for p in make_cnn(args.width).parameters()):,} parameters), SGD lr 0.01",
        flush=True,
    )
    results: Dict[Tuple[str, bool], List[Dict[str, Any]]] = {}
    errors: Dict[str, str] = {}
    for repeat in range(args.repeats):
        for name in names:
            for model_step in (False, True):
                if name in errors:
                    continue
                try:
                    figure = runners[name](model_step)
                except Exception as exc:  # noqa: BLE001 - report the row as failed, measure the others
                    errors[name] = (
                        f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
                    )
                    if os.environ.get("SPARKDL_BENCH_TRACEBACK"):
                        traceback.print_exc()
                    print(f"  {PIPELINES[name]}: FAILED ({errors[name][:300]})", flush=True)
                    continue
                results.setdefault((name, model_step), []).append(figure)
                print(
                    f"  repeat {repeat + 1}, {PIPELINES[name]}, {'into the model' if model_step else 'data path alone'}: "
                    f"{figure['images_per_s']:,.0f} images/s, first batch {figure['first_batch_s']:.2f} s",
                    flush=True,
                )
    if spark is not None:
        spark.stop()

    def best(name: str, model_step: bool) -> Optional[Dict[str, Any]]:
        runs = results.get((name, model_step))
        if not runs:
            return None
        top = max(runs, key=lambda r: r["images_per_s"])
        return {
            **top,
            "first_batch_s": min(r["first_batch_s"] for r in runs),
            "first_batch_in_task_s": min((r.get("first_batch_in_task_s") or 0.0) for r in runs),
        }

    def ratio(value: Optional[Dict[str, Any]], base: Optional[Dict[str, Any]]) -> str:
        return f"{value['images_per_s'] / base['images_per_s']:.2f}" if value and base else "—"

    base_model, base_alone = best("torch", True), best("torch", False)
    peta_model, peta_alone = best("petastorm", True), best("petastorm", False)
    print()
    print(
        "| pipeline | into the model, images/s | vs torch DataLoader | vs Petastorm loop | data path alone, images/s "
        "| vs torch DataLoader | vs Petastorm loop | time to first batch |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name in names:
        model, alone = best(name, True), best(name, False)
        if model is None and alone is None:
            print(f"| {PIPELINES[name]} | failed: {errors.get(name, '?')[:200]} | | | | | | |")
            continue
        first = min(r["first_batch_s"] for r in (model, alone) if r)
        reference = name == "memory"  # its data path is a slice: ratios and first batch say nothing
        print(
            f"| {PIPELINES[name]} | {model['images_per_s']:,.0f} | {ratio(model, base_model)} | {ratio(model, peta_model)} "
            f"| {alone['images_per_s']:,.0f} | {'—' if reference else ratio(alone, base_alone)} "
            f"| {'—' if reference else ratio(alone, peta_alone)} | {'—' if reference else f'{first:.2f} s'} |"
            if model and alone
            else f"| {PIPELINES[name]} | partial: {errors.get(name, '?')[:200]} | | | | | | |"
        )
    print()
    for name in names:
        model = best(name, True)
        if model and model.get("loss") and model["loss"][0] is not None:
            extra = (
                f"; first batch {model['first_batch_in_task_s']:.2f} s after train_fn started in the task"
                if name.startswith("sparkdl")
                else ""
            )
            print(
                f"{PIPELINES[name]}: torch threads {model['torch_threads']}, loss {model['loss'][0]:.3f} -> {model['loss'][1]:.3f} "
                f"(first/last 10 steps){extra}"
            )
    if sparkdl_runner.cold_first_batch_s is not None:
        print(
            f"sparkdl: the session's first sparkdl.run (cold executor Python worker) took {sparkdl_runner.cold_first_batch_s:.2f} s "
            f"to its first batch; the rows above ran after warm-up jobs"
        )
    if tv_error:
        print(f"torchvision not importable ({tv_error[:160]}): row 4 used the Pillow stand-in, no decode_jpeg figures")

    if args.decode_images:
        decoders = decoder_figures(parquet, args.decode_images, max(args.repeats, 3))
        print(f"\nSingle-thread decode, {decoders['images']:,} of the same JPEGs, best of {max(args.repeats, 3)}:\n")
        print("| decoder | images/s | µs/image |")
        print("|---|---:|---:|")
        for name, rate in decoders["figures"].items():
            print(f"| {name} | {rate:,.0f} | {1e6 / rate:.0f} |")


if __name__ == "__main__":
    main()
