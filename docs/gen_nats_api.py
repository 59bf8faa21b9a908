"""Regenerate the generated parts of docs/nats-api.md and docs/schemas/*.json.

    .venv/bin/python docs/gen_nats_api.py          # write
    .venv/bin/python docs/gen_nats_api.py --check  # exit 1 when either is stale

The generated text comes from ``libs.client.docs.render_reference`` (subjects, streams, message
fields, error codes, limits) and ``libs.protocol.json_schemas``; the prose around it is by hand.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from libs.client.docs import render_reference, splice  # noqa: E402
from libs.protocol import json_schemas  # noqa: E402

DOC = ROOT / "docs" / "nats-api.md"
SCHEMAS = ROOT / "docs" / "schemas"


def expected() -> dict[Path, str]:
    """Every generated file and its expected text."""
    out = {DOC: splice(DOC.read_text(), render_reference())}
    for name, schema in json_schemas().items():
        out[SCHEMAS / f"{name}.json"] = json.dumps(schema, indent=2, sort_keys=True) + "\n"
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--check", action="store_true", help="only report stale files")
    args = p.parse_args(argv)
    stale = [
        path for path, text in expected().items() if not path.exists() or path.read_text() != text
    ]
    if args.check:
        for path in stale:
            print(f"stale: {path.relative_to(ROOT)} (run docs/gen_nats_api.py)")
        return 1 if stale else 0
    SCHEMAS.mkdir(parents=True, exist_ok=True)
    for path, text in expected().items():
        if path in stale:
            path.write_text(text)
            print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
