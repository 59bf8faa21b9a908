"""The campaign: every scenario by name, in the order it runs (one registry, each scenario module's
``RUNNERS``), and the table of their rows.
"""

from __future__ import annotations

import sys
from typing import Any

from bench.chaos import disagg, faults, regions, stores
from bench.chaos.fleet import Opts
from bench.chaos.measure import Runner

# Every scenario, by name, in the order the campaign runs them.
RUNNERS: dict[str, Runner] = faults.RUNNERS | stores.RUNNERS | disagg.RUNNERS | regions.RUNNERS
SCENARIOS = list(RUNNERS)


def fmt_s(x: float | None) -> str:
    return "–" if x is None else f"{x:.2f}"


def table(rows: list[dict[str, Any]]) -> str:
    head = (
        "| scenario | streams | requests | completed | migrated | failed | hangs | bad text "
        "| ledger lost / wrong | held after | crashed | unacked | stalled > 0.5 s | stall p50 / max s "
        "| TTFT after p50 / max s |\n"
        "| --- | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: | --- | ---: | ---: "
        "| ---: | ---: |\n"
    )
    lines = []
    for r in rows:
        if r.get("skipped"):
            lines.append(f"| {r['scenario']} | skipped: {r['skipped']} |" + " – |" * 13)
            continue
        failed = str(r["failed"])
        if r["failed_by"]:
            failed += " (" + ", ".join(f"{k}: {v}" for k, v in sorted(r["failed_by"].items())) + ")"
        lines.append(
            f"| {r['scenario']} | {r['streams']} | {r['requests']} | {r['completed']} "
            f"| {r['migrated']} | {failed} | {r['hangs']} | {r['bad_text']} "
            f"| {r['ledger_lost']} / {r['ledger_wrong']} | {r['held_after_total']:.0f} "
            f"| {', '.join(r['crashed']) or '0'} "
            f"| {r['router_consumer'].get('ack_pending', '?')} "
            f"| {r['stalled']} of {r['open_at_fault']} "
            f"| {fmt_s(r['stall_s'][0])} / {fmt_s(r['stall_s'][1])} "
            f"| {fmt_s(r['ttft_after_s'][0])} / {fmt_s(r['ttft_after_s'][1])} |"
        )
    return head + "\n".join(lines)


async def campaign(names: list[str], opts: Opts) -> list[dict[str, Any]]:
    rows = []
    for name in names:
        try:
            rows.append(await RUNNERS[name](opts))
        except Exception as e:  # a fleet that would not start: say so, go on
            print(f"[{name}] could not run: {e!r}", file=sys.stderr, flush=True)
    return rows
