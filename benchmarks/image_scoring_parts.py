"""Where an image's scoring time goes, on one thread without Spark, side by side in one run:
decoding a 64x64 JPEG (Pillow as users call it, against sparkdl's decode into the batch, which
takes libjpeg-turbo straight for JPEGs of the wanted size) and the inference benchmark's small
CNN (``optimize="off"``: the module on whole batches, against ``"auto"``: a frozen graph called
on the rows per call it scores fastest in).

    .venv/bin/python benchmarks/image_scoring_parts.py [--images 1024] [--repeats 5]
"""

from __future__ import annotations

import argparse
import io
import os
import sys
import time
from typing import Callable, List

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _inference_workloads import IMAGE_SIZE, SmallCNN  # noqa: E402
from make_images import draw, encode  # noqa: E402

from sparkdl.data.pixels import decoded_pixels  # noqa: E402
from sparkdl.inference.execution import ModelRunner  # noqa: E402


def best_seconds(call: Callable[[], object], repeats: int) -> float:
    call()
    times: List[float] = []
    for _ in range(repeats):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    jpegs = [encode(draw(i, size=IMAGE_SIZE)[0]) for i in range(args.images)]
    size = (IMAGE_SIZE, IMAGE_SIZE)

    def pillow() -> np.ndarray:
        from PIL import Image

        return np.stack([np.asarray(Image.open(io.BytesIO(jpeg)).convert("RGB")) for jpeg in jpegs])

    per_image = 1e6 / args.images
    decode = {
        "Pillow open/convert/asarray": best_seconds(pillow, args.repeats) * per_image,
        "sparkdl decoded_pixels": best_seconds(lambda: decoded_pixels(jpegs, size, 3), args.repeats) * per_image,
    }
    assert np.array_equal(pillow(), decoded_pixels(jpegs, size, 3)), "the decoders disagree"
    batch = decoded_pixels(jpegs, size, 3).transpose(0, 3, 1, 2).astype(np.float32) / np.float32(255)
    model = SmallCNN().eval()
    runners = {
        'CNN, optimize="off" (whole batch)': ModelRunner(model, torch.device("cpu"), None, args.images, optimize="off"),
        'CNN, optimize="auto"': ModelRunner(model, torch.device("cpu"), None, args.images, key="cnn", optimize="auto"),
    }
    score = {
        name: best_seconds(lambda r=runner: r(batch), args.repeats) * per_image for name, runner in runners.items()
    }
    print(
        f"{args.images} {IMAGE_SIZE}x{IMAGE_SIZE} JPEGs, one thread, best of {args.repeats}, torch {torch.__version__}"
    )
    print("| part | µs per image | vs the first |\n|---|---:|---:|")
    for figures in (decode, score):
        first = next(iter(figures.values()))
        for name, micros in figures.items():
            print(f"| {name} | {micros:.1f} | {first / micros:.2f}× |")


if __name__ == "__main__":
    main()
