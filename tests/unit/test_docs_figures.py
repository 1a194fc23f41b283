"""Every performance figure has one source, docs/performance.md, with its command and date.

* Each measured section of docs/performance.md names the command that produced it and a date.
* Its summary ("In brief"): every bullet carries a date, a command and a link to its section,
  and every figure of the bullet is in that section (a figure quoted from another workload, as
  "3× Ray Train" once was, fails).
* Quotes: a passage marked ``<!-- quote: performance.md#NAME -->`` ... ``<!-- /quote -->`` in the
  README or a page of docs/ is word for word the passage marked ``[start:NAME]`` ... ``[end:NAME]``
  in docs/performance.md (links compared by what they point to). The README's "Performance"
  section is the summary, quoted.
* Elsewhere, a page that states a speed-up (``2.4×``, ``1.05x``) or a rate (``86k rows/s``,
  ``3.02 GB/s``) states one that docs/performance.md has; the rest link there.

Pure text checks: no Spark, no torch.
"""

from __future__ import annotations

import dataclasses
import os
import posixpath
import re
from typing import Dict, List, Optional, Tuple

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SOURCE = "docs/performance.md"

#: A speed-up or a rate: ``2.4×``, ``0.94–1.01×``, ``5.8x``, ``86k rows/s``, ``1,618,555 samples/s``,
#: ``3.02 GB/s``. A number followed by `` ×`` with a space (``2 × decode_threads``) is arithmetic.
NUMBER = r"\d[\d,]*(?:\.\d+)?[kM]?"
FIGURE = re.compile(
    rf"(?<![\w.,/])({NUMBER}(?:\s?[–-]\s?{NUMBER})?)"
    r"(?:(?P<ratio>[×x])(?![\w])|\s(?P<rate>(?:samples|images|rows|steps|msg|updates)/s)|\s?(?P<bytes>[kMG]B/s))"
)
#: A share (``4%``, ``3–3.5 %``): checked in the summary only (elsewhere ``20%`` of rows is no figure).
SHARE = re.compile(rf"(?<![\w.,/])({NUMBER}(?:\s?[–-]\s?{NUMBER})?)\s?%")
DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")
#: A command: a benchmark script or pytest in backticks, or a shell block running sparkdl or a script.
COMMAND = re.compile(r"`[^`]*(?:benchmarks/\w+\.py|pytest)[^`]*`|```bash\n[^`]*(?:sparkdl |benchmarks/)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*$", re.M)
START = re.compile(r"<!-- --8<-- \[start:([\w-]+)\] -->\n(.*?)<!-- --8<-- \[end:\1\] -->", re.S)
QUOTE = re.compile(r"<!-- quote: performance\.md#([\w-]+) -->\n(.*?)<!-- /quote -->", re.S)
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
LINK = re.compile(r"\]\(([^)\s]+)\)")


def read(path: str) -> str:
    with open(os.path.join(ROOT, path), encoding="utf-8") as handle:
        return handle.read()


def pages() -> List[str]:
    """The README and every page of the site but the generated API reference."""
    found = ["README.md"]
    for directory, _, files in os.walk(os.path.join(ROOT, "docs")):
        relative = os.path.relpath(directory, ROOT)
        if relative.startswith(os.path.join("docs", "api")) or relative.startswith(os.path.join("docs", "_tools")):
            continue
        found += [os.path.join(relative, name) for name in files if name.endswith(".md")]
    return sorted(found)


def slug(heading: str) -> str:
    """The anchor mkdocs (pymdownx's GitHub-style slugify, lower case) gives a heading."""
    text = re.sub(r"[`*]", "", heading).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


@dataclasses.dataclass
class Section:
    level: int
    title: str
    text: str  # the heading's whole section: up to the next heading of the same or a higher level


def sections(text: str) -> Dict[str, Section]:
    headings = [(m.start(), len(m.group(1)), m.group(2)) for m in HEADING.finditer(_without_fences(text))]
    found = {}
    for index, (start, level, title) in enumerate(headings):
        end = next((s for s, lv, _ in headings[index + 1 :] if lv <= level), len(text))
        found[slug(title)] = Section(level, title, text[start:end])
    return found


def _without_fences(text: str) -> str:
    """``text`` with fenced blocks blanked (same length: offsets still match), so a ``#`` comment
    in a shell block is no heading."""
    return FENCE.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), text)


def resolve_links(text: str, page: str) -> str:
    """Relative links rewritten to the repository path they point to, so a passage of
    docs/performance.md and its copy in the README compare equal."""

    def absolute(match: "re.Match[str]") -> str:
        target = match.group(1)
        if re.match(r"^[a-z]+://", target):
            return match.group(0)
        path, _, anchor = target.partition("#")
        resolved = posixpath.normpath(posixpath.join(posixpath.dirname(page), path)) if path else page
        return f"]({resolved}{'#' + anchor if anchor else ''})"

    return LINK.sub(absolute, text)


def figures(text: str) -> List[str]:
    return [re.sub(r"\s+", " ", m.group(0)) for m in FIGURE.finditer(text)]


def shares(text: str) -> List[str]:
    return [re.sub(r"\s+", " ", m.group(0)) for m in SHARE.finditer(text)]


def table_cells(text: str) -> List[str]:
    """The numbers that open a table cell (``**0.97** (0.95–0.98)`` gives ``0.97``)."""
    cells = []
    for line in text.splitlines():
        if line.startswith("|"):
            for cell in line.strip("|").split("|"):
                number = re.match(r"\s*\**\s*(" + NUMBER + r")", cell)
                if number:
                    cells.append(number.group(1))
    return cells


def found_in(figure: str, text: str) -> bool:
    """``figure`` is in ``text`` as written, or (a speed-up) as the number opening a table cell."""
    flat = re.sub(r"\s+", " ", text)
    if figure in flat:
        return True
    ratio = re.fullmatch(rf"({NUMBER})[×x]", figure)
    return bool(ratio) and ratio.group(1) in table_cells(text)


SOURCE_TEXT = read(SOURCE)
SECTIONS = sections(SOURCE_TEXT)
MARKED = {name: body for name, body in START.findall(SOURCE_TEXT)}


def summary_bullets() -> List[str]:
    return [bullet.strip() for bullet in re.split(r"^- ", MARKED["summary"], flags=re.M) if bullet.strip()]


def test_every_measured_section_of_performance_md_names_its_command_and_its_date():
    missing = []
    for section in SECTIONS.values():
        if section.level != 3:  # a level-4 part is checked with its section; level 2 only groups
            continue
        measured = "|---" in section.text or figures(section.text)
        if measured and not (DATE.search(section.text) and COMMAND.search(section.text)):
            missing.append(section.title)
    assert not missing, f"sections of {SOURCE} with figures but no command or no date: {missing}"


def test_every_summary_bullet_has_a_date_a_command_and_a_link_to_the_section_holding_its_figures():
    bullets = summary_bullets()
    assert len(bullets) >= 10
    problems = []
    for bullet in bullets:
        name = bullet.split("**")[1] if "**" in bullet else bullet[:40]
        anchors = re.findall(r"\]\(#([\w-]+)\)", bullet)
        if not DATE.search(bullet) or not COMMAND.search(bullet) or len(anchors) != 1:
            problems.append(f"{name}: needs a date, a command and one link to its section")
            continue
        section = SECTIONS.get(anchors[0])
        if section is None:
            problems.append(f"{name}: links to #{anchors[0]}, which is no heading of {SOURCE}")
            continue
        absent = [f for f in figures(bullet) + shares(bullet) if not found_in(f, section.text)]
        if absent:
            problems.append(f"{name}: {absent} not in its section '{section.title}'")
    assert not problems, "\n".join(problems)


def quotes(page: str) -> List[Tuple[str, str]]:
    return QUOTE.findall(read(page))


@pytest.mark.parametrize("page", [p for p in pages() if p != SOURCE])
def test_every_quote_of_performance_md_is_word_for_word(page):
    for name, body in quotes(page):
        assert name in MARKED, f"{page} quotes performance.md#{name}, which is not a marked passage there"
        assert resolve_links(body, page) == resolve_links(MARKED[name], SOURCE), (
            f"{page}'s quote of performance.md#{name} differs from docs/performance.md: copy it again"
        )


def test_the_readme_performance_section_is_the_summary_quoted():
    readme = sections(read("README.md"))["performance"].text
    quoted = dict(QUOTE.findall(readme))
    assert "summary" in quoted, "README's Performance section must quote docs/performance.md's summary"
    outside = QUOTE.sub("", readme)
    assert not figures(outside) and not shares(outside), (
        f"figures outside the quote: {figures(outside) + shares(outside)}"
    )


def _unquoted(page: str) -> str:
    return QUOTE.sub("", read(page))


@pytest.mark.parametrize("page", [p for p in pages() if p != SOURCE])
def test_speedups_and_rates_outside_performance_md_are_figures_it_has(page):
    flat_source = re.sub(r"\s+", " ", SOURCE_TEXT)
    strays = [f for f in figures(_unquoted(page)) if f not in flat_source]
    assert not strays, (
        f"{page} states {strays}, which docs/performance.md does not have: measure it there (with its command and "
        f"date) and link to it, or quote it"
    )


def _row(table: str, label: str) -> Optional[List[str]]:
    for line in table.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if cells and cells[0] == label:
            return cells
    return None


def test_the_summary_names_the_diloco_row_with_the_lowest_test_loss_after_ten_epochs():
    # The README once credited DiLoCo τ=16; the 10-epoch table says otherwise. Checked on the table.
    ten = SECTIONS["diloco"].text.split("30 epochs")[0]
    rows = [line for line in ten.splitlines() if line.startswith("| ") and "---" not in line][1:]
    losses = {row.split("|")[1].strip(): float(row.split("|")[6]) for row in rows}
    best = min(losses, key=losses.get)
    period = re.search(r"sync_every=(\d+)", best).group(1)
    assert best.startswith("DiLoCo")
    bullet = next(b for b in summary_bullets() if b.startswith("**DiLoCo**"))
    assert f"DiLoCo τ={period} had the lowest test loss" in bullet
    assert f"({losses[best]:.4f})" in bullet


def test_the_checks_catch_what_they_are_for():
    """The rules above on made-up text, so a regex that matches nothing cannot pass them all."""
    assert figures("2.4× as fast, 5.8x, 0.94–1.01× its rate, 86k rows/s, 3.02 GB/s, 1,618,555 samples/s") == [
        "2.4×",
        "5.8x",
        "0.94–1.01×",
        "86k rows/s",
        "3.02 GB/s",
        "1,618,555 samples/s",
    ]
    assert figures("2 × decode_threads, 64×64 JPEGs, the 0x10 flag, 8,192 rows of 256 B") == []
    assert shares("kept 4% of it, 3–3.5 % of its throughput") == ["4%", "3–3.5 %"]
    assert found_in("0.97×", "| x | **0.97** (0.95–0.98) |") and not found_in("0.97×", "| x | 0.98 |")
    assert resolve_links("[a](deploy.md#x) [b](#y)", "docs/performance.md") == (
        "[a](docs/deploy.md#x) [b](docs/performance.md#y)"
    )
    assert resolve_links("[a](docs/deploy.md#x)", "README.md") == "[a](docs/deploy.md#x)"
    assert slug("A plan for the digits MLP on a 10 Gbit/s link") == "a-plan-for-the-digits-mlp-on-a-10-gbits-link"
    assert slug("`sparkdl plan` against measurement") == "sparkdl-plan-against-measurement"
