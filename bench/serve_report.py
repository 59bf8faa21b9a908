"""Summaries, the comparison table and the result files of a serving benchmark.

Latencies are reported in milliseconds. ``itl_ms`` pools every inter-token gap of every
request (so long answers weigh more, as they do for a user reading them); ``tpot_ms`` has one
value per request, its mean gap. Throughputs divide by the run's wall time, from its start to
the end of its last response.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bench.serve_run import RunResult
from bench.stats import SLO, RequestTiming, Summary, goodput, summarize


def _ms(values: Sequence[float | None]) -> list[float]:
    return [v * 1000.0 for v in values if v is not None]


def latency_samples_ms(run: RunResult) -> dict[str, list[float]]:
    """The latency samples of a run's successful requests, by metric, in milliseconds."""
    ok = [r for r in run.records if r.ok]
    return {
        "ttft": _ms([r.ttft_s for r in ok]),
        "itl": _ms([gap for r in ok for gap in r.itl_s]),
        "tpot": _ms([r.mean_itl_s for r in ok]),
        "e2e": _ms([r.e2e_s for r in ok]),
    }


def summarize_run(run: RunResult, slo: SLO) -> dict[str, Any]:
    """Everything the table, the plots and results.json say about one run."""
    ok = [r for r in run.records if r.ok]
    samples = latency_samples_ms(run)
    summaries: dict[str, Summary] = {name: summarize(values) for name, values in samples.items()}
    duration = run.duration_s
    output_tokens = sum(r.output_tokens for r in ok)
    prompt_tokens = [r.prompt_tokens for r in ok if r.prompt_tokens is not None]
    errors = Counter(r.error for r in run.records if not r.ok and r.error)
    timings = [
        RequestTiming(ok=r.ok, ttft_s=r.ttft_s, mean_itl_s=r.mean_itl_s, e2e_s=r.e2e_s)
        for r in run.records
    ]
    lags = [r.start_s - r.scheduled_s for r in run.records if r.scheduled_s is not None]
    return {
        "target": run.target,
        "model": run.model,
        "load": run.load.label,
        "concurrency": run.load.concurrency,
        "rate": run.load.rate,
        "sent": len(run.records),
        "completed": len(ok),
        "failed": len(run.records) - len(ok),
        "not_sent": run.not_sent,
        "errors": dict(sorted(errors.items())),
        "duration_s": duration,
        "request_throughput": len(ok) / duration if duration > 0 else 0.0,
        "output_token_throughput": output_tokens / duration if duration > 0 else 0.0,
        "output_tokens": output_tokens,
        "prompt_tokens": sum(prompt_tokens) if prompt_tokens else None,
        "tokens_from_usage": all(r.tokens_from_usage for r in ok) if ok else False,
        # Open loop: how late the client sent its latest request (a cap, or an overloaded client).
        "max_send_lag_ms": max(lags) * 1000.0 if lags else None,
        **{f"{name}_ms": summary.to_dict() for name, summary in summaries.items()},
        "slo": asdict(slo),
        "goodput": goodput(timings, slo, duration).to_dict(),
    }


def _fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def comparison_table(summaries: Sequence[dict[str, Any]], slo: SLO) -> str:
    """A fixed-width table with one row per (target, load)."""
    goodput_header = "goodput" if not slo.empty else "success"
    header = [
        "target",
        "load",
        "ok/sent",
        "req/s",
        "out tok/s",
        "TTFT p50",
        "TTFT p99",
        "ITL p50",
        "ITL p99",
        "TPOT p50",
        "E2E p50",
        "E2E p99",
        goodput_header,
        "errors",
    ]
    rows = [header]
    for s in summaries:
        good = s["goodput"]
        errors = ",".join(f"{k}:{v}" for k, v in s["errors"].items()) or "-"
        rows.append(
            [
                s["target"],
                s["load"],
                f"{s['completed']}/{s['sent']}",
                _fmt(s["request_throughput"], 2),
                _fmt(s["output_token_throughput"], 1),
                _fmt(s["ttft_ms"]["p50"]),
                _fmt(s["ttft_ms"]["p99"]),
                _fmt(s["itl_ms"]["p50"]),
                _fmt(s["itl_ms"]["p99"]),
                _fmt(s["tpot_ms"]["p50"]),
                _fmt(s["e2e_ms"]["p50"], 0),
                _fmt(s["e2e_ms"]["p99"], 0),
                f"{good['fraction'] * 100:.0f}% {good['rate_per_s']:.2f}/s",
                errors,
            ]
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=True)) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    note = "latencies in ms"
    if not slo.empty:
        parts = [
            f"{name}<={value * 1000:g}ms"
            for name, value in (("TTFT", slo.ttft_s), ("TPOT", slo.itl_s), ("E2E", slo.e2e_s))
            if value is not None
        ]
        note += f"; goodput = requests meeting {' and '.join(parts)}"
    return "\n".join([*lines, note])


def write_results(
    out_dir: Path, meta: dict[str, Any], runs: Sequence[RunResult], summaries: Sequence[dict]
) -> list[Path]:
    """Write ``results.json`` (settings and summaries) and ``requests.jsonl`` (every request)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    results = out_dir / "results.json"
    results.write_text(json.dumps({"meta": meta, "runs": list(summaries)}, indent=2) + "\n")
    requests = out_dir / "requests.jsonl"
    with requests.open("w") as fh:
        for run in runs:
            for record in run.records:
                line = {"target": run.target, "load": run.load.label, **asdict(record)}
                fh.write(json.dumps(line) + "\n")
    return [results, requests]
