"""``--input NAME=SPEC``: the command line's spelling of the estimator's ``inputs=`` (a column,
dense columns, an image or a token sequence), shared by ``train``, ``compare``, ``plan`` and
``launch``."""

from __future__ import annotations

from typing import Any, Dict, List

from sparkdl.cli._common import UsageError


def parse_inputs(items: List[str]) -> Dict[str, Any]:
    """``--input NAME=SPEC`` arguments as the ``inputs=`` dict (see ``--help``)."""
    from sparkdl.data.inputs import Image, Sequence

    inputs: Dict[str, Any] = {}
    for item in items:
        name, sep, spec = item.partition("=")
        name = name.strip()
        if not sep or not name or not spec:
            raise UsageError(f"--input {item!r}: expected NAME=SPEC, e.g. image=image:jpeg_bytes:224x224x3")
        if name in inputs:
            raise UsageError(f"--input {name!r} is given twice")
        kind, _, rest = spec.partition(":")
        try:
            if kind == "image" and rest:
                parts = rest.split(":")
                column, shape, options = parts[0], (parts[1] if len(parts) > 1 else ""), parts[2:]
                dims = [int(v) for v in shape.lower().split("x")] if shape else []
                if len(dims) not in (2, 3):
                    raise UsageError(f"--input {item!r}: image size must be HxW or HxWxC, e.g. 224x224x3")
                crop = [int(o.split("=", 1)[1]) for o in options if o.startswith("crop=")]
                unknown = [o for o in options if o != "flip" and not o.startswith("crop=")]
                if unknown:
                    raise UsageError(f"--input {item!r}: unknown image option(s) {unknown}; valid: flip, crop=PIXELS")
                inputs[name] = Image(
                    column,
                    size=(dims[0], dims[1]),
                    channels=dims[2] if len(dims) == 3 else 3,
                    random_flip="flip" in options,
                    random_crop=crop[0] if crop else 0,
                )
            elif kind == "sequence" and rest:
                parts = rest.split(":")
                if len(parts) not in (2, 3):
                    raise UsageError(f"--input {item!r}: expected sequence:COLUMN:MAX_LENGTH[:PAD]")
                inputs[name] = Sequence(
                    parts[0],
                    max_length=int(parts[1]),
                    pad_value=int(parts[2]) if len(parts) == 3 else 0,
                    lengths_input=f"{name}_lengths",
                )
            elif kind == "dense" and rest:
                inputs[name] = [c.strip() for c in rest.split(",") if c.strip()]
            elif ":" not in spec and "," not in spec:
                inputs[name] = spec.strip()
            else:
                raise UsageError(
                    f"--input {item!r}: SPEC must be COLUMN, dense:COLS, image:COLUMN:HxW[xC] or sequence:COLUMN:MAX_LENGTH[:PAD]"
                )
        except ValueError as exc:
            raise UsageError(f"--input {item!r}: {exc}") from exc
    return inputs
