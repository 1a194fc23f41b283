"""examples/notebook.ipynb executed by a real Jupyter kernel (ipykernel through nbclient): the
model is defined in a cell, fit shows its live table, transform scores held-out rows, a plot is drawn.
The kernel is its own Spark driver (its own local-cluster application)."""

from __future__ import annotations

import html
import os
import re
import sys
import time
from typing import Any, Dict, List

import pytest

pytestmark = [pytest.mark.spark, pytest.mark.slow]

NOTEBOOK = os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "examples", "notebook.ipynb"
)
EPOCHS = 6  # what the notebook's fit cell asks for


def _recording_client(notebook: Any, **kwargs: Any) -> Any:
    # Imported here: the Petastorm stack collects this file but neither installs nor runs it.
    from nbclient import NotebookClient

    class RecordingClient(NotebookClient):
        """Keeps every display message the kernel sends, with the cell it belongs to and when it came:
        the executed notebook holds only each display's last state, not the updates that led there."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.displays: List[Dict[str, Any]] = []
            self.cell_finished: Dict[int, float] = {}
            self.on_cell_executed = self._finished

        def _finished(self, cell: Any, cell_index: int, execute_reply: Any) -> None:
            self.cell_finished[cell_index] = time.monotonic()

        def process_message(self, msg: Dict[str, Any], cell: Any, cell_index: int) -> Any:
            kind = msg["msg_type"]
            if kind in ("display_data", "update_display_data"):
                self.displays.append(
                    {
                        "type": kind,
                        "cell": cell_index,
                        "at": time.monotonic(),
                        "sent": msg["header"]["date"],
                        "data": msg["content"].get("data", {}),
                        "display_id": msg["content"].get("transient", {}).get("display_id"),
                    }
                )
            return super().process_message(msg, cell, cell_index)

    return RecordingClient(notebook, **kwargs)


def _table_rows(markup: str) -> List[List[str]]:
    rows = re.findall(r"<tr>(.*?)</tr>", markup)
    return [[html.unescape(cell) for cell in re.findall(r"<t[dh]>(.*?)</t[dh]>", row)] for row in rows]


def _cell_index(notebook: Any, needle: str) -> int:
    return next(i for i, cell in enumerate(notebook.cells) if cell.cell_type == "code" and needle in cell.source)


def _text(cell: Any) -> str:
    parts = []
    for output in cell.get("outputs", []):
        if output.output_type == "stream":
            parts.append(output.text)
        elif output.output_type in ("execute_result", "display_data"):
            parts.append(output.get("data", {}).get("text/plain", ""))
    return "".join(parts)


@pytest.fixture(scope="module")
def executed(tmp_path_factory):
    import nbformat

    notebook = nbformat.read(NOTEBOOK, as_version=4)
    env_dir = tmp_path_factory.mktemp("notebook")
    client = _recording_client(
        notebook, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(env_dir)}}
    )
    # The kernel is started from this interpreter (ipykernel's native "python3" is sys.executable);
    # its executors run the same one.
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    client.execute()
    return notebook, client


def test_every_cell_ran_without_an_error(executed):
    notebook, _ = executed
    errors = [
        (i, out.get("ename"), out.get("evalue"))
        for i, cell in enumerate(notebook.cells)
        if cell.cell_type == "code"
        for out in cell.get("outputs", [])
        if out.output_type == "error"
    ]
    assert errors == []
    assert all(cell.get("execution_count") for cell in notebook.cells if cell.cell_type == "code")


def test_the_fit_cell_shows_a_table_that_grows_one_row_per_epoch_while_it_runs(executed):
    notebook, client = executed
    fit = _cell_index(notebook, "estimator.fit(")
    shown = [d for d in client.displays if d["cell"] == fit]
    assert shown, "the fit cell displayed nothing"
    first, updates = shown[0], shown[1:]
    assert first["type"] == "display_data" and "starting training" in first["data"]["text/html"]
    assert updates and {u["type"] for u in updates} == {"update_display_data"}
    assert {u["display_id"] for u in updates} == {first["display_id"]}  # one table, updated in place
    epochs_shown = [[row[0] for row in _table_rows(u["data"]["text/html"])[1:]] for u in updates]
    assert epochs_shown == [[str(e) for e in range(1, n + 1)] for n in range(1, EPOCHS + 1)], epochs_shown
    header = _table_rows(updates[-1]["data"]["text/html"])[0]
    assert header[:2] == ["epoch", "loss"] and "val_accuracy" in header
    # Live, not at the end: the kernel sent the first epoch's table while the later epochs were
    # still to run (a display fed only when the tasks end would send all six at once).
    assert all(u["at"] <= client.cell_finished[fit] for u in updates)
    later_epochs = sum(float(row[header.index("seconds")]) for row in _table_rows(updates[-1]["data"]["text/html"])[2:])
    spread = (updates[-1]["sent"] - updates[0]["sent"]).total_seconds()
    assert spread >= 0.5 * later_epochs > 0, (spread, later_epochs)
    # The executed notebook keeps the final table as the fit cell's output.
    final = [out for out in notebook.cells[fit].outputs if out.output_type == "display_data"]
    assert len(final) == 1 and len(_table_rows(final[0]["data"]["text/html"])) == EPOCHS + 1


def test_the_history_cell_shows_every_epoch_and_the_loss_went_down(executed):
    notebook, _ = executed
    cell = notebook.cells[_cell_index(notebook, "pd.DataFrame(model.history)")]
    text = _text(cell)
    lines = [line.split() for line in text.strip().splitlines()[1:]]
    assert [int(parts[1]) for parts in lines] == list(range(1, EPOCHS + 1)), text
    losses = [float(parts[2]) for parts in lines]
    assert losses[-1] < 0.5 * losses[0], text


def test_held_out_rows_are_scored_by_transform(executed):
    notebook, _ = executed
    text = _text(notebook.cells[_cell_index(notebook, "model.transform(test_df)")])
    found = re.search(r"held-out accuracy: ([0-9.]+)", text)
    assert found, text
    assert float(found.group(1)) > 0.85


def test_the_loss_curves_are_drawn_once(executed):
    import base64
    import io

    from PIL import Image as PILImage

    notebook, _ = executed
    cell = notebook.cells[_cell_index(notebook, "sparkdl.plot_history(model")]
    images = [out["data"]["image/png"] for out in cell.outputs if "image/png" in out.get("data", {})]
    assert len(images) == 1, [out.output_type for out in cell.outputs]
    with PILImage.open(io.BytesIO(base64.b64decode(images[0]))) as image:
        width, height = image.size
    assert width > 1.5 * height  # two panels side by side: loss, val_accuracy


def test_no_cell_prints_pysparks_pandas3_warning(executed):
    # It opened every run (PySpark 4.1+ on pandas 3); sparkdl filters that one message (sparkdl._spark).
    notebook, _ = executed
    printed = "".join(_text(cell) for cell in notebook.cells if cell.cell_type == "code")
    assert "PySpark does not yet fully support pandas" not in printed
