"""The name users are told to install is the one pyproject.toml builds (issue #30).

`sparkdl` on the package index is an unrelated project (Databricks' spark-deep-learning 0.2.2),
so the distribution is named otherwise while the import package stays `sparkdl`. Every
`pip install` in README.md and docs/*.md that installs this project (a requirement whose name
contains "sparkdl", with or without extras) must use pyproject's [project].name, and every
extra it names must exist. The install hints in the code, the Dockerfile's uninstall and the
Airflow provider's package-name follow the same name. Pure Python: tomllib and text."""

from __future__ import annotations

import glob
import os
import re
import shlex

import tomllib
from packaging.utils import canonicalize_name

from tests.conftest import REPO_ROOT

with open(os.path.join(REPO_ROOT, "pyproject.toml"), "rb") as _handle:
    PROJECT = tomllib.load(_handle)["project"]
NAME = PROJECT["name"]
EXTRAS = set(PROJECT["optional-dependencies"])

# A requirement given by name (not a path, URL or shell variable): name, optional [extras], optional version.
_REQUIREMENT = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)(?:\[([^\]]*)\])?(?:[<>=!~].*)?$")
# pip options that take a value: their value is not a requirement.
_VALUED = {
    "-r",
    "--requirement",
    "-c",
    "--constraint",
    "-e",
    "--editable",
    "-t",
    "--target",
    "-i",
    "--index-url",
    "--extra-index-url",
    "-f",
    "--find-links",
    "--prefix",
    "--root",
    "--python-version",
    "--platform",
}


def _commands(markdown: str) -> list:
    """The shell text of every fenced code block (continuation lines joined) and inline code span
    (line breaks inside a span are spaces)."""
    commands = []

    def fenced(match):
        commands.extend(match.group(1).replace("\\\n", " ").splitlines())
        return ""

    prose = re.sub(r"^```[^\n]*\n(.*?)^```", fenced, markdown, flags=re.S | re.M)
    commands.extend(span.replace("\n", " ") for span in re.findall(r"`([^`]+)`", prose))
    return commands


def project_installs(markdown: str) -> list:
    """(requirement as written, name, extras) for each requirement of a `pip install` naming the
    project, found as a name containing "sparkdl"."""
    found = []
    for command in _commands(markdown):
        for match in re.finditer(r"\bpip3?\s+install\b", command):
            lexer = shlex.shlex(command[match.end() :], posix=True, punctuation_chars=True)
            lexer.whitespace_split = True
            lexer.commenters = "#"
            try:
                tokens = list(lexer)
            except ValueError:  # an unbalanced quote: the span ends inside prose
                tokens = command[match.end() :].split()
            skip = False
            for token in tokens:
                if skip:
                    skip = False
                    continue
                if token in ("&&", "||", ";", "|", "&", "(", ")"):
                    break
                if token.startswith("-"):
                    skip = token in _VALUED
                    continue
                requirement = _REQUIREMENT.match(token)
                if requirement and "sparkdl" in requirement.group(1).lower():
                    extras = [e.strip() for e in (requirement.group(2) or "").split(",") if e.strip()]
                    found.append((token, requirement.group(1), extras))
    return found


def problems(markdown: str) -> list:
    """What is wrong with the project installs in ``markdown``: another name, an unknown extra."""
    wrong = []
    for token, name, extras in project_installs(markdown):
        if canonicalize_name(name) != canonicalize_name(NAME):
            wrong.append(f"pip install {token}: the distribution is {NAME}")
        wrong.extend(
            f"pip install {token}: no extra {extra!r} in pyproject.toml" for extra in extras if extra not in EXTRAS
        )
    return wrong


def _documents() -> dict:
    paths = [os.path.join(REPO_ROOT, "README.md"), *sorted(glob.glob(os.path.join(REPO_ROOT, "docs", "*.md")))]
    return {os.path.relpath(path, REPO_ROOT): open(path, encoding="utf-8").read() for path in paths}


def test_the_name_is_not_the_unrelated_sparkdl_on_the_index():
    assert canonicalize_name(NAME) != "sparkdl"
    assert "sparkdl" in NAME  # still recognisably this project


def test_every_pip_install_of_the_project_in_readme_and_docs_uses_pyprojects_name():
    documents = _documents()
    assert "docs/deploy.md" in documents and "docs/frameworks.md" in documents
    found = {path: project_installs(text) for path, text in documents.items()}
    assert len(found["README.md"]) >= 3 and found["docs/deploy.md"], found  # the checks below see installs
    wrong = {path: problems(text) for path, text in documents.items() if problems(text)}
    assert wrong == {}, wrong


def test_the_readme_tells_users_to_install_that_name():
    readme = _documents()["README.md"]
    plain = [token for token, _, extras in project_installs(readme) if not extras]
    assert NAME in plain, plain
    quick_start = readme.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    assert f"pip install {NAME}" in quick_start


def test_the_check_fails_on_the_old_name_and_on_unknown_extras():
    """The parser itself: these are the mistakes the tests above exist to catch."""
    assert problems("Run `pip install sparkdl` first.") == [f"pip install sparkdl: the distribution is {NAME}"]
    assert problems("```bash\npip install --quiet 'sparkdl[frameworks]' torch\n```\n")
    assert problems("a span over a line break: `pip install\n'sparkdl[notebook]'`")
    assert problems("`pip install --no-deps sparkdl apache-airflow-providers-apache-spark`")
    assert problems(f"`pip install '{NAME}[no-such-extra]'`") == [
        f"pip install {NAME}[no-such-extra]: no extra 'no-such-extra' in pyproject.toml"
    ]
    assert problems(f"`pip install {NAME}` and `pip install -e '.[test]'` and `pip install matplotlib`") == []
    assert project_installs("`/tmp/sparkdl-env/bin/pip install torch==2.13.0 --index-url https://x/sparkdl`") == []


def test_code_hints_the_dockerfile_and_the_airflow_provider_use_that_name():
    hints = []
    for pattern in ("sparkdl/**/*.py", "connectors/*.py", "sparkdl_airflow/*.py", "jobs/*.py", "Dockerfile"):
        for path in glob.glob(os.path.join(REPO_ROOT, pattern), recursive=True):
            text = open(path, encoding="utf-8").read()
            hints += [
                (os.path.relpath(path, REPO_ROOT), m.group(1))
                for m in re.finditer(r"pip (?:un)?install (?:-\S+ )*['\"`]*([\w.-]*sparkdl[\w.-]*)", text)
            ]
            hints += [
                (os.path.relpath(path, REPO_ROOT), m.group(1))
                for m in re.finditer(r"\b([\w.-]*sparkdl[\w.-]*)\[(\w+)\]", text)
                if m.group(2) in EXTRAS
            ]
    assert len(hints) >= 8, hints
    assert [hint for hint in hints if canonicalize_name(hint[1]) != canonicalize_name(NAME)] == []
    dockerfile = open(os.path.join(REPO_ROOT, "Dockerfile")).read()
    assert f"pip uninstall -y {NAME}\n" in dockerfile  # the placeholder install it removes is this name
    provider = open(os.path.join(REPO_ROOT, "sparkdl_airflow", "__init__.py")).read()
    # Airflow refuses a provider whose package-name is not the distribution declaring its entry point.
    assert re.search(r'^DISTRIBUTION = "([^"]+)"$', provider, re.M).group(1) == NAME
    assert '"package-name": DISTRIBUTION' in provider and "version(DISTRIBUTION)" in provider
    assert "apache_airflow_provider" in PROJECT["entry-points"]
