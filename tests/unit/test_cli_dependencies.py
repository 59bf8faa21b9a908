"""Which way the dependencies point: the product CLI loads neither the benches nor the tests,
and no packaged module (libs, services, bench) imports ``tests``."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]


def test_importing_the_cli_loads_neither_bench_nor_tests() -> None:
    # A fresh interpreter: this one has imported both already.
    code = (
        "import sys, services.cli\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'bench', 'tests'}))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]"


def test_strait_bench_still_reaches_its_bench() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "services.cli", "bench", "serve", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    assert "usage: strait bench serve" in out.stdout


@pytest.mark.parametrize("package", ["libs", "services", "bench"])
def test_no_packaged_module_imports_tests(package: str) -> None:
    offenders = []
    for path in sorted((ROOT / package).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            else:
                continue
            offenders += [
                f"{path.relative_to(ROOT)}: {n}" for n in names if n.split(".")[0] == "tests"
            ]
    assert offenders == []
