"""No function of the launch machinery over ~60 lines (issue #43), as scripts/function_lengths measures.

A function that runs a whole job (a task, a training loop, a launch) grows with every feature
until a newcomer cannot find one in it; these packages keep theirs as short lists of named phases.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import pathlib
import subprocess
import sys
import textwrap

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "function_lengths"
#: The packages held to the limit, relative to the repository root.
CHECKED = ["sparkdl/_driver", "sparkdl/_task"]
#: "No function over ~60 lines in _driver/ and _task/" (issue #43).
MAX_LINES = 60


def _measure():
    """scripts/function_lengths as a module (it has no .py suffix, so by its loader)."""
    loader = importlib.machinery.SourceFileLoader("function_lengths", str(SCRIPT))
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader(loader.name, loader))
    loader.exec_module(module)
    return module


def test_no_function_of_the_launch_machinery_is_over_the_limit():
    over = _measure().too_long(CHECKED, MAX_LINES)
    assert not over, f"functions over {MAX_LINES} lines: split them into named phases\n" + "\n".join(map(str, over))


SAMPLE = '''
import functools


@functools.lru_cache
def decorated():
    """Docstring lines count; the decorator above does not."""
    return 1


class Box:
    def method(self):
        def inner():
            return 2

        return inner()


if True:
    async def guarded():
        pass
'''


def test_a_length_runs_from_the_def_to_the_last_line_docstring_in_decorators_out(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "sample.py").write_text(textwrap.dedent(SAMPLE).lstrip())
    measured = _measure().function_lengths(["pkg"], root=tmp_path)
    assert [(f.name, f.line, f.length) for f in measured] == [
        ("Box.method", 11, 5),  # its nested function counts in it...
        ("decorated", 5, 3),
        ("Box.method.<locals>.inner", 12, 2),  # ...and is listed on its own
        ("guarded", 19, 2),  # defined under an if block
    ]
    assert all(f.path == "pkg/sample.py" for f in measured)


def test_the_script_lists_those_over_the_limit_longest_first_and_fails(tmp_path):
    (tmp_path / "sample.py").write_text(textwrap.dedent(SAMPLE).lstrip())
    over = subprocess.run(
        [sys.executable, str(SCRIPT), "--max", "2", str(tmp_path)], capture_output=True, text=True, timeout=60
    )
    assert over.returncode == 1, over.stderr
    listed = [line.split() for line in over.stdout.splitlines()]
    assert [(row[0].rsplit(":", 1)[1], row[1], row[2]) for row in listed] == [
        ("11", "5", "Box.method"),
        ("5", "3", "decorated"),
    ]
    assert "2 of 4 functions" in over.stderr
    within = subprocess.run(
        [sys.executable, str(SCRIPT), "--max", "5", str(tmp_path)], capture_output=True, text=True, timeout=60
    )
    assert (within.returncode, within.stdout) == (0, ""), within.stderr
