"""The code's shape, read with ``ast`` (nothing imported): how long functions are in ``libs/``
and ``services/``, how many modules sit at the root of ``libs/``, how large ``bench/`` is next
to ``services/``, and whether the reference docs carry history.

Each bound is what the layout holds today, so it can only get tighter (issue 54's targets: at
most 3 functions of 80+ lines, at most 6 modules at ``libs/`` root, bench's Python no larger
than services'). ``python -m tests.unit.test_layout`` prints the figures.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
LONG_FUNCTION_LINES = 80
# Today's figures; lower them as the layout improves.
MAX_LONG_FUNCTIONS = 0
MAX_LIBS_ROOT_MODULES = 5
MAX_BENCH_OVER_SERVICES = 1.0  # bench's Python lines ÷ services' (issue 54: 1.0)
# The reference pages (docs/*.md; the decision records keep their history): no sittings, no
# "until <date>".
HISTORY = re.compile(r"\bsittings?\b|\buntil \d{4}-\d\d-\d\d", re.IGNORECASE)


def long_functions() -> list[tuple[int, str]]:
    """(lines, ``path:line name``) of every function of ``LONG_FUNCTION_LINES`` or more."""
    found = []
    for pkg in ("libs", "services"):
        for path in sorted((ROOT / pkg).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    n = (node.end_lineno or node.lineno) - node.lineno + 1
                    if n >= LONG_FUNCTION_LINES:
                        where = f"{path.relative_to(ROOT)}:{node.lineno} {node.name}"
                        found.append((n, where))
    return sorted(found, reverse=True)


def python_lines(folder: str) -> int:
    return sum(len(p.read_text().splitlines()) for p in (ROOT / folder).rglob("*.py"))


def libs_root_modules() -> list[str]:
    return sorted(p.name for p in (ROOT / "libs").glob("*.py") if p.name != "__init__.py")


def test_long_functions_do_not_grow_in_number() -> None:
    found = long_functions()
    assert len(found) <= MAX_LONG_FUNCTIONS, "\n".join(f"{n} {w}" for n, w in found)


def test_libs_root_does_not_grow() -> None:
    assert len(libs_root_modules()) <= MAX_LIBS_ROOT_MODULES, libs_root_modules()


def test_bench_does_not_outgrow_what_it_measures() -> None:
    bench, services = python_lines("bench"), python_lines("services")
    assert bench <= MAX_BENCH_OVER_SERVICES * services, (bench, services)


def test_reference_docs_carry_no_history() -> None:
    found = [
        f"{p.relative_to(ROOT)}:{i}: {line.strip()}"
        for p in [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md"]
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if HISTORY.search(line)
    ]
    assert found == [], "\n".join(found)


if __name__ == "__main__":
    for n, where in long_functions():
        print(f"{n:5} {where}")
    print(f"libs/ root modules: {len(libs_root_modules())}")
    print(f"Python lines: bench {python_lines('bench')}, services {python_lines('services')}")
