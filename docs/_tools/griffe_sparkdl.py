"""A griffe extension for the API reference (mkdocs.yml loads it; the site does not include it).

It adapts two habits of sparkdl's docstrings, written for readers of the source, to the
Markdown the site renders, before griffe parses them.

Sphinx roles, ``:class:`~sparkdl.TorchModel```, become code spans (`TorchModel`): Markdown has no
roles, and would print the role's name. ``Double backticks`` are already Markdown code spans. A
paragraph ending in ``::`` before an indented block ends in ``:`` (Markdown shows the indented
block as code by itself).

Some docstrings describe several parameters in one Google-style ``Args:`` entry,
because they mean the same as elsewhere::

    Args:
        data, feature_cols, inputs, label_col, batch_size,
            transform_fn, cache_dir: the data, as for ``sparkdl.run``.

griffe's Google parser reads one name per entry, so it warns ("Failed to get 'name: description'
pair") and drops the entry. Such an entry becomes one entry per name with the same description,
so each parameter gets its row in the rendered table.
"""

from __future__ import annotations

import re
from typing import Any, List

import griffe

_NAME = r"\*{0,2}[A-Za-z_]\w*"
# The first line of a grouped entry: two or more names, or one name and a trailing comma
# (the list goes on on the next line); optionally the colon and the description's start.
_HEAD = re.compile(rf"^(?P<indent>[ \t]+)(?P<names>{_NAME}(?:\s*,\s*{_NAME})*)\s*(?P<end>,\s*$|:\s?(?P<rest>.*)$)")
# A continuation of the names on the next, deeper-indented line.
_MORE = re.compile(rf"^[ \t]+(?P<names>{_NAME}(?:\s*,\s*{_NAME})*)\s*(?P<end>,\s*$|:\s?(?P<rest>.*)$)")
# :class:`x`, :func:`~a.b.c`, :py:meth:`x`: the role's target; "~" shows only its last part.
_ROLE = re.compile(r":(?:py:)?(?:class|func|meth|mod|attr|exc|data|obj|const):`(?P<tilde>~?)(?P<target>[^`]+)`")
# "Example::", a blank line, then an indented block: reST's literal block.
_LITERAL = re.compile(r"^(?P<text>.*\S)::[ \t]*\n(?P<rest>[ \t]*\n[ \t]+\S)", re.M)
_SECTIONS = re.compile(r"^\s*(Args|Arguments|Parameters|Keyword Args|Keyword Arguments|Other Parameters):\s*$")


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def split_grouped_params(text: str) -> str:
    """``text`` with every grouped ``Args:`` entry split into one entry per name."""
    lines = text.splitlines()
    out: List[str] = []
    i, in_args, item_indent = 0, False, None
    while i < len(lines):
        line = lines[i]
        if _SECTIONS.match(line):
            in_args, item_indent = True, None
            out.append(line)
            i += 1
            continue
        if in_args and line.strip() and item_indent is not None and _indent(line) < item_indent:
            in_args = False  # dedented past the entries: the section has ended
        head = _HEAD.match(line) if in_args else None
        if head and (item_indent is None or _indent(line) == item_indent):
            item_indent = _indent(line)
            names = [n.strip() for n in head.group("names").split(",")]
            end, rest, j = head.group("end"), head.group("rest"), i + 1
            while end.startswith(","):  # the names go on on the next line
                more = _MORE.match(lines[j]) if j < len(lines) and _indent(lines[j]) > item_indent else None
                if more is None:
                    break
                names += [n.strip() for n in more.group("names").split(",")]
                end, rest, j = more.group("end"), more.group("rest"), j + 1
            if len(names) > 1 and not end.startswith(","):
                # The description: the rest of the names' line, then its deeper-indented lines.
                body = [rest or ""]
                while j < len(lines) and (not lines[j].strip() or _indent(lines[j]) > item_indent):
                    body.append(lines[j].strip())
                    j += 1
                while body and not body[-1]:
                    body.pop()
                pad = " " * item_indent
                for name in names:
                    out.append(f"{pad}{name}: {body[0]}".rstrip())
                    out.extend(f"{pad}    {part}" if part else "" for part in body[1:])
                i = j
                continue
        out.append(line)
        i += 1
    return "\n".join(out)


def roles_to_code(text: str) -> str:
    """``text`` with every Sphinx role replaced by a code span of its target, and every ``::``
    that opens a literal block by ``:``."""

    def code(match: "re.Match[str]") -> str:
        target = match.group("target")
        return "`" + (target.rsplit(".", 1)[-1] if match.group("tilde") else target) + "`"

    return _LITERAL.sub(r"\g<text>:\n\g<rest>", _ROLE.sub(code, text))


class SparkdlDocstrings(griffe.Extension):
    """Rewrites each docstring as the module docstring says, before griffe parses it."""

    def on_instance(self, *, node: Any, obj: griffe.Object, agent: Any, **kwargs: Any) -> None:
        docstring = obj.docstring
        if docstring is not None:
            docstring.value = split_grouped_params(roles_to_code(docstring.value))
