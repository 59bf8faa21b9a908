"""Every repository path named in the docs exists: in ``docs/`` (markdown), the README, and the
docstrings and comments of ``libs/``, ``services/`` and ``bench/``.

A path is a word starting with one of the top-level folders (``libs/``, ``services/``,
``bench/``, ``docs/``, ``configs/``, ``deploy/``, ``tests/``). Left out: URLs, globs and
placeholders (``*``, ``<r>``, ``{name}``), and the folders benches write (git-ignored). A
dotted tail names something in a module (``libs/engine/kv_transfer.encode``): the module file
must exist. Nothing is imported; the sources are read with ``ast`` and ``tokenize``.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
TOP = ("libs", "services", "bench", "docs", "configs", "deploy", "tests")
SOURCES = ("libs", "services", "bench")
# Written by the benches at run time, git-ignored.
GENERATED = ("bench/results",)

# A candidate: a top-level folder, a slash, then the run of path characters after it (a
# placeholder or glob character included, so the whole word is judged at once).
_PATH = re.compile(r"(?<![\w./:-])(?:" + "|".join(TOP) + r")/[\w./*<>{}-]*")
_URL_BEFORE = re.compile(r"[a-z]+://\S*$")
_PLACEHOLDER = re.compile(r"[*<>{}]")


def _docstrings_and_comments(path: Path) -> str:
    source = path.read_text()
    parts = [
        doc
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
        and (doc := ast.get_docstring(node, clean=False))
    ]
    tokens = tokenize.generate_tokens(io.StringIO(source).readline)
    parts += [tok.string for tok in tokens if tok.type == tokenize.COMMENT]
    return "\n".join(parts)


def _texts() -> Iterator[tuple[Path, str]]:
    """(file, the prose of it that may name paths) for every file the test reads."""
    for path in sorted((ROOT / "docs").rglob("*.md")):
        yield path, path.read_text()
    yield ROOT / "README.md", (ROOT / "README.md").read_text()
    for pkg in SOURCES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            yield path, _docstrings_and_comments(path)


def named_paths(text: str) -> Iterator[str]:
    """The repository paths ``text`` names, URLs, globs and placeholders left out."""
    for match in _PATH.finditer(text):
        word = match.group(0)
        if _URL_BEFORE.search(text[max(0, match.start() - 200) : match.start()]):
            continue
        if _PLACEHOLDER.search(word):
            continue
        word = word.rstrip(".-/")
        if word.startswith(GENERATED):
            continue
        yield word


def exists(word: str) -> bool:
    """Whether ``word`` is a file or folder of the repository, or ``module.name`` of a file."""
    if (ROOT / word).exists():
        return True
    head, _, last = word.rpartition("/")
    stem = last.split(".")[0]
    return bool(stem) and ((ROOT / head / f"{stem}.py").exists() or (ROOT / head / stem).is_dir())


def test_named_paths_exist() -> None:
    stale = [
        f"{path.relative_to(ROOT)}: {word}"
        for path, text in _texts()
        for word in named_paths(text)
        if not exists(word)
    ]
    assert stale == [], "paths named in docs or comments that do not exist:\n" + "\n".join(stale)


def test_the_scan_sees_paths_and_skips_what_is_not_one() -> None:
    text = (
        "see `libs/engine/kv_transfer.encode`, (libs/nowhere.py), "
        "https://example.com/libs/x.py, deploy/k8s/overlays/region-<r>, tests/**/*.py, "
        "bench/results/engine-<ts>.json and bench/results/."
    )
    assert list(named_paths(text)) == ["libs/engine/kv_transfer.encode", "libs/nowhere.py"]
    assert exists("libs/engine/kv_transfer.encode")
    assert not exists("libs/nowhere.py")
